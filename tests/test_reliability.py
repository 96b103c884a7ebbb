"""Reliability: the failures a mixed precision library makes silently, shown not to happen.

* fault injection: NaN and inf injected under `jax.jit` into the gradients, the
  loss and single gradient elements of a 2,000-step `lax.scan` training loop
  never reach the parameters or the optimizer state, every one of them is
  counted as a skipped step, and the result equals a run of the plain
  optimizer that skips the same steps;
* long runs: 100,000 steps of `DynamicLossScale.adjust` (all finite, all
  overflowing) and of `loss_scaled` (all overflowing) keep the scale finite,
  within its bounds and normal;
* checkpoint and restore with orbax mid-training, in this process and in a
  fresh one: the resumed run is bit-identical to an uninterrupted one;
* fully sharded parameters on a 2x4 mesh of 8 CPU devices: an overflow on
  one shard makes every device skip, and the state stays replicated;
* bad input: a clear `TypeError`/`ValueError` naming the argument, and
  nothing half-applied;
* property tests of casting over random mixed pytrees.

What the other test files already cover (the dynamic rule against a reference,
20,000-step scans, spec round trips, a next-step checkpoint test, data
parallel and `shard_map` steps) is not repeated here. tests/README.md lists the
figures.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp
import jmp_policy.nnx as jnnx
from jmp_policy import Policy

from helpers import assert_bitwise_equal, bits

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)


def tree_bits_equal(a, b) -> jax.Array:
    """Under jit: whether two trees of float arrays hold the same bits (NaN, -0.0 too)."""

    def same(x, y):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return jnp.all(x == y)
        int_type = {2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}[x.dtype.itemsize]
        return jnp.all(
            jax.lax.bitcast_convert_type(x, int_type) == jax.lax.bitcast_convert_type(y, int_type)
        )

    return jnp.stack([same(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))]).all()


def reference_scales(finite_steps, loss_scale, period, factor=2.0, lo=1.0, hi=F32_MAX):
    """The documented rule (hysteresis 1) in float32, step by step, in plain Python."""
    scale, counter, out = np.float32(loss_scale), 0, []
    for finite in finite_steps:
        if finite:
            counter += 1
            if counter == period:
                counter = 0
                grown = np.float32(scale * np.float32(factor))
                if np.isfinite(grown) and float(grown) <= hi:
                    scale = grown
        else:
            counter = 0
            scale = max(np.float32(scale / np.float32(factor)), np.float32(max(lo, F32_TINY)))
        out.append(float(scale))
    return out, counter


# --------------------------------------------------------------------------
# A small MLP on synthetic data, in plain jnp
# --------------------------------------------------------------------------

D_IN, D_HIDDEN, D_OUT, BATCH = 4, 16, 2, 16


def init_params(seed: int = 0) -> dict[str, jax.Array]:
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(D_IN, D_HIDDEN)) / np.sqrt(D_IN), jnp.float32),
        "b1": jnp.zeros(D_HIDDEN, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(D_HIDDEN, D_OUT)) / np.sqrt(D_HIDDEN), jnp.float32),
        "b2": jnp.zeros(D_OUT, jnp.float32),
    }


def make_data(n_steps: int, seed: int = 1) -> tuple[jax.Array, jax.Array]:
    """A learnable target (a fixed random teacher), one batch per step."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n_steps, BATCH, D_IN)).astype(np.float32)
    teacher = rng.normal(size=(D_IN, D_OUT)).astype(np.float32)
    y = np.tanh(x @ teacher) + 0.05 * rng.normal(size=(n_steps, BATCH, D_OUT))
    return jnp.asarray(x), jnp.asarray(y, jnp.float32)


def mlp_loss(params, x, y, compute_dtype=F32):
    policy = Policy(F32, compute_dtype, F32)
    p, x = policy.cast_to_compute((params, x))
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    out = policy.cast_to_output(h @ p["w2"] + p["b2"])
    return jnp.mean((out - y) ** 2)


# --------------------------------------------------------------------------
# Fault injection under jit, in a 2,000-step lax.scan
# --------------------------------------------------------------------------

N_TRAIN_STEPS = 2_000
N_RANDOM_FAULTS = 120
BURST = (1000, 1006)  # six overflows in a row: back-offs and notfinite_count build up
FAULT_KINDS = {
    1: "all gradients x NaN",
    2: "all gradients x inf",
    3: "loss x NaN",
    4: "loss x inf",
    5: "one gradient element = NaN",
    6: "one gradient element = -inf",
}
N_LEAVES = len(init_params())


def fault_schedule(seed: int = 7):
    """Seeded random fault steps: the kind per step (0: none), and for the
    single-element kinds which leaf and (flat index modulo its size) which element."""
    rng = np.random.default_rng(seed)
    kinds = np.zeros(N_TRAIN_STEPS, np.int32)
    steps = rng.choice(np.arange(10, N_TRAIN_STEPS), N_RANDOM_FAULTS, replace=False)
    kinds[steps] = rng.integers(1, len(FAULT_KINDS) + 1, N_RANDOM_FAULTS)
    kinds[np.sort(steps)[: len(FAULT_KINDS)]] = np.arange(1, len(FAULT_KINDS) + 1)  # all kinds
    kinds[slice(*BURST)] = rng.integers(1, len(FAULT_KINDS) + 1, BURST[1] - BURST[0])
    leaf = rng.integers(0, N_LEAVES, N_TRAIN_STEPS).astype(np.int32)
    element = rng.integers(0, 2**20, N_TRAIN_STEPS).astype(np.int32)
    return kinds, leaf, element


def inject_into_grads(grads, kind, leaf, element):
    nan, inf = jnp.float32(jnp.nan), jnp.float32(jnp.inf)
    whole = jnp.where(kind == 1, nan, jnp.where(kind == 2, inf, jnp.float32(1.0)))
    one = jnp.where(kind == 5, nan, -inf)
    leaves, treedef = jax.tree.flatten(grads)
    out = []
    for i, g in enumerate(leaves):
        flat = (g * whole).reshape(-1)  # x 1.0 is exact when there is no fault
        hit = (kind >= 5) & (leaf == i)
        flat = jnp.where(hit, flat.at[element % flat.size].set(one), flat)
        out.append(flat.reshape(g.shape))
    return jax.tree.unflatten(treedef, out)


def scaled_training_run(tx, compute_dtype):
    """The README's train step with faults injected, scanned; checks every step."""

    @jax.jit
    def run(params, opt_state, xs, ys, kinds, leaves, elements):
        def body(carry, inputs):
            params, opt_state, bad_steps = carry
            x, y, kind, leaf, element = inputs
            loss_scale = jmp.get_loss_scale(opt_state)
            nan, inf = jnp.float32(jnp.nan), jnp.float32(jnp.inf)
            poison = jnp.where(kind == 3, nan, jnp.where(kind == 4, inf, jnp.float32(1.0)))

            def scaled_loss(p):
                return loss_scale.scale(mlp_loss(p, x, y, compute_dtype) * poison)

            grads = inject_into_grads(jax.grad(scaled_loss)(params), kind, leaf, element)
            updates, new_state = tx.update(grads, opt_state, params)
            new_params = optax.apply_updates(params, updates)
            skipped = new_state.total_notfinite - opt_state.total_notfinite
            # Every step: params and the whole optimizer state finite; on a
            # fault step, params and the inner state unchanged bit for bit.
            finite = jmp.all_finite((new_params, new_state))
            unchanged = tree_bits_equal(
                (new_params, new_state.inner_state), (params, opt_state.inner_state)
            )
            ok = finite & ((kind == 0) | unchanged)
            carry = (new_params, new_state, bad_steps + (~ok).astype(jnp.int32))
            return carry, (skipped, new_state.notfinite_count, jmp.get_loss_scale(new_state))

        init = (params, opt_state, jnp.int32(0))
        inputs = (xs, ys, kinds, leaves, elements)
        return jax.lax.scan(body, init, inputs)

    return run


def control_run(inner, compute_dtype):
    """The plain inner optimizer on true gradients, skipping the given steps."""

    @jax.jit
    def run(params, opt_state, xs, ys, skip):
        def body(carry, inputs):
            params, opt_state = carry
            x, y, skip_this = inputs
            grads = jax.grad(mlp_loss)(params, x, y, compute_dtype)
            updates, new_state = inner.update(grads, opt_state, params)
            new = (optax.apply_updates(params, updates), new_state)
            return jmp.select_tree(skip_this, (params, opt_state), new), None

        return jax.lax.scan(body, (params, opt_state), (xs, ys, skip))[0]

    return run


# Schedules inside: skipped steps must not advance them.
INNER = {
    "sgd_momentum": lambda: optax.sgd(
        optax.cosine_decay_schedule(0.05, N_TRAIN_STEPS), momentum=0.9
    ),
    "adam": lambda: optax.adam(optax.cosine_decay_schedule(1e-2, N_TRAIN_STEPS)),
}
# No natural overflow: float32/bfloat16 compute and gradients of order 1 stay far
# from float32's range at a scale of at most 2**24, so every skip is a fault.
LOSS_SCALE = dict(loss_scale=2.0**15, period=16, min_loss_scale=1.0, max_loss_scale=2.0**24)


@pytest.mark.slow
@pytest.mark.parametrize(
    "inner_name, compute_dtype, exact",
    [("sgd_momentum", BF16, True), ("adam", F32, False)],
    ids=["sgd_momentum-bf16", "adam-f32"],
)
def test_fault_injection_2000_steps_in_scan(inner_name, compute_dtype, exact):
    kinds, leaves, elements = fault_schedule()
    faulty = kinds > 0
    n_faults = int(faulty.sum())
    assert n_faults >= N_RANDOM_FAULTS  # the burst may overlap random faults
    assert set(np.unique(kinds[faulty]).tolist()) == set(FAULT_KINDS)
    xs, ys = make_data(N_TRAIN_STEPS)
    params0 = init_params()

    tx = jmp.loss_scaled(INNER[inner_name](), jmp.DynamicLossScale(**LOSS_SCALE))
    control_inner = INNER[inner_name]()
    # optax's adam is not clean under strict promotion (see test_optimizer.py).
    with jax.numpy_dtype_promotion("standard"):
        (params, state, bad_steps), (skipped, consecutive, loss_scales) = scaled_training_run(
            tx, compute_dtype
        )(params0, tx.init(params0), xs, ys, *map(jnp.asarray, (kinds, leaves, elements)))
        control_params, control_state = control_run(control_inner, compute_dtype)(
            params0, control_inner.init(params0), xs, ys, jnp.asarray(faulty)
        )

    # Never a non-finite value in params or optimizer state, at any step; fault
    # steps left params and inner state untouched.
    assert int(bad_steps) == 0
    # Exactly the injected steps were skipped, each counted once.
    np.testing.assert_array_equal(np.asarray(skipped), faulty.astype(np.int32))
    assert int(state.total_notfinite) == n_faults
    burst_counts = np.asarray(consecutive)[slice(*BURST)].tolist()
    assert burst_counts[-1] >= BURST[1] - BURST[0]
    # The scale followed the documented rule, growing and backing off.
    expected, expected_counter = reference_scales(
        ~faulty,
        LOSS_SCALE["loss_scale"],
        LOSS_SCALE["period"],
        lo=LOSS_SCALE["min_loss_scale"],
        hi=LOSS_SCALE["max_loss_scale"],
    )
    scales = np.asarray(loss_scales.loss_scale)
    assert scales.tolist() == expected
    assert int(state.loss_scale.counter) == expected_counter
    assert (np.diff(scales) > 0).sum() >= 20 and (np.diff(scales) < 0).sum() >= 20
    assert scales.min() >= LOSS_SCALE["min_loss_scale"]
    assert scales.max() <= LOSS_SCALE["max_loss_scale"]

    # The result is the plain optimizer's, skipping the same steps. Scaling by a
    # power of two and back is exact, so with sgd it agrees bit for bit. Adam's
    # own arithmetic (bias-correction powers, sqrt, divide) is fused differently
    # by XLA in the two programs and differs by an ulp from step 2 on, with
    # identical gradients and moments; so float32 tolerance there.
    if exact:
        assert_bitwise_equal(params, control_params)
        assert_bitwise_equal(state.inner_state, control_state)
    else:
        pairs = zip(
            jax.tree.leaves((params, state.inner_state)),
            jax.tree.leaves((control_params, control_state)),
        )
        for a, b in pairs:
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=2e-6)
    # The run trained (the comparison is not of untouched parameters).
    first, last = (float(mlp_loss(p, xs[-100:], ys[-100:])) for p in (params0, params))
    assert last < 0.5 * first


# --------------------------------------------------------------------------
# Long runs: 100,000 steps
# --------------------------------------------------------------------------

LONG_RUN = 100_000


@jax.jit
def adjust_many(loss_scale, finite_steps):
    """Adjusts once per step; returns the final state and every step's scale."""

    def step(ls, finite):
        ls = ls.adjust(finite)
        return ls, (ls.loss_scale, ls.counter)

    return jax.lax.scan(step, loss_scale, finite_steps, unroll=8)


def expected_after_finite_steps(n, start, period, factor, hi):
    """The scale after n finite steps: one growth per `period`, while allowed.

    Multiplications only (no division), so float32 arithmetic here is exact.
    """
    scale = np.float32(start)
    for _ in range(n // period):
        with np.errstate(over="ignore"):
            grown = np.float32(scale * np.float32(factor))
        if not (np.isfinite(grown) and float(grown) <= hi):
            break  # growth is blocked for good: the scale no longer changes
        scale = grown
    return float(scale)


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs",
    [
        {"loss_scale": 2.0**15},  # default period 2000: 50 doublings, to 2**65
        {"loss_scale": 1.0, "period": 1},  # grows every step until 2**127, then holds
        {"loss_scale": 2.0**15, "period": 1, "max_loss_scale": 2.0**24},
        {"loss_scale": 3.0, "period": 7, "factor": 3, "max_loss_scale": 1e30},
        {"loss_scale": 2.0**15, "period": 500, "hysteresis": 2, "max_loss_scale": 2.0**100},
    ],
    ids=["default", "period1", "period1_max", "factor3_max", "hysteresis2"],
)
def test_100k_finite_steps_scale_finite_bounded_and_exact(kwargs):
    ls = jmp.DynamicLossScale(**kwargs)
    final, (scales, counters) = adjust_many(ls, jnp.ones(LONG_RUN, bool))
    scales = np.asarray(scales)
    assert scales.dtype == np.float32 and scales.shape == (LONG_RUN,)
    assert np.isfinite(scales).all()
    assert scales.max() <= ls.max_loss_scale
    assert np.all(np.diff(scales) >= 0)  # never shrinks without an overflow
    expected = expected_after_finite_steps(
        LONG_RUN, kwargs["loss_scale"], ls.period, ls.factor, ls.max_loss_scale
    )
    assert float(final.loss_scale) == expected
    assert int(final.counter) == LONG_RUN % ls.period
    assert np.asarray(counters).max() == ls.period - 1


@pytest.mark.slow
@pytest.mark.parametrize(
    "kwargs, floor",
    [
        ({"loss_scale": 2.0**15}, 1.0),  # default min_loss_scale
        ({"loss_scale": 2.0**15, "min_loss_scale": 2.0**-10}, 2.0**-10),
        # min 0 is floored at float32's smallest normal number, never 0 or subnormal.
        ({"loss_scale": 2.0**15, "min_loss_scale": 0.0}, F32_TINY),
        ({"loss_scale": 2.0**100, "min_loss_scale": 0.0, "factor": 3}, F32_TINY),
        ({"loss_scale": 2.0**15, "min_loss_scale": 0.0, "hysteresis": 3}, F32_TINY),
    ],
    ids=["default_min", "min_2^-10", "min0", "min0_factor3", "min0_hysteresis3"],
)
def test_100k_overflow_steps_scale_stays_at_its_floor(kwargs, floor):
    ls = jmp.DynamicLossScale(**kwargs)
    final, (scales, counters) = adjust_many(ls, jnp.zeros(LONG_RUN, bool))
    scales = np.asarray(scales)
    assert np.isfinite(scales).all()
    assert scales.min() == np.float32(floor) and scales.min() >= F32_TINY  # normal, not 0
    assert np.all(np.diff(scales) <= 0)
    # The floor is reached and held: the last 99,000 steps all sit on it.
    assert np.all(scales[1000:] == np.float32(floor))
    assert float(final.loss_scale) == floor
    assert not np.asarray(counters).any()
    # ... and it grows again from there after `period` finite steps.
    regrown, _ = adjust_many(final, jnp.ones(ls.period, bool))
    assert float(regrown.loss_scale) == floor * ls.factor


@pytest.mark.slow
def test_loss_scaled_100k_overflowing_steps_never_applies_them():
    """optax.apply_if_finite gives up after max_consecutive_errors; this never does."""
    params = {"w": jnp.array([1.0, -0.0, 3.0]), "b": jnp.ones(2)}
    tx = jmp.loss_scaled(
        optax.sgd(0.1, momentum=0.9), jmp.DynamicLossScale(2.0**15, min_loss_scale=0.0)
    )
    bad = {"w": jnp.array([1.0, jnp.nan, 2.0]), "b": jnp.array([jnp.inf, 0.5])}

    @jax.jit
    def run(params, state):
        def step(carry, _):
            params, state = carry
            updates, state = tx.update(bad, state, params)
            return (optax.apply_updates(params, updates), state), None

        return jax.lax.scan(step, (params, state), length=LONG_RUN, unroll=8)[0]

    state0 = tx.init(params)
    out, state = run(params, state0)
    assert_bitwise_equal(out, params)  # signed zero included
    assert_bitwise_equal(state.inner_state, state0.inner_state)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (LONG_RUN, LONG_RUN)
    assert float(jmp.get_loss_scale(state).loss_scale) == F32_TINY


# --------------------------------------------------------------------------
# Checkpoint and restore with orbax, mid-training
# --------------------------------------------------------------------------

CKPT_PERIOD = 10
# Saved after 12 steps with overflows at steps 2 and 4: 2**15 -> 2**13, then
# 7 finite steps in a row. A scale restarting at 2**15 or a counter at 0
# would show.
CKPT_SAVE_AT, CKPT_TOTAL, CKPT_FAULTS = 12, 24, (2, 4, 20)


def ckpt_tx():
    return jmp.loss_scaled(
        optax.adamw(optax.linear_schedule(1e-2, 1e-3, CKPT_TOTAL), weight_decay=0.1),
        jmp.DynamicLossScale(2.0**15, period=CKPT_PERIOD),
    )


def ckpt_train_step(tx):
    """One jitted step (one executable, so runs are comparable bit for bit)."""

    @jax.jit
    def step(train_state, x, y, poison):
        params, opt_state, n = train_state["params"], train_state["opt_state"], train_state["step"]
        loss_scale = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_scale.scale(mlp_loss(p, x, y) * poison))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return {"params": params, "opt_state": opt_state, "step": n + 1}

    return step


def ckpt_train(tx, train_state, start, stop):
    xs, ys = make_data(CKPT_TOTAL, seed=3)
    step = ckpt_train_step(tx)
    with jax.numpy_dtype_promotion("standard"):  # optax's adam
        for i in range(start, stop):
            poison = jnp.float32(jnp.inf if i in CKPT_FAULTS else 1.0)
            train_state = step(train_state, xs[i], ys[i], poison)
    return train_state


def fresh_train_state(tx, seed=5):
    params = init_params(seed)
    return {"params": params, "opt_state": tx.init(params), "step": jnp.int32(0)}


def restore_and_continue(path: str) -> dict:
    """What a new process does: build a fresh state, restore into it, train on."""
    import orbax.checkpoint as ocp

    tx = ckpt_tx()
    fresh = fresh_train_state(tx)
    fresh_ls = jmp.get_loss_scale(fresh["opt_state"])
    assert (float(fresh_ls.loss_scale), int(fresh_ls.counter)) == (2.0**15, 0)
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, fresh)
    with ocp.StandardCheckpointer() as checkpointer:
        restored = checkpointer.restore(path, abstract)
    ls = jmp.get_loss_scale(restored["opt_state"])
    assert isinstance(ls, jmp.DynamicLossScale) and ls.period == CKPT_PERIOD
    assert (ls.loss_scale.dtype, ls.counter.dtype) == (np.float32, np.int32)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**13, 7)
    assert int(restored["opt_state"].total_notfinite) == 2
    assert int(restored["step"]) == CKPT_SAVE_AT
    return ckpt_train(tx, restored, CKPT_SAVE_AT, CKPT_TOTAL)


@pytest.fixture(scope="module")
def checkpoint_run(tmp_path_factory):
    """Trains CKPT_SAVE_AT steps, saves; and the uninterrupted run to CKPT_TOTAL."""
    ocp = pytest.importorskip("orbax.checkpoint")

    tx = ckpt_tx()
    at_save = ckpt_train(tx, fresh_train_state(tx), 0, CKPT_SAVE_AT)
    path = tmp_path_factory.mktemp("ckpt") / "step_12"
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(path, at_save)
    uninterrupted = ckpt_train(tx, at_save, CKPT_SAVE_AT, CKPT_TOTAL)
    return path, uninterrupted


def assert_resumed_run_is_the_uninterrupted_one(resumed, uninterrupted):
    assert_bitwise_equal(resumed, uninterrupted)
    ls = jmp.get_loss_scale(resumed["opt_state"])
    # 3 finite steps after the restore complete the period: 2**13 -> 2**14; then
    # 5 finite steps, an overflow at step 20 (back to 2**13), 3 finite steps.
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**13, 3)
    assert int(resumed["step"]) == CKPT_TOTAL
    assert int(resumed["opt_state"].total_notfinite) == len(CKPT_FAULTS)


def test_checkpoint_restore_resumes_bit_identical(checkpoint_run):
    path, uninterrupted = checkpoint_run
    assert_resumed_run_is_the_uninterrupted_one(restore_and_continue(path), uninterrupted)


@pytest.mark.slow
def test_checkpoint_restore_in_a_new_process_resumes_bit_identical(checkpoint_run, tmp_path):
    """No state lives in the process: a new Python restores and trains on to the same bits."""
    path, uninterrupted = checkpoint_run
    out = tmp_path / "resumed.npz"
    script = textwrap.dedent(
        f"""
        import os, sys
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
        import jax
        import numpy as np
        jax.config.update("jax_numpy_dtype_promotion", "strict")
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_reliability as t
        resumed = t.restore_and_continue({str(path)!r})
        leaves = jax.tree.leaves(resumed)
        np.savez({str(out)!r}, *[np.asarray(x) for x in leaves])
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as saved:
        leaves = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    treedef = jax.tree.structure(uninterrupted)
    assert_resumed_run_is_the_uninterrupted_one(jax.tree.unflatten(treedef, leaves), uninterrupted)


# --------------------------------------------------------------------------
# Fully sharded parameters on a 2x4 mesh of 8 devices
# --------------------------------------------------------------------------

MESH_SHAPE = (2, 4)  # ("data", "model")
PARAM_SPECS = {
    "w1": P(None, "model"),  # columns split over the 4 model shards
    "b1": P("model"),
    "w2": P("model", None),  # rows split
    "b2": P(),
}
SHARDED_STEPS, SHARDED_BAD_STEP = 5, 2
BAD_BATCH_ROW = BATCH // 2 + 1  # a row of data shard 1 only
BAD_W1_COLUMN = 9  # in model shard 2 (columns 8-11)


@pytest.fixture(scope="module")
def mesh_2x4():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:8]).reshape(MESH_SHAPE), ("data", "model"))


def sharded_tx():
    return jmp.loss_scaled(optax.sgd(0.1, momentum=0.9), jmp.DynamicLossScale(2.0**15, period=2))


def sharded_batches(where):
    xs, ys = make_data(SHARDED_STEPS, seed=11)
    xs = np.array(xs)
    if where == "batch_row":
        xs[SHARDED_BAD_STEP, BAD_BATCH_ROW, 1] = np.inf
    return jnp.asarray(xs), ys


def sharded_step(tx, where, shardings=None):
    def step(params, opt_state, x, y, poison):
        loss_scale = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_scale.scale(mlp_loss(p, x, y)))(params)
        if where == "grad_element":  # one element of the model-sharded w1 gradient
            grads = {**grads, "w1": grads["w1"].at[1, BAD_W1_COLUMN].multiply(poison)}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    if shardings is None:
        return jax.jit(step)
    return jax.jit(step, out_shardings=shardings)


def run_single_device(where):
    tx = sharded_tx()
    xs, ys = sharded_batches(where)
    step = sharded_step(tx, where)
    params = init_params(2)
    state = tx.init(params)
    for i in range(SHARDED_STEPS):
        poison = jnp.float32(jnp.inf if i == SHARDED_BAD_STEP else 1.0)
        params, state = step(params, state, xs[i], ys[i], poison)
    return params, state


@pytest.mark.parametrize("where", ["batch_row", "grad_element"])
def test_fully_sharded_params_overflow_on_one_shard_all_skip(mesh_2x4, where):
    mesh = mesh_2x4
    replicated = NamedSharding(mesh, P())
    param_shardings = {k: NamedSharding(mesh, spec) for k, spec in PARAM_SPECS.items()}
    tx = sharded_tx()
    params = jax.device_put(init_params(2), param_shardings)
    state = tx.init(params)
    # The inner state (momentum) is sharded like the params, the rest replicated.
    state_shardings = state._replace(
        loss_scale=jax.tree.map(lambda _: replicated, state.loss_scale),
        inner_state=jax.tree.map(lambda x: x.sharding, state.inner_state),
        notfinite_count=replicated,
        total_notfinite=replicated,
    )
    assert {s.spec for s in jax.tree.leaves(state_shardings.inner_state)} == set(
        PARAM_SPECS.values()
    )
    state = jax.device_put(state, state_shardings)
    step = sharded_step(tx, where, (param_shardings, state_shardings))
    batch_sharding = NamedSharding(mesh, P("data", None))
    xs, ys = sharded_batches(where)

    for i in range(SHARDED_STEPS):
        x, y = jax.device_put((xs[i], ys[i]), batch_sharding)
        poison = jnp.float32(jnp.inf if i == SHARDED_BAD_STEP else 1.0)
        before_params, before_state = params, state
        params, state = step(params, state, x, y, poison)
        # Every step: the layout is kept, and the replicated state holds the
        # same bits on all 8 devices.
        for name, leaf in params.items():
            assert leaf.sharding.spec == PARAM_SPECS[name]
            n_pieces = int(np.prod([mesh.shape[a] for a in PARAM_SPECS[name] if a]))
            assert len({str(s.index) for s in leaf.addressable_shards}) == n_pieces
        replicated_state = (state.loss_scale, state.notfinite_count, state.total_notfinite)
        for leaf in jax.tree.leaves(replicated_state):
            assert leaf.sharding.is_fully_replicated
            assert len({bits(s.data) for s in leaf.addressable_shards}) == 1
        if i == SHARDED_BAD_STEP:
            if where == "batch_row":  # the inf lives on data shard 1's devices only
                holding = {s.device for s in x.addressable_shards if np.isinf(s.data).any()}
                assert holding == set(mesh.devices[1].tolist())
            assert_bitwise_equal(params, before_params)
            assert_bitwise_equal(state.inner_state, before_state.inner_state)
            halved = float(jmp.get_loss_scale(before_state).loss_scale) / 2
            assert float(jmp.get_loss_scale(state).loss_scale) == halved == 2.0**15
            assert (int(state.notfinite_count), int(state.total_notfinite)) == (1, 1)
        else:
            assert not np.array_equal(params["w1"], before_params["w1"])

    ref_params, ref_state = run_single_device(where)
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)
    # 2**15, period 2: step 1 grows, step 2 backs off, step 4 grows.
    assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**16


# --------------------------------------------------------------------------
# Bad input: a clear error naming the argument
# --------------------------------------------------------------------------


class _NotAModule:
    pass


def _linen_model():
    return nn.Sequential([nn.Dense(4), nn.Dense(2)])


class _NnxModel(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.first = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.last = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.last(self.norm(self.first(x)))


_SPEC_TYPOS = [
    # (spec, the part the message must quote, what it must offer)
    ("mixed_bfloat61", "'mixed_bfloat61'", "did you mean 'mixed_bfloat16'"),
    # Two presets are this close since mixed_float8; difflib offers the nearer.
    ("mixed_float", "'mixed_float'", "did you mean 'mixed_float8'"),
    ("mixed-bfloat16", "'mixed-bfloat16'", "did you mean 'mixed_bfloat16'"),
    ("bfloat61", "'bfloat61'", "did you mean 'bfloat16'"),
    ("p=f32,c=bf61", "'bf61'", "accepted dtype names are bf16"),
    ("p=f32,c=bf16,o=f23", "'f23'", "accepted dtype names are bf16"),
    ("param=f32", "'param'", "accepted keys are p, params"),
    ("p=f32;c=bf16", "'p=f32;c=bf16'", "each part must be key=dtype"),
    (
        "p:f32",
        "'p:f32'",
        "a preset (mixed_bfloat16, mixed_float16, mixed_float8, mixed_float8_rowwise, "
        "mixed_mxfp8, mixed_nvfp4)",
    ),
]


@pytest.mark.parametrize("spec, quoted, offer", _SPEC_TYPOS, ids=[s for s, *_ in _SPEC_TYPOS])
@pytest.mark.parametrize("entry", ["get_policy", "linen", "nnx", "PolicyModule"])
def test_policy_spec_typos(entry, spec, quoted, offer):
    """A misspelt spec raises ValueError quoting the bad part and offering the fix,
    wherever a spec is accepted."""
    call = {
        "get_policy": lambda: jmp.get_policy(spec),
        "linen": lambda: jmp.with_policy(_linen_model().apply, spec),
        "nnx": lambda: jnnx.with_policy(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), spec),
        "PolicyModule": lambda: jnnx.PolicyModule(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), spec),
    }[entry]
    with pytest.raises(ValueError) as info:
        call()
    message = str(info.value)
    assert quoted in message and offer in message, message


_Dyn = jmp.DynamicLossScale
_BAD_LOSS_SCALES = [
    # (constructor call, error, the argument the message must name)
    (lambda: _Dyn("32768"), TypeError, "loss_scale"),
    (lambda: _Dyn(None), TypeError, "loss_scale"),
    (lambda: _Dyn(np.array([2.0, 4.0])), ValueError, "loss_scale must be a scalar"),
    (lambda: _Dyn(jnp.array([2.0, 4.0])), ValueError, "loss_scale must be a scalar"),
    (lambda: _Dyn(jnp.float32(0.0)), ValueError, "loss_scale"),
    (lambda: _Dyn(jnp.float32(-8.0)), ValueError, "loss_scale"),
    (lambda: _Dyn(np.float16(np.inf)), ValueError, "loss_scale"),
    (lambda: _Dyn(2.0, counter=-1), ValueError, "counter"),
    (lambda: _Dyn(2.0, counter=2000), ValueError, r"counter must be in \[0, period\)"),
    (lambda: _Dyn(2.0, counter=1.5), TypeError, "counter"),
    (lambda: _Dyn(2.0, counter="0"), TypeError, "counter"),
    (lambda: _Dyn(2.0, counter=np.zeros(2, np.int32)), TypeError, "counter"),
    (lambda: _Dyn(2.0, period=-3), ValueError, "period"),
    (lambda: _Dyn(2.0, period="2000"), TypeError, "period"),
    (lambda: _Dyn(2.0, period=True), TypeError, "period"),
    (lambda: _Dyn(2.0, factor=1.0), ValueError, "factor"),
    (lambda: _Dyn(2.0, factor=-2), ValueError, "factor"),
    (lambda: _Dyn(2.0, factor="2"), TypeError, "factor"),
    (lambda: _Dyn(2.0, min_loss_scale=-1.0), ValueError, "min_loss_scale"),
    (lambda: _Dyn(2.0, min_loss_scale="1"), TypeError, "min_loss_scale"),
    (lambda: _Dyn(2.0, max_loss_scale=float("nan")), ValueError, "max_loss_scale"),
    (lambda: _Dyn(2.0, period=float("inf")), ValueError, "period"),
    (lambda: _Dyn(2.0, hysteresis=True), TypeError, "hysteresis"),
    (lambda: _Dyn(2.0, hysteresis=2.0), TypeError, "hysteresis"),
    (lambda: _Dyn(2.0, hysteresis="2"), TypeError, "hysteresis"),
    (lambda: _Dyn(2.0, hysteresis=0), ValueError, "hysteresis"),
    (lambda: _Dyn(2.0, overflows=jnp.int32(1)), ValueError, "overflows"),
    (lambda: _Dyn(2.0, hysteresis=2, overflows=0.5), TypeError, "overflows"),
    (
        lambda: _Dyn(2.0, hysteresis=2, overflows=-3),
        ValueError,
        r"overflows must be in \[0, hysteresis\)",
    ),
    (lambda: _Dyn(2.0, hysteresis=2, overflows=2), ValueError, "overflows"),
    (lambda: jmp.StaticLossScale(-4.0), ValueError, "loss_scale"),
    (lambda: jmp.StaticLossScale(1e39), ValueError, "float32"),  # inf in float32
    (lambda: jmp.StaticLossScale(1e-50), ValueError, "float32"),  # 0 in float32
    (lambda: jmp.StaticLossScale("8"), TypeError, "loss_scale"),
    (lambda: jmp.StaticLossScale(True), TypeError, "loss_scale"),
    (lambda: jmp.StaticLossScale(jnp.ones(2)), TypeError, "loss_scale"),
]


@pytest.mark.parametrize("make, error, name", _BAD_LOSS_SCALES)
def test_bad_loss_scale_arguments(make, error, name):
    with pytest.raises(error, match=name):
        make()


def test_numpy_integers_are_integers():
    ls = jmp.DynamicLossScale(
        2.0, period=np.int64(10), hysteresis=np.int64(2), overflows=np.int32(1)
    )
    assert (ls.period, ls.hysteresis) == (10, 2) and type(ls.hysteresis) is int


_LOSS_SCALES = {
    "noop": jmp.NoOpLossScale(),
    "static": jmp.StaticLossScale(8.0),
    "dynamic": jmp.DynamicLossScale(2.0**15),
    "dynamic_hysteresis": jmp.DynamicLossScale(2.0**15, hysteresis=2),
}
_BAD_PREDICATES = {
    "vector": jnp.array([True, False]),
    "shape1": jnp.ones(1, bool),
    "per_leaf": {"w": jnp.bool_(True)},
    "float": jnp.float32(1.0),
    "int": jnp.int32(1),
    "string": "yes",
}


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("pred", sorted(_BAD_PREDICATES))
@pytest.mark.parametrize("kind", sorted(_LOSS_SCALES))
def test_adjust_rejects_non_scalar_or_non_bool_grads_finite(kind, pred, jit):
    """Every loss scale, eager and traced: a ValueError naming grads_finite that says
    how to reduce it; the loss scale itself is unchanged and still usable."""
    ls = _LOSS_SCALES[kind]
    before = jax.tree.map(np.asarray, ls)
    value = _BAD_PREDICATES[pred]
    if jit and pred == "string":
        adjust = jax.jit(lambda s: s.adjust(value))
    elif jit:
        adjust = jax.jit(lambda s, v: s.adjust(v))
    else:
        adjust = lambda s, v: s.adjust(v)  # noqa: E731
    with pytest.raises(ValueError, match=r"grads_finite.*all_finite"):
        adjust(ls) if jit and pred == "string" else adjust(ls, value)
    assert_bitwise_equal(ls, before)
    assert jax.tree.structure(ls.adjust(jnp.bool_(True))) == jax.tree.structure(ls)


@pytest.mark.parametrize(
    "inner, loss_scale, name",
    [
        (None, jmp.NoOpLossScale(), "inner"),
        ("adam", jmp.NoOpLossScale(), "inner"),
        (optax.adam, jmp.NoOpLossScale(), r"inner.*\(call it"),
        (optax.sgd(0.1), 2.0**15, "loss_scale"),
        (optax.sgd(0.1), jmp.DynamicLossScale, "loss_scale"),
        (optax.sgd(0.1), None, "loss_scale"),
        (optax.sgd(0.1), {"loss_scale": 2.0**15}, "loss_scale"),
        (optax.sgd(0.1), optax.sgd(0.1), "loss_scale"),
    ],
    ids=[
        "inner-None",
        "inner-str",
        "inner-uncalled",
        "ls-float",
        "ls-class",
        "ls-None",
        "ls-dict",
        "ls-optimizer",
    ],
)
def test_loss_scaled_bad_arguments(inner, loss_scale, name):
    with pytest.raises(TypeError, match=name):
        jmp.loss_scaled(inner, loss_scale)


@pytest.mark.parametrize(
    "state",
    [
        None,
        {"w": jnp.ones(2)},
        optax.chain(optax.clip(1.0), optax.sgd(0.1)).init({"w": jnp.ones(2)}),
        jmp.DynamicLossScale(2.0**15),  # the loss scale itself, not an optimizer state
    ],
    ids=["None", "params", "chain-without", "loss-scale"],
)
def test_get_loss_scale_on_a_state_without_one(state):
    with pytest.raises(ValueError, match=r"LossScaledState \(from `loss_scaled`\), found 0"):
        jmp.get_loss_scale(state)


_BAD_RULE_KEYS = {
    "lambda": lambda m: True,
    "tuple": ("Dense_0",),
    "None": None,
    "float": 1.5,
    "object": _NotAModule,
}


@pytest.mark.parametrize("key", sorted(_BAD_RULE_KEYS))
def test_linen_rules_key_neither_class_nor_pattern(key):
    key = _BAD_RULE_KEYS[key]
    for rules in ({key: "f32"}, {"Dense_0": "f32", key: "f32"}):
        with pytest.raises(TypeError, match=r"rules keys must be a flax.linen.Module subclass"):
            jmp.with_policy(_linen_model().apply, "mixed_bfloat16", rules=rules)
    # An NNX class is a class, but not a linen one.
    with pytest.raises(TypeError, match=r"flax.linen.Module subclass.*nnx"):
        jmp.with_policy(_linen_model().apply, "mixed_bfloat16", rules={nnx.Linear: "f32"})


@pytest.mark.parametrize("key", sorted(_BAD_RULE_KEYS))
def test_nnx_rules_key_neither_class_nor_pattern(key):
    key = _BAD_RULE_KEYS[key]
    for rules in ({key: "f32"}, {"first": "f32", key: "f32"}):
        for make in (jnnx.with_policy, jnnx.PolicyModule):
            with pytest.raises(TypeError, match=r"rules keys must be a flax.nnx.Module subclass"):
                make(_NnxModel(nnx.Rngs(0)), "mixed_bfloat16", rules=rules)


# --------------------------------------------------------------------------
# Bad input: nothing half-applied
# --------------------------------------------------------------------------


def _nnx_snapshot(model):
    attrs = {
        "/".join(map(str, path)): (getattr(m, "dtype", None), getattr(m, "param_dtype", None))
        for path, m in nnx.iter_modules(model)
    }
    return attrs, jax.tree.map(np.asarray, nnx.state(model))


@pytest.mark.parametrize(
    "rules, error",
    [
        ({"first": "f32", "frist": "f32"}, ValueError),  # a pattern matching nothing
        ({"first": "f32", nnx.LayerNorm: "c=f17"}, ValueError),  # a bad spec, second
        ({"first": "f32", "last": 3}, TypeError),  # a bad value, last
    ],
    ids=["unmatched-pattern", "bad-spec", "bad-value"],
)
def test_nnx_failed_with_policy_leaves_the_module_unchanged(rules, error):
    model = _NnxModel(nnx.Rngs(0))
    attrs, state = _nnx_snapshot(model)
    x = jnp.ones((2, 3))
    out = model(x)
    for make in (jnnx.with_policy, jnnx.PolicyModule):
        with pytest.raises(error):
            make(model, "mixed_bfloat16", rules=rules)
    attrs_after, state_after = _nnx_snapshot(model)
    assert attrs_after == attrs
    assert_bitwise_equal(state_after, state)
    assert_bitwise_equal(model(x), out)
    # ... and it can still be put under a policy.
    mixed = jnnx.with_policy(model, "mixed_bfloat16", rules={"last": "f32"})
    assert mixed.first.dtype == BF16 and mixed.last.dtype == F32


class _Exploding(nn.Module):
    @nn.compact
    def __call__(self, x, explode=False):
        h = nn.Dense(4)(x)
        if explode:
            raise RuntimeError("exploded mid-forward")
        return nn.Dense(2)(h)


def _dense0_dtype(apply, variables, x):
    _, state = apply(variables, x, capture_intermediates=True)
    return state["intermediates"]["Dense_0"]["__call__"][0].dtype


def test_linen_error_mid_apply_leaks_no_policy():
    """An exception inside a wrapped apply restores every module attribute and the
    active policy: the plain apply still computes in float32 afterwards."""
    model = _Exploding()
    x = jnp.ones((2, 3))
    variables = model.init(jax.random.key(0), x)
    mixed = jmp.with_policy(model.apply, "mixed_bfloat16")
    plain_out = model.apply(variables, x)
    assert _dense0_dtype(mixed, variables, x) == BF16
    for apply in (mixed, jax.jit(mixed, static_argnames="explode")):
        with pytest.raises(RuntimeError, match="exploded"):
            apply(variables, x, explode=True)
    assert _dense0_dtype(model.apply, variables, x) == F32
    assert_bitwise_equal(model.apply(variables, x), plain_out)
    assert _dense0_dtype(mixed, variables, x) == BF16
    # A failing with_policy call (bad rules) changes nothing either.
    with pytest.raises(TypeError):
        jmp.with_policy(model.apply, "mixed_float16", rules={"Dense_0": "f32", 3: "f16"})
    assert _dense0_dtype(mixed, variables, x) == BF16
    assert _dense0_dtype(model.apply, variables, x) == F32


def test_failed_calls_leave_existing_state_unchanged():
    """A training state built before a series of failing calls is bit for bit the
    same after them, and the next step gives the same result as without them."""
    params = init_params()
    tx = jmp.loss_scaled(optax.sgd(0.1, momentum=0.9), jmp.DynamicLossScale(2.0**15, period=3))
    state = tx.init(params)
    grads = jax.tree.map(lambda p: jnp.full_like(p, 0.5), params)
    expected = jax.jit(tx.update)(grads, state, params)
    snapshot = jax.tree.map(np.asarray, (params, state))

    failing = [
        lambda: jmp.get_loss_scale(state).adjust(jnp.array([True, False])),
        lambda: dataclasses.replace(jmp.get_loss_scale(state), period=0),
        lambda: dataclasses.replace(jmp.get_loss_scale(state), counter=-1),
        lambda: jmp.loss_scaled(tx, 2.0**15),
        lambda: jmp.get_loss_scale(state.inner_state),
        lambda: jmp.get_policy("mixed_bfloat61"),
        lambda: tx.update({"w1": grads["w1"]}, state, params),  # a wrong grads tree
    ]
    for call in failing:
        with pytest.raises((TypeError, ValueError)):
            call()
    assert_bitwise_equal((params, state), snapshot)
    assert_bitwise_equal(jax.jit(tx.update)(grads, state, params), expected)


# --------------------------------------------------------------------------
# Property: casting random mixed pytrees changes exactly the floating leaves
# --------------------------------------------------------------------------

_JAX_FLOATS = (BF16, F16, F32)
_SHAPES = [(), (3,), (2, 2)]


@dataclasses.dataclass(frozen=True)
class _Leaf:
    value: Any
    kind: str  # "float" (a float array or numpy scalar), or what passes through

    @property
    def is_float(self) -> bool:
        return self.kind == "float"


@st.composite
def _leaves(draw, jittable: bool):
    kind = draw(
        st.sampled_from(
            [
                "jax_float",
                "np_float",
                "np_float_scalar",
                "jax_int",
                "np_int",
                "jax_bool",
                "np_bool",
                "typed_key",
                "raw_key",
            ]
            + ([] if jittable else ["py_float", "py_int", "py_bool", "none", "string"])
        )
    )
    shape = draw(st.sampled_from(_SHAPES))
    n = int(np.prod(shape))
    values = draw(st.lists(st.floats(width=16), min_size=n, max_size=n))
    if kind == "jax_float":
        dtype = draw(st.sampled_from(_JAX_FLOATS))
        return _Leaf(jnp.asarray(np.asarray(values, np.float32).reshape(shape), dtype), "float")
    if kind == "np_float":
        dtype = draw(st.sampled_from((BF16, F16, F32, F64)))
        return _Leaf(np.asarray(values, F64).astype(dtype).reshape(shape), "float")
    if kind == "np_float_scalar":
        dtype = draw(st.sampled_from((F16, F32, F64)))
        # Not an array: left alone as jmp leaves it (a tracer, so cast, under jit).
        return _Leaf(np.asarray(values[:1] or [1.5], dtype)[0], kind)
    ints = draw(st.lists(st.integers(-100, 100), min_size=n, max_size=n))
    if kind == "jax_int":
        return _Leaf(jnp.asarray(ints, jnp.int32).reshape(shape), kind)
    if kind == "np_int":
        dtype = draw(st.sampled_from((np.int8, np.int64, np.uint8)))
        return _Leaf(np.asarray(ints).astype(dtype).reshape(shape), kind)
    if kind == "jax_bool":
        return _Leaf(jnp.asarray(ints).reshape(shape) > 0, kind)
    if kind == "np_bool":
        return _Leaf(np.asarray(ints).reshape(shape) > 0, kind)
    seed = draw(st.integers(0, 2**16))
    if kind == "typed_key":
        return _Leaf(jax.random.key(seed), kind)
    if kind == "raw_key":
        return _Leaf(jax.random.PRNGKey(seed), kind)
    return _Leaf(
        {"py_float": 1.5, "py_int": 7, "py_bool": True, "none": None, "string": "s"}[kind], kind
    )


def _trees(jittable: bool):
    keys = st.sampled_from("abcdef")
    return st.recursive(
        _leaves(jittable),
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(keys, children, max_size=3),
        ),
        max_leaves=8,
    )


def _values(spec):
    if isinstance(spec, _Leaf):
        return spec.value
    if isinstance(spec, dict):
        return {k: _values(v) for k, v in spec.items()}
    return type(spec)(_values(v) for v in spec)


def _check_cast(spec, out, target, jitted: bool):
    """Walks the leaf specs and the cast tree together."""
    if isinstance(spec, dict):
        assert isinstance(out, dict) and set(out) == set(spec)
        for k in spec:
            _check_cast(spec[k], out[k], target, jitted)
        return
    if isinstance(spec, (list, tuple)):
        assert type(out) is type(spec) and len(out) == len(spec)
        for s, o in zip(spec, out):
            _check_cast(s, o, target, jitted)
        return
    x = spec.value
    if spec.is_float or (jitted and spec.kind == "np_float_scalar"):
        assert np.asarray(out).dtype == target
        reference = np.asarray(x).astype(F32 if jitted and x.dtype == F64 else x.dtype)
        # Compared in float64, exact for every dtype here (numpy's testing does
        # not see two bfloat16 NaNs as equal).
        np.testing.assert_array_equal(
            np.asarray(out).astype(F64), reference.astype(target).astype(F64)
        )
        zeros = np.asarray(reference) == 0
        signs = np.signbit(np.asarray(out))[zeros]
        np.testing.assert_array_equal(signs, np.signbit(reference)[zeros])
        if not jitted:
            for kind in (jax.Array, np.ndarray, np.generic):  # the kind of array is kept
                assert isinstance(out, kind) == isinstance(x, kind)
            if np.asarray(x).dtype == target:
                # No convert op, no copy; a numpy array, mutable, copied (as jmp).
                assert (out is x) != isinstance(x, np.ndarray)
        return
    if not jitted:
        assert out is x
    elif spec.kind == "typed_key":
        assert_bitwise_equal(jax.random.key_data(out), jax.random.key_data(x))
    else:
        expected = np.asarray(x)
        if expected.dtype == np.int64:
            expected = expected.astype(np.int32)  # jit's own x64-off narrowing
        assert_bitwise_equal(np.asarray(out), expected)


_CASTS = {
    "cast_to_param": lambda policy: (policy.cast_to_param, policy.param_dtype),
    "cast_to_compute": lambda policy: (policy.cast_to_compute, policy.compute_dtype),
    "cast_to_output": lambda policy: (policy.cast_to_output, policy.output_dtype),
    "cast_to_half": lambda policy: (jmp.cast_to_half, jmp.half_dtype()),
    "cast_to_full": lambda policy: (jmp.cast_to_full, F32),
}
_policies = st.builds(Policy, *[st.sampled_from(_JAX_FLOATS)] * 3)


@settings(max_examples=200, deadline=None)
@given(spec=_trees(jittable=False), policy=_policies, method=st.sampled_from(sorted(_CASTS)))
def test_property_cast_changes_exactly_the_floating_leaves(spec, policy, method):
    """Random nests of dicts, lists and tuples of jax and numpy arrays (bf16, f16,
    f32, f64, ints, bools), numpy scalars, PRNG keys, Python scalars, None and
    strings: float arrays get the target dtype and keep value, sign and array
    type (a leaf already in it is returned as is); every other leaf, numpy
    float scalars included (as jmp), is returned as is."""
    cast, target = _CASTS[method](policy)
    _check_cast(spec, cast(_values(spec)), target, jitted=False)


@settings(max_examples=40, deadline=None)
@given(spec=_trees(jittable=True), policy=_policies, method=st.sampled_from(sorted(_CASTS)))
def test_property_cast_under_jit_changes_exactly_the_floating_leaves(spec, policy, method):
    """The same under jax.jit, where every array leaf is a tracer."""
    cast, target = _CASTS[method](policy)
    _check_cast(spec, jax.jit(cast)(_values(spec)), target, jitted=True)
