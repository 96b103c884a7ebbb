"""What the CPU form of half-precision products costs on this CPU.

XLA:CPU before jaxlib 0.12.1 rejects some bf16 x bf16 -> f32 dots
("Unsupported element type for DotThunk::Execute"), so on the CPU platform,
under those jaxlibs, jmp_policy emits every half x half -> f32 product as
one 3-D dot with a leading batch dimension
(`jmp_policy/engine/products/cpu_form.py`). This benchmark times that form
against the dot as written, where the dot as written runs, and reports
where it fails (under any jaxlib: it turns the form on and off itself):

  dense fwd / dx / dw   the three products of a Dense layer's train step,
                        [T, K] x [K, N] (T = 2048, K = N = 512 quick: 256)
  attention backward    the product XLA:CPU rejected in the backward pass of
                        attention: [B, H, D, S] x [B, S, H, D] over (B, H)
  MLP train step        a 4 x 256 MLP (batch 256), `with_policy` with
                        "p=f32,c=bf16,o=f32,m=bf16,r=f32", the README's train step
  Transformer step      the example Transformer LM's train step, same policy
                        (not in --quick)

For each: float32 (for scale), the dot as written (bf16 x bf16 -> f32 as
the program states it), and jmp_policy's CPU form, as medians of
interleaved rounds, with the median of the paired per-round ratio
CPU form / as written. GPU and TPU programs never contain the CPU form
(`lax.platform_dependent`), so this cost is the CPU's alone.

Usage::

    python benchmarks/cpu_dot.py            # ~1 minute on 2 CPU cores
    python benchmarks/cpu_dot.py --quick    # a few seconds
"""

from __future__ import annotations

import argparse
import contextlib
import platform
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax import lax

import jmp_policy
from jmp_policy.engine.products import cpu_form as cpu_form_module
from jmp_policy.engine.products import half as matmul

M_BF16 = "p=f32,c=bf16,o=f32,m=bf16,r=f32"
FORMS = ("float32", "as written", "CPU form")


@contextlib.contextmanager
def cpu_form(on: bool) -> Iterator[None]:
    """Traces inside take (or skip) the CPU form of half products."""
    saved = cpu_form_module._CPU_BF16_DOT_WORKAROUND
    cpu_form_module._CPU_BF16_DOT_WORKAROUND = on
    try:
        yield
    finally:
        cpu_form_module._CPU_BF16_DOT_WORKAROUND = saved


def _compiled(on: bool, fn: Callable, *args: Any) -> Callable[[], Any]:
    """`fn(*args)` as a runner, traced and compiled (once) with the CPU form on or off."""
    with cpu_form(on):
        # A new function object: jit's trace cache knows nothing of the setting.
        compiled = jax.jit(lambda *a: fn(*a)).lower(*args).compile()
    return lambda: compiled(*args)


def _dot_builders(
    lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...], dims: Any
) -> list[Callable[[], Callable]]:
    """Builders of the `FORMS` runners of one dot."""
    k1, k2 = jax.random.split(jax.random.key(0))
    lhs = jax.random.normal(k1, lhs_shape, jnp.float32)
    rhs = jax.random.normal(k2, rhs_shape, jnp.float32)
    half = (lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16))
    product = matmul.dot_product(dims)

    def f32(a, b):
        return lax.dot_general(a, b, dims)

    def accumulating(a, b):
        return product(a, b, jnp.float32)

    return [
        lambda: _compiled(True, f32, lhs, rhs),
        lambda: _compiled(False, accumulating, *half),
        lambda: _compiled(True, accumulating, *half),
    ]


def _train_step_builders(
    loss_of: Callable[[str, Any], jax.Array], params: Any
) -> list[Callable[[], Callable]]:
    """Builders of the `FORMS` runners of the README's train step of `loss_of(policy, params)`."""
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.NoOpLossScale())
    opt_state = tx.init(params)

    def builder(policy: str, on: bool) -> Callable[[], Callable]:
        def step(params, opt_state):
            grads = jax.grad(lambda p: loss_of(policy, p))(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state

        return lambda: _compiled(on, step, params, opt_state)

    return [builder("float32", True), builder(M_BF16, False), builder(M_BF16, True)]


def cases(quick: bool) -> dict[str, list[Callable[[], Callable]]]:
    """`{case: builders of its FORMS runners}`."""
    import flax.linen as nn

    from jmp_policy.app import transformer_lm as lm

    t, k = (512, 256) if quick else (2048, 512)
    out = {
        "dense fwd [T,K]x[K,N]": _dot_builders((t, k), (k, k), (((1,), (0,)), ((), ()))),
        "dense dx [T,N]x[K,N]": _dot_builders((t, k), (k, k), (((1,), (1,)), ((), ()))),
        "dense dw [T,K]x[T,N]": _dot_builders((t, k), (t, k), (((0,), (0,)), ((), ()))),
        "attention backward": _dot_builders(
            (8, 4, 32, 64), (8, 64, 4, 32), (((2,), (3,)), ((0, 1), (0, 2)))
        ),
    }

    width = 128 if quick else 256
    layers: list[Callable] = [nn.Dense(width), nn.relu] * 4
    mlp = nn.Sequential([*layers, nn.Dense(10)])
    x = jax.random.normal(jax.random.key(1), (256, width))
    y = jax.random.randint(jax.random.key(2), (256,), 0, 10)

    def mlp_loss(policy: str, params: Any) -> jax.Array:
        logits = jmp_policy.with_policy(mlp.apply, policy)(params, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    out["MLP train step"] = _train_step_builders(mlp_loss, mlp.init(jax.random.key(0), x))
    if quick:
        return out

    batches, _, vocab = lm.make_data(1, seed=0)
    model = lm.make_model(vocab)

    def lm_loss(policy: str, params: Any) -> jax.Array:
        return lm.loss_fn(jmp_policy.with_policy(model.apply, policy), params, batches[0])

    out["Transformer train step"] = _train_step_builders(lm_loss, lm.init_params(model, "float32"))
    return out


def ready(build: Callable[[], Callable]) -> Callable | str:
    """The runner `build()` makes, run once; or the first line of XLA's error."""
    try:
        runner = build()
        jax.block_until_ready(runner())
    except Exception as e:  # XLA's own error: reported, not the benchmark's failure
        return str(e).strip().splitlines()[0][:90]
    return runner


def time_interleaved(runners: Sequence[Callable | str], budget_s: float, reps: int = 5) -> list:
    """Per-round seconds of each runner (None for a failed one), rounds interleaved."""
    live = [i for i, r in enumerate(runners) if not isinstance(r, str)]
    samples: list[list[float]] = [[] for _ in runners]
    deadline, rounds = time.perf_counter() + budget_s, 0
    while rounds < 5 or time.perf_counter() < deadline:
        for j in range(len(live)):
            i = live[(rounds + j) % len(live)]
            run = runners[i]
            assert not isinstance(run, str)
            t0 = time.perf_counter()
            for _ in range(reps):
                out = run()
            jax.block_until_ready(out)
            samples[i].append((time.perf_counter() - t0) / reps)
        rounds += 1
    return [np.asarray(s) if s else None for s in samples]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, 0.5 s a case")
    parser.add_argument("--budget", type=float, default=6.0, help="seconds of rounds a case")
    args = parser.parse_args(argv)
    budget = 0.5 if args.quick else args.budget
    device = jax.devices()[0]
    print(
        f"Half-precision products on the CPU: jmp_policy's CPU form against the dot as "
        f"written; jax {jax.__version__}, {device.platform} ({device.device_kind}), "
        f"{platform.machine()} {platform.processor() or ''}".rstrip()
    )
    header = (
        f"{'case':<26}{'float32 ms':>12}{'as written ms':>15}{'CPU form ms':>13}"
        f"{'CPU form / as written':>23}"
    )
    print(header)
    print("-" * len(header))
    for name, builders in cases(args.quick).items():
        runners = [ready(b) for b in builders]
        times = time_interleaved(runners, budget)
        cells = [f"{np.median(t) * 1e3:.3f}" if t is not None else "fails" for t in times]
        written, cpu = times[1], times[2]
        if written is not None and cpu is not None:
            n = min(len(written), len(cpu))
            ratio = f"{np.median(cpu[:n] / written[:n]):.2f}"
        else:
            ratio = "n/a"
        print(f"{name:<26}{cells[0]:>12}{cells[1]:>15}{cells[2]:>13}{ratio:>23}")
        for form, r in zip(FORMS, runners):
            if isinstance(r, str):
                print(f"  {form} fails: {r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
