"""Step-time overhead of loss scaling / non-finite-step skipping, by implementation.

What it measures
----------------
The time of one jitted training step of a Flax linen MLP (Dense
layers with ReLU, softmax cross-entropy, float32 inputs) trained with
`optax.adam`, for these ways of doing loss scaling and skipping non-finite
steps:

  plain optax adam            baseline: no scaling, no check
  loss_scaled Dynamic         jmp_policy.loss_scaled(adam, DynamicLossScale(2**15)),
                              the README's train step
  loss_scaled NoOp            jmp_policy.loss_scaled(adam, NoOpLossScale())
  optax apply_if_finite       optax.apply_if_finite(adam, max_consecutive_errors=5)
  flax DynamicScale           flax.training.dynamic_scale.DynamicScale:
                              value_and_grad, then jnp.where on params and opt state
  jmp by hand                 the jmp 0.0.4 README recipe: scale the loss, unscale
                              the grads, all_finite, adjust, select_tree

for a small model (4 x 256, batch 64: the reference size) and a larger
one (4 x 1024, batch 256).

How
---
* Every variant starts from the same parameters and sees the same batch; every
  step function is `jax.jit(step)` and returns `(new_state, loss)`. With
  `--donate`, every variant donates its whole training state
  (`donate_argnums=0`); without, none does (as the README's train step). The
  choice matters: XLA inserts copies of the optimizer state into the
  select-based variants when the state is donated, and into the
  `lax.cond`-based ones (`apply_if_finite`) when it is not.
* Before timing, each variant runs 3 steps from the same start and must follow
  plain optax's trajectory (all gradients are finite, so nothing may be
  skipped): a variant that silently skipped steps cannot look fast.
* Compilation and warm-up steps are excluded.
* Timing is interleaved: each round runs every variant once, round-robin (the
  starting variant rotates from round to round); a sample is `k` back-to-back
  steps followed by `jax.block_until_ready`, `k` chosen so that a sample lasts
  a few milliseconds. Rounds continue until the size's time budget is spent.
* Two clocks are read around every sample: wall-clock time and the process's
  CPU time (`time.process_time`, all threads). On a CPU machine shared with
  other processes, wall-clock time mostly measures the neighbours (an A/A
  test of plain vs plain spread by +-5% here), while CPU time stays within
  about 1%; `--clock` picks the clock of the verdict (default: CPU time on
  the CPU backend, wall-clock time on GPU/TPU, where CPU time means nothing).
* Reported per variant: the median time per step, the wall-clock IQR, and the
  ratio to plain optax, taken as the median over rounds of the per-round
  paired ratio (robust to drifts in the machine's speed).

Target (the project's): `loss_scaled` with `DynamicLossScale` at most 1.02x plain
optax on the small model.

Usage::

    .venv/bin/python benchmarks/loss_scaling.py           # ~2 minutes
    .venv/bin/python benchmarks/loss_scaling.py --quick   # ~15 seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import jmp
import numpy as np
import optax
from flax.training.dynamic_scale import DynamicScale

import jmp_policy

TARGET_RATIO = 1.02
TARGET_VARIANT = "loss_scaled Dynamic"
LEARNING_RATE = 1e-3
INITIAL_SCALE = 2.0**15


# --------------------------------------------------------------------------- model


class MLP(nn.Module):
    """`depth` Dense layers of `width` units, ReLU between them; `width` logits out."""

    width: int
    depth: int

    @nn.compact
    def __call__(self, x):
        for i in range(self.depth):
            x = nn.Dense(self.width)(x)
            if i < self.depth - 1:
                x = nn.relu(x)
        return x


@dataclasses.dataclass(frozen=True)
class Problem:
    """A model size, its batch, and the loss; `params` is shared by every variant."""

    name: str
    model: MLP
    params: Any
    x: jax.Array
    y: jax.Array

    def loss(self, params, x, y):
        logits = self.model.apply({"params": params}, x)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_problem(name: str, width: int, depth: int, batch: int, seed: int = 0) -> Problem:
    model = MLP(width=width, depth=depth)
    kx, ky, kp = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(kx, (batch, width), jnp.float32)
    y = jax.random.randint(ky, (batch,), 0, width, jnp.int32)
    params = model.init(kp, x)["params"]
    return Problem(name, model, params, x, y)


# ------------------------------------------------------------------------ variants


class Variant(NamedTuple):
    """A way to train: `init(params) -> state`, `step(state, x, y) -> (state, loss)`.

    `state` is a tuple whose first element is the parameters.
    """

    name: str
    init: Callable[[Any], Any]
    step: Callable[..., Any]


def _optax_variant(problem: Problem, name: str, tx: optax.GradientTransformation) -> Variant:
    """The textbook optax step: grads of the loss, `tx.update`, `apply_updates`."""

    def step(state, x, y):
        params, opt_state = state
        loss, grads = jax.value_and_grad(problem.loss)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return Variant(name, lambda p: (p, tx.init(p)), step)


def plain_optax(problem: Problem) -> Variant:
    return _optax_variant(problem, "plain optax adam", optax.adam(LEARNING_RATE))


def optax_apply_if_finite(problem: Problem) -> Variant:
    tx = optax.apply_if_finite(optax.adam(LEARNING_RATE), max_consecutive_errors=5)
    return _optax_variant(problem, "optax apply_if_finite", tx)


def jmp_policy_loss_scaled(
    problem: Problem,
    loss_scale: jmp_policy.LossScale,
    name: str,
    loss_scaled: Callable[..., optax.GradientTransformation] = jmp_policy.loss_scaled,
) -> Variant:
    """The README's train step, with `tx = loss_scaled(adam, loss_scale)`."""
    tx = loss_scaled(optax.adam(LEARNING_RATE), loss_scale)

    def step(state, x, y):
        params, opt_state = state
        scale = jmp_policy.get_loss_scale(opt_state)

        def loss_fn(p):
            loss = problem.loss(p, x, y)
            return scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    return Variant(name, lambda p: (p, tx.init(p)), step)


def flax_dynamic_scale(problem: Problem) -> Variant:
    """Flax's pattern (examples/imagenet): `DynamicScale.value_and_grad`, then
    `jnp.where(is_fin, new, old)` over params and optimizer state."""
    tx = optax.adam(LEARNING_RATE)

    def init(params):
        # Array leaves (not Python floats), so the first step does not retrace.
        # (Flax's annotations say int and float; its examples pass arrays too.)
        ds = DynamicScale(
            fin_steps=jnp.int32(0),  # type: ignore[arg-type]
            scale=jnp.float32(INITIAL_SCALE),  # type: ignore[arg-type]
        )
        return params, tx.init(params), ds

    def step(state, x, y):
        params, opt_state, ds = state
        grad_fn = ds.value_and_grad(problem.loss)
        ds, is_fin, loss, grads = grad_fn(params, x, y)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)

        def keep(new, old):
            return jax.tree.map(lambda a, b: jnp.where(is_fin, a, b), new, old)

        return (keep(new_params, params), keep(new_opt_state, opt_state), ds), loss

    return Variant("flax DynamicScale", init, step)


def jmp_by_hand(problem: Problem) -> Variant:
    """The jmp 0.0.4 README recipe, with the `jmp` package itself."""
    tx = optax.adam(LEARNING_RATE)

    def init(params):
        # float32: jmp's adjust crashes on a float16 scale.
        return params, tx.init(params), jmp.DynamicLossScale(jnp.float32(INITIAL_SCALE))

    def step(state, x, y):
        params, opt_state, loss_scale = state

        def loss_fn(p):
            loss = problem.loss(p, x, y)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        grads = loss_scale.unscale(grads)
        finite = jmp.all_finite(grads)
        loss_scale = loss_scale.adjust(finite)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        params, opt_state = jmp.select_tree(
            finite, (new_params, new_opt_state), (params, opt_state)
        )
        return (params, opt_state, loss_scale), loss

    return Variant("jmp by hand", init, step)


def all_variants(problem: Problem) -> list[Variant]:
    return [
        plain_optax(problem),
        jmp_policy_loss_scaled(
            problem, jmp_policy.DynamicLossScale(INITIAL_SCALE), "loss_scaled Dynamic"
        ),
        jmp_policy_loss_scaled(problem, jmp_policy.NoOpLossScale(), "loss_scaled NoOp"),
        optax_apply_if_finite(problem),
        flax_dynamic_scale(problem),
        jmp_by_hand(problem),
    ]


# -------------------------------------------------------------------------- timing


@dataclasses.dataclass
class Result:
    """Per-round samples (seconds per step) of one variant, on both clocks."""

    name: str
    wall_s: np.ndarray
    cpu_s: np.ndarray


def _copy(tree):
    # Each variant gets its own buffers: donation would otherwise invalidate
    # the shared initial parameters.
    return jax.tree.map(lambda a: jnp.array(a, copy=True), tree)


def _run(step, state, x, y, k):
    for _ in range(k):
        state, loss = step(state, x, y)
    jax.block_until_ready((state, loss))
    return state


def jit_steps(variants: Sequence[Variant], donate: bool) -> list[Callable[..., Any]]:
    """The jitted step of every variant; all or none donate their whole state."""
    return [jax.jit(v.step, donate_argnums=0 if donate else ()) for v in variants]


def time_interleaved(
    problem: Problem,
    variants: Sequence[Variant],
    steps: Sequence[Callable[..., Any]],
    budget_s: float,
    sample_s: float,
    min_rounds: int,
    warmup_steps: int = 2,
) -> tuple[list[Result], int]:
    """Round-robin timing of the jitted `steps`; returns per-round samples and `k`."""
    states = [_copy(v.init(problem.params)) for v in variants]
    x, y = problem.x, problem.y

    # Warm-up (the steps are already compiled by `check_trajectories`); it
    # also gives a rough step time to pick k.
    t0 = time.perf_counter()
    for i, step in enumerate(steps):
        states[i] = _run(step, states[i], x, y, warmup_steps)
    rough = (time.perf_counter() - t0) / (warmup_steps * len(steps))
    k = max(1, round(sample_s / rough))

    wall: list[list[float]] = [[] for _ in variants]
    cpu: list[list[float]] = [[] for _ in variants]
    n = len(variants)
    gc.collect()
    gc.disable()
    try:
        deadline = time.perf_counter() + budget_s
        rounds = 0
        while rounds < min_rounds or time.perf_counter() < deadline:
            for j in range(n):
                i = (rounds + j) % n  # rotate the starting variant
                w0, c0 = time.perf_counter(), time.process_time()
                states[i] = _run(steps[i], states[i], x, y, k)
                cpu[i].append((time.process_time() - c0) / k)
                wall[i].append((time.perf_counter() - w0) / k)
            rounds += 1
    finally:
        gc.enable()
    results = [Result(v.name, np.asarray(w), np.asarray(c)) for v, w, c in zip(variants, wall, cpu)]
    return results, k


def check_trajectories(
    problem: Problem,
    variants: Sequence[Variant],
    steps: Sequence[Callable[..., Any]],
    n_steps: int = 3,
    rtol: float = 1e-4,
) -> bool:
    """Runs every variant `n_steps` steps from the same start; all must match plain.

    This is also where the steps compile (`step.lower(...)` is not used: jmp's
    loss scale cannot be unflattened from the placeholders `lower` passes).

    All gradients are finite here, so no variant may skip a step: a skipped or
    wrongly scaled step would move the parameters by about the learning rate.
    (Only a few steps: over hundreds, Adam amplifies last-bit differences
    between differently fused programs.)
    """
    finals = []
    for v, step in zip(variants, steps):
        state = _copy(v.init(problem.params))
        for _ in range(n_steps):
            state, _ = step(state, problem.x, problem.y)
        finals.append(state[0])
    ok = True
    for v, params in zip(variants[1:], finals[1:]):
        close = jax.tree.map(
            lambda a, b: bool(jnp.allclose(a, b, rtol=rtol, atol=rtol * LEARNING_RATE)),
            params,
            finals[0],
        )
        if not all(jax.tree.leaves(close)):
            ok = False
            print(f"WARNING: {v.name} does not follow plain optax's trajectory")
    return ok


# ------------------------------------------------------------------------ report


@dataclasses.dataclass
class Row:
    name: str
    wall_ms: float
    wall_iqr_ms: float
    wall_ratio: float
    cpu_ms: float
    cpu_ratio: float
    cpu_ratio_iqr: tuple[float, float]

    def ratio(self, clock: str) -> float:
        return self.cpu_ratio if clock == "cpu" else self.wall_ratio


def summarize(results: Sequence[Result]) -> list[Row]:
    """Medians per variant; ratios are medians of the per-round paired ratios."""
    base = results[0]
    rows = []
    for r in results:
        q1, med, q3 = np.percentile(r.wall_s, [25, 50, 75])
        cpu_ratios = r.cpu_s / base.cpu_s
        lo, cpu_ratio, hi = np.percentile(cpu_ratios, [25, 50, 75])
        rows.append(
            Row(
                name=r.name,
                wall_ms=med * 1e3,
                wall_iqr_ms=(q3 - q1) * 1e3,
                wall_ratio=float(np.median(r.wall_s / base.wall_s)),
                cpu_ms=float(np.median(r.cpu_s)) * 1e3,
                cpu_ratio=float(cpu_ratio),
                cpu_ratio_iqr=(float(lo), float(hi)),
            )
        )
    return rows


def print_table(problem: Problem, rows: Sequence[Row], rounds: int, k: int) -> None:
    n_params = sum(p.size for p in jax.tree.leaves(problem.params))
    depth, width = problem.model.depth, problem.model.width
    print(
        f"\n{problem.name}: {depth} x Dense({width}), batch {problem.x.shape[0]}, "
        f"{n_params:,} params; {rounds} rounds x {k} steps per sample"
    )
    header = (
        f"{'variant':<23}{'wall ms':>9}{'IQR':>8}{'x plain':>9}"
        f"{'cpu ms':>10}{'x plain':>9}  {'(IQR)':<13}"
    )
    print(header)
    print("-" * len(header))
    for r in rows:
        lo, hi = r.cpu_ratio_iqr
        print(
            f"{r.name:<23}{r.wall_ms:>9.3f}{r.wall_iqr_ms:>8.3f}{r.wall_ratio:>9.3f}"
            f"{r.cpu_ms:>10.3f}{r.cpu_ratio:>9.3f}  {f'{lo:.3f}-{hi:.3f}':<13}"
        )


# --------------------------------------------------------------------------- main


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="~15 s instead of ~2 min")
    parser.add_argument(
        "--sizes",
        default="small,large",
        help="comma-separated subset of: small, large (default: both)",
    )
    parser.add_argument(
        "--donate",
        action="store_true",
        help="donate the whole training state to every step (default: no "
        "donation, as in the README's train step)",
    )
    parser.add_argument(
        "--clock",
        choices=["auto", "wall", "cpu"],
        default="auto",
        help="clock for the verdict: 'cpu' (process CPU time; robust when other "
        "processes share the cores, meaningless on GPU) or 'wall'; 'auto' = cpu "
        "on the CPU backend, wall otherwise",
    )
    args = parser.parse_args(argv)

    if args.quick:
        budgets = {"small": 3.0, "large": 3.0}
        sample_s, min_rounds = 0.005, 10
    else:
        budgets = {"small": 50.0, "large": 40.0}
        sample_s, min_rounds = 0.010, 30
    specs = {"small": (256, 4, 64), "large": (1024, 4, 256)}
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    for s in sizes:
        if s not in specs:
            parser.error(f"unknown size {s!r}; choose from {sorted(specs)}")
    clock = args.clock
    if clock == "auto":
        clock = "cpu" if jax.default_backend() == "cpu" else "wall"

    print(
        f"jax {jax.__version__}, flax {flax.__version__}, optax {optax.__version__}, "
        f"jmp_policy {jmp_policy.__version__}; backend {jax.default_backend()} "
        f"({jax.devices()[0].device_kind}); state donated: {'yes' if args.donate else 'no'}; "
        f"clock for ratios and verdict: {clock}"
    )
    ok = True
    verdict = None
    for size in sizes:
        width, depth, batch = specs[size]
        problem = make_problem(size, width, depth, batch)
        variants = all_variants(problem)
        steps = jit_steps(variants, args.donate)
        ok &= check_trajectories(problem, variants, steps)
        results, k = time_interleaved(problem, variants, steps, budgets[size], sample_s, min_rounds)
        rows = summarize(results)
        print_table(problem, rows, len(results[0].wall_s), k)
        if size == "small":
            verdict = next(r for r in rows if r.name == TARGET_VARIANT).ratio(clock)
    print(
        "\nwall/cpu ms: median over rounds of wall-clock / process-CPU time per step;"
        "\nx plain: median over rounds of the paired ratio to plain optax."
    )
    if verdict is not None:
        met = verdict <= TARGET_RATIO
        print(
            f"Target: {TARGET_VARIANT} <= {TARGET_RATIO:.2f}x plain optax on the small "
            f"model ({clock} clock): {'MET' if met else 'NOT MET'} (measured {verdict:.3f}x)"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
