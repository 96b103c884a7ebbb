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
* bad input and property tests of casting: `test_bad_input.py`.

What the other test files already cover (the dynamic rule against a reference,
20,000-step scans, spec round trips, a next-step checkpoint test, data
parallel and `shard_map` steps) is not repeated here. tests/README.md lists the
figures.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp
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
