"""What the backward pass saves under a half policy, per front end, against
the model's own half config.

What it measures
----------------
The values JAX saves on the forward pass of a loss's gradient for its
backward pass (`jmp_policy.core.diagnostics.saved_residuals`), the
arguments (parameters, the batch) left out, summed as `size * itemsize`:
the activations a train step keeps alive, which on a GPU are memory and
bandwidth. Each front end runs the model's float32 config under a policy;
the reference is the model's own half config (its layers' `dtype`, or its
parameters cast to the compute dtype), with float32 parameters. Target:
every front end at most 1.02x the own config's bytes under `mixed_bfloat16`
(and the FP8 policies, which compute in bfloat16). Under `mixed_float16`,
printed without a target, `autocast` keeps PyTorch AMP's float32 wherever a
float32 value meets a half one (float16 has not float32's range).

  Transformer   the example linen Transformer LM (`jmp_policy/app/transformer_lm.py`:
                2 pre-LN blocks of attention and a GELU MLP, batch 16 x 32):
                own = its `dtype=` field; `with_policy`; `autocast`
  Equinox       a pre-LN Equinox block (multi-head attention, GELU MLP,
                batch 8 x 32 tokens of width 64) mapped over the batch:
                own = its parameters cast to the compute dtype (Equinox has
                no dtype field; mpx and the Equinox docs do this); `autocast`
  MaxText       tiny llama2 and mixtral, `scan_layers` and `remat_policy`
                (tests/corpus/maxtext_saved.py): own = `dtype=bfloat16`;
                `PolicyModule` with `config_dtype=jnp.float32` (MaxText's
                `cfg.dtype`; without it, printed and not judged),
                `with_policy` (its linen form, held against that form's
                own config), `autocast`
  EasyDeL       a tiny Llama (tests/corpus/easydel_saved.py): own =
                `dtype=bfloat16` with its attention in bfloat16;
                `PolicyModule`, `autocast`

Usage::

    python benchmarks/saved_bytes.py               # ~4 minutes on 2 CPU cores
    python benchmarks/saved_bytes.py --no-maxtext  # ~30 seconds
    python benchmarks/saved_bytes.py --h200        # + H200 temporary memory (CUDA plugin;
                                                   #   MaxText's ~15 minutes)
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp

import jmp_policy
from jmp_policy.app import transformer_lm
from jmp_policy.core.diagnostics import saved_residuals

TARGET = 1.02
POLICIES = {"mixed_bfloat16": jnp.bfloat16, "mixed_float16": jnp.float16}
TARGETED = ("mixed_bfloat16",)


def saved_bytes(loss: Callable[..., jax.Array], *args: Any) -> int:
    """Bytes `jax.grad(loss)` saves for its backward pass, arguments left out."""
    return sum(
        int(aval.size) * aval.dtype.itemsize
        for aval, origin in saved_residuals(loss, *args)
        if not origin.startswith("from the argument")
    )


Losses = tuple[dict[str, Callable[..., jax.Array]], tuple[Any, ...]]


def transformer(policy: str, half: Any) -> Losses:
    """The example Transformer's loss by front end, and its arguments."""
    lm = transformer_lm
    batches, _, vocab = lm.make_data(1)
    model = lm.make_model(vocab)
    params = lm.init_params(model, "float32")
    applies: dict[str, Callable[..., Any]] = {
        "own config": lm.make_model(vocab, dtype=half).apply,
        "with_policy": jmp_policy.with_policy(model.apply, policy),
        "autocast": jmp_policy.autocast(model.apply, policy),
    }
    losses: dict[str, Callable[..., jax.Array]] = {
        name: functools.partial(lm.loss_fn, apply) for name, apply in applies.items()
    }
    return losses, (params, jnp.asarray(batches[0]))


class EquinoxBlock(eqx.Module):
    """A pre-LN Transformer block for one sequence `[tokens, width]`."""

    norm1: eqx.nn.LayerNorm
    attention: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    up: eqx.nn.Linear
    down: eqx.nn.Linear

    def __init__(self, width: int, heads: int, key: jax.Array) -> None:
        k1, k2, k3 = jax.random.split(key, 3)
        self.norm1 = eqx.nn.LayerNorm(width)
        self.attention = eqx.nn.MultiheadAttention(heads, width, key=k1)
        self.norm2 = eqx.nn.LayerNorm(width)
        self.up = eqx.nn.Linear(width, 4 * width, key=k2)
        self.down = eqx.nn.Linear(4 * width, width, key=k3)

    def __call__(self, x: jax.Array) -> jax.Array:
        h = jax.vmap(self.norm1)(x)
        x = x + self.attention(h, h, h)
        h = jax.vmap(self.norm2)(x)
        return x + jax.vmap(self.down)(jax.nn.gelu(jax.vmap(self.up)(h)))


def _to(dtype: Any) -> Callable[[Any], Any]:
    def cast(x: Any) -> Any:
        floating = eqx.is_array(x) and jnp.issubdtype(x.dtype, jnp.floating)
        return x.astype(dtype) if floating else x

    return cast


def equinox(policy: str, half: Any) -> Losses:
    """The Equinox block's loss by front end, and its arguments."""
    params, static = eqx.partition(EquinoxBlock(64, 4, jax.random.key(0)), eqx.is_inexact_array)
    x = jax.random.normal(jax.random.key(1), (8, 32, 64))

    def own(params: Any, x: jax.Array) -> jax.Array:
        block = eqx.combine(jax.tree.map(_to(half), params), static)
        return jax.vmap(block)(x.astype(half))

    def mixed(params: Any, x: jax.Array) -> jax.Array:
        return jax.vmap(eqx.combine(params, static))(x)

    def loss(call: Callable, params: Any, x: jax.Array) -> jax.Array:
        return jnp.mean(jnp.square(call(params, x).astype(jnp.float32)))

    calls = {"own config": own, "autocast": jmp_policy.autocast(mixed, policy)}
    return {name: functools.partial(loss, c) for name, c in calls.items()}, (params, x)


MODELS = {"Transformer": transformer, "Equinox": equinox}


def h200_temp_bytes(loss: Callable[..., jax.Array], *args: Any) -> int:
    """Temporary memory of `jax.grad(loss)` compiled for an H200, without a GPU
    (the CUDA plugin for the installed jaxlib: `gpu_compile.cuda_device`)."""
    import gpu_compile  # Only here: it reads the GPU targets.

    device = gpu_compile.cuda_device(gpu_compile.target_configs()["h200_sxm"])
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    compiled = jax.jit(jax.grad(loss)).lower(*jax.tree.map(spec, args)).compile()
    memory = compiled.memory_analysis()
    assert memory is not None  # The GPU compiler reports it.
    return int(memory.temp_size_in_bytes)


def figures(model: str, policy: str, measure: Callable[..., int] = saved_bytes) -> dict[str, int]:
    """`measure` of `model`'s loss under `policy`, by front end."""
    losses, args = MODELS[model](policy, POLICIES[policy])
    return {name: measure(loss, *args) for name, loss in losses.items()}


ROOT = Path(__file__).resolve().parent.parent
# What `./run` installs apart (their pins clash with this project's).
MAXTEXT, EASYDEL = ROOT / ".venv" / "maxtext", ROOT / ".venv" / "easydel"


def run_apart(script: str, packages: Path, *args: str) -> Any:
    """The JSON line tests/corpus/`script` prints last, run with `packages` first
    on the path: saved bytes by front end (MaxText's: by layout too), or
    with `--h200` the temporary memory compiled for an H200."""
    path = os.pathsep.join(str(p) for p in (packages, ROOT / "tests", ROOT, ROOT / "benchmarks"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "corpus" / script), *args],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


# A front end held against the own config of the same form of the model, where
# there is one (MaxText's linen `TransformerLinen` for `with_policy`).
OWN_FORM = {"with_policy": "own config (linen)"}


def print_rows(label: str, figures: dict[str, int], targeted: bool = True) -> bool:
    """Prints one model's figures against its own config's; whether all hold."""
    held = True
    for name, value in figures.items():
        ratio = value / figures.get(OWN_FORM.get(name, ""), figures["own config"])
        judged = targeted and not name.startswith("own config") and "no config_dtype" not in name
        short = judged and ratio > TARGET
        held = held and not short
        mark = "  FALLS SHORT" if short else ""
        print(f"{label:<42} {name:<30} {value:>10,}  {ratio:.3f}{mark}")
    return held


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--no-maxtext", action="store_true", help="leave out MaxText (~3 minutes on 2 cores)"
    )
    parser.add_argument(
        "--h200",
        action="store_true",
        help="also the temporary memory compiled for an H200 (needs the CUDA plugin)",
    )
    args = parser.parse_args(argv)
    print(
        f"Bytes saved for the backward pass (arguments left out), per front end, against the "
        f"model's own half config; jax {jax.__version__}, {jax.default_backend()}, "
        f"{platform.machine()}"
    )
    print(f"{'model, policy':<42} {'front end':<30} {'saved bytes':>10}  x own config")
    print("-" * 97)
    held = True
    for model in MODELS:
        for policy in POLICIES:
            found = figures(model, policy)
            held = print_rows(f"{model} {policy}", found, policy in TARGETED) and held
    held = apart_rows(args.no_maxtext) and held
    verdict = "holds" if held else "FALLS SHORT"
    print(f"every front end <= {TARGET} x the own config's saved bytes, bfloat16: {verdict}")
    if args.h200:
        print("\nTemporary memory of the loss gradient compiled for an H200 (no GPU needed)")
        for model in MODELS:
            found = figures(model, TARGETED[0], h200_temp_bytes)
            print_rows(f"{model} {TARGETED[0]}", found, targeted=False)
        apart_rows(args.no_maxtext, "--h200")
    return 0


def apart_rows(no_maxtext: bool, *args: str) -> bool:
    """Prints MaxText's and EasyDeL's rows (each installed apart); whether all hold."""
    held, targeted = True, not args
    if no_maxtext:
        pass
    elif (MAXTEXT / "maxtext").is_dir():
        for layout, found in run_apart("maxtext_saved.py", MAXTEXT, *args).items():
            held = print_rows(f"MaxText {layout}", found, targeted) and held
    else:
        print("MaxText: not installed (./run puts it in .venv/maxtext)")
    if (EASYDEL / "easydel").is_dir():
        found = run_apart("easydel_saved.py", EASYDEL, *args)
        held = print_rows("EasyDeL llama", found, targeted) and held
    else:
        print("EasyDeL: not installed (./run puts it in .venv/easydel)")
    return held


if __name__ == "__main__":
    sys.exit(main())
