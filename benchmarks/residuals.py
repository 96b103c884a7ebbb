"""Bytes saved for the backward pass, and step time, of the example Transformer.

What it measures
----------------
The loss of `examples/transformer_lm.py` (a character-level linen Transformer
LM: embeddings, 2 pre-LN blocks of LayerNorm + causal
MultiHeadDotProductAttention + GELU MLP, final LayerNorm, Dense head; batch
16 x 32 tokens) as a function of its float32 parameters, in three variants:

  float32            `with_policy(model.apply, "float32")`
  mixed_bfloat16     `with_policy(model.apply, "mixed_bfloat16")`: the model as
                     written, every layer computing in bfloat16 by the policy
  flax dtype=bf16    no jmp_policy: `dtype=jnp.bfloat16` set by hand on every
                     Flax layer, float32 parameters (Flax's own recipe)

1. Residual bytes: the values JAX saves on the forward pass for the backward
   pass (`jax._src.ad_checkpoint.saved_residuals`, the function behind
   `jax.ad_checkpoint.print_saved_residuals`), summed as
   `size * itemsize` over all of them, parameters that are saved included.
   Reported with the ratio to float32; the target of issue 4 is
   mixed_bfloat16 <= 0.55 of float32. The float32 residuals of the
   mixed_bfloat16 run are itemised by where they come from.
2. Step time: the median wall time of the jitted train step of the example
   (README pattern: `loss_scaled(adam, NoOpLossScale())`), interleaved
   round-robin over the variants. On CPU, half precision is expected to be
   slower (converts, no bfloat16 matrix units); it is reported, not judged.

Usage::

    .venv/bin/python benchmarks/residuals.py            # ~1 minute on 2 CPU cores
    .venv/bin/python benchmarks/residuals.py --no-time  # residual bytes only, seconds
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax._src.ad_checkpoint import saved_residuals

import jmp_policy

TARGET_RATIO = 0.55
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "transformer_lm.py"


def load_example():
    """Imports `examples/transformer_lm.py` (not a package) as `transformer_lm`."""
    name = "transformer_lm"
    module = sys.modules.get(name)
    if module is not None and Path(getattr(module, "__file__", "")).resolve() == EXAMPLE:
        return module
    spec = importlib.util.spec_from_file_location(name, EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # linen modules are dataclasses: they look it up
    spec.loader.exec_module(module)
    return module


class Variant(NamedTuple):
    name: str
    apply: Callable  # apply(variables, tokens) -> logits


def make_variants(lm, vocab_size: int) -> tuple[Any, list[Variant]]:
    """Returns `(model, variants)`: the three variants share the parameters of `model`."""
    model = lm.make_model(vocab_size)
    by_hand = lm.make_model(vocab_size, dtype=jnp.bfloat16)
    return model, [
        Variant("float32", jmp_policy.with_policy(model.apply, "float32")),
        Variant("mixed_bfloat16", jmp_policy.with_policy(model.apply, "mixed_bfloat16")),
        Variant("flax dtype=bf16", by_hand.apply),
    ]


def residuals(lm, apply: Callable, params, batch) -> list[tuple[Any, str]]:
    """The `(aval, where it comes from)` pairs saved for the backward pass of the loss."""
    return saved_residuals(functools.partial(lm.loss_fn, apply), params, batch)


def nbytes(res: Sequence[tuple[Any, str]]) -> int:
    return sum(int(aval.size) * aval.dtype.itemsize for aval, _ in res)


def residual_bytes(seed: int = 0) -> dict[str, int]:
    """Residual bytes of the example Transformer's loss per variant (what the test checks)."""
    lm = load_example()
    batches, _, vocab_size = lm.make_data(1, seed=seed)
    model, variants = make_variants(lm, vocab_size)
    params = lm.init_params(model, "float32", seed)
    return {v.name: nbytes(residuals(lm, v.apply, params, batches[0])) for v in variants}


def _origin(description: str) -> str:
    # "output of mul from /.../flax/linen/normalization.py:214:4 (_normalize)"
    #   -> "mul in normalization.py:214 (_normalize)"
    if description.startswith("from the argument"):
        return "a parameter (argument)"
    what, _, where = description.partition(" from ")
    what = what.removeprefix("output of ")
    if not where:
        return what
    location, _, function = where.partition(" ")
    file, _, line = Path(location).name.partition(":")
    return f"{what} in {file}:{line.split(':')[0]} {function}".rstrip()


def layernorm_bytes(res: Sequence[tuple[Any, str]]) -> int:
    """Bytes of the residuals saved inside Flax's normalisation code (the LayerNorms)."""
    return sum(
        int(aval.size) * aval.dtype.itemsize
        for aval, description in res
        if "flax/linen/normalization.py" in description.replace("\\", "/")
    )


def itemise(res: Sequence[tuple[Any, str]], dtype=np.float32) -> list[tuple[str, int, int]]:
    """`(origin, count, bytes)` of the residuals of `dtype`, largest first."""
    count, total = collections.Counter(), collections.Counter()
    for aval, description in res:
        if aval.dtype == dtype:
            key = _origin(description)
            count[key] += 1
            total[key] += int(aval.size) * aval.dtype.itemsize
    return sorted(((k, count[k], total[k]) for k in total), key=lambda r: -r[2])


# -------------------------------------------------------------------------- timing


def time_steps(lm, model, variants, params, batches, budget_s: float) -> dict[str, list[float]]:
    """Interleaved per-step wall times (one sample = 5 steps) of each variant's train step."""
    tx = jmp_policy.loss_scaled(optax.adam(lm.LEARNING_RATE), jmp_policy.NoOpLossScale())

    def make_step(apply):
        @jax.jit
        def step(params, opt_state, batch):
            loss_scale = jmp_policy.get_loss_scale(opt_state)

            def scaled_loss(p):
                loss = lm.loss_fn(apply, p, batch)
                return loss_scale.scale(loss), loss

            grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    steps = [make_step(v.apply) for v in variants]
    states = [(params, tx.init(params)) for _ in variants]
    k = 5

    def run(i, j0):
        p, s = states[i]
        for j in range(k):
            p, s, loss = steps[i](p, s, batches[(j0 + j) % len(batches)])
        jax.block_until_ready(loss)
        states[i] = (p, s)

    for i in range(len(variants)):  # compile and warm up
        run(i, 0)
    samples = {v.name: [] for v in variants}
    deadline, rounds = time.perf_counter() + budget_s, 0
    while rounds < 5 or time.perf_counter() < deadline:
        for j in range(len(variants)):
            i = (rounds + j) % len(variants)  # rotate the starting variant
            t0 = time.perf_counter()
            run(i, rounds * k)
            samples[variants[i].name].append((time.perf_counter() - t0) / k)
        rounds += 1
    return samples


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-time", action="store_true", help="skip the step-time part")
    parser.add_argument("--budget", type=float, default=20.0, help="seconds of timed rounds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="a short timing budget (5 s)")
    args = parser.parse_args(argv)
    if args.quick:
        args.budget = min(args.budget, 5.0)

    lm = load_example()
    batches, _, vocab_size = lm.make_data(20, seed=args.seed)
    model, variants = make_variants(lm, vocab_size)
    params = lm.init_params(model, "float32", args.seed)
    n_params = sum(p.size for p in jax.tree.leaves(params))
    print(
        f"Example Transformer LM: {n_params:,} float32 params, batch "
        f"{batches.shape[1]} x {batches.shape[2] - 1} tokens; jax {jax.__version__}, "
        f"{jax.devices()[0].platform}, {platform.processor() or platform.machine()}"
    )

    print("\nBytes saved for the backward pass (sum of residuals of the loss)")
    res = {v.name: residuals(lm, v.apply, params, batches[0]) for v in variants}
    base = nbytes(res["float32"])
    header = (
        f"{'variant':<18}{'residuals':>10}{'bytes':>12}{'x float32':>11}"
        f"{'of which f32':>14}{'in LayerNorm':>14}"
    )
    print(header)
    print("-" * len(header))
    for v in variants:
        r = res[v.name]
        f32 = sum(b for _, _, b in itemise(r))
        print(
            f"{v.name:<18}{len(r):>10}{nbytes(r):>12,}{nbytes(r) / base:>11.3f}"
            f"{f32:>14,}{layernorm_bytes(r):>14,}"
        )
    ratio = nbytes(res["mixed_bfloat16"]) / base
    verdict = "meets" if ratio <= TARGET_RATIO else "MISSES"
    print(f"mixed_bfloat16 / float32 = {ratio:.3f}: {verdict} the target <= {TARGET_RATIO}")
    rest = (nbytes(res["mixed_bfloat16"]) - layernorm_bytes(res["mixed_bfloat16"])) / (
        base - layernorm_bytes(res["float32"])
    )
    print(f"  outside the LayerNorms: {rest:.3f}")

    print("\nfloat32 residuals of mixed_bfloat16, by origin")
    for origin, count, b in itemise(res["mixed_bfloat16"]):
        print(f"  {b:>10,} bytes  {count:>3} x  {origin}")

    if not args.no_time:
        samples = time_steps(lm, model, variants, params, batches, args.budget)
        print(f"\nTrain step time, interleaved, {len(samples['float32'])} rounds x 5 steps")
        header = f"{'variant':<18}{'median ms':>10}{'IQR ms':>9}{'x float32':>11}"
        print(header)
        print("-" * len(header))
        base_t = np.asarray(samples["float32"])
        for v in variants:
            t = np.asarray(samples[v.name])
            q1, med, q3 = np.percentile(t, [25, 50, 75])
            paired = np.median(t / base_t)  # paired by round: robust to drifts
            print(f"{v.name:<18}{med * 1e3:>10.2f}{(q3 - q1) * 1e3:>9.2f}{paired:>11.2f}")
        print("(CPU: no bfloat16 matrix units; half precision is expected to be slower here)")
    return 0 if ratio <= TARGET_RATIO else 1


if __name__ == "__main__":
    sys.exit(main())
