"""Loss scales: the dynamic rule, dtypes, pytree behaviour, finiteness helpers."""

import dataclasses
import math
import warnings

import hypothesis
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import strategies as st

import jmp_policy as jmp

F32_MAX = float(np.finfo(np.float32).max)
F32_TINY = float(np.finfo(np.float32).tiny)


# --- A pure-Python reference of the documented rule -----------------------------


def reference_trajectory(
    finite_steps,
    loss_scale,
    period=2000,
    factor=2,
    min_loss_scale=1.0,
    max_loss_scale=F32_MAX,
    hysteresis=1,
):
    """Returns [(scale, counter, overflows)] after each step, in float32 arithmetic.

    Written from `DynamicLossScale`'s docstring: growth on the `period`-th finite
    step in a row if the result is finite and <= max; every overflow restarts the
    counter; the `hysteresis`-th overflow since the scale last grew or backed off
    divides by `factor`, floored at `min_loss_scale`.
    """
    scale, counter, overflows = np.float32(loss_scale), 0, 0
    f = np.float32(factor)
    floor = np.float32(max(min_loss_scale, F32_TINY))
    out = []
    with np.errstate(over="ignore"):
        for finite in finite_steps:
            if finite:
                counter += 1
                if counter == period:
                    counter = 0
                    grown = np.float32(scale * f)
                    if math.isfinite(grown) and float(grown) <= max_loss_scale:
                        scale, overflows = grown, 0
            else:
                counter = 0
                overflows += 1
                if overflows == hysteresis:
                    scale, overflows = max(np.float32(scale / f), floor), 0
            out.append((float(scale), counter, overflows))
    return out


@jax.jit
def run_trajectory(loss_scale, finite_steps):
    """The scale, counter and overflow count after each step, in one lax.scan."""

    def step(ls, finite):
        ls = ls.adjust(finite)
        overflows = ls.overflows if ls.overflows is not None else jnp.int32(0)
        return ls, (ls.loss_scale, ls.counter, overflows)

    return jax.lax.scan(step, loss_scale, finite_steps)


def trajectory(ls, steps):
    final, (scales, counters, overflows) = run_trajectory(ls, jnp.asarray(steps, bool))
    assert scales.dtype == jnp.float32 and counters.dtype == jnp.int32
    rows = list(
        zip(
            np.asarray(scales).tolist(),
            np.asarray(counters).tolist(),
            np.asarray(overflows).tolist(),
        )
    )
    return final, rows


T, F = True, False

# (constructor kwargs, steps, expected (scale, counter, overflows) after each step),
# written out by hand so that a mistake shared by the library and the reference
# above still shows.
HAND_CASES = {
    # period 1: every finite step grows, until max blocks it.
    "period1_max": (
        {"loss_scale": 1.0, "period": 1, "max_loss_scale": 8.0},
        [T, T, T, T, F, F],
        [(2, 0, 0), (4, 0, 0), (8, 0, 0), (8, 0, 0), (4, 0, 0), (2, 0, 0)],
    ),
    # growth on the 3rd finite step in a row; an overflow restarts the count.
    "period3": (
        {"loss_scale": 8.0, "period": 3},
        [T, T, T, T, F, T, T, T],
        [(8, 1, 0), (8, 2, 0), (16, 0, 0), (16, 1, 0), (8, 0, 0), (8, 1, 0), (8, 2, 0), (16, 0, 0)],
    ),
    # factor 3, floored at min_loss_scale=2.
    "factor3_min": (
        {"loss_scale": 9.0, "period": 2, "factor": 3, "min_loss_scale": 2.0},
        [F, F, F, T, T],
        [(3, 0, 0), (2, 0, 0), (2, 0, 0), (2, 1, 0), (6, 0, 0)],
    ),
    # non-power-of-two factor.
    "factor1.5": (
        {"loss_scale": 6.0, "period": 1, "factor": 1.5},
        [T, F, F],
        [(9, 0, 0), (6, 0, 0), (4, 0, 0)],
    ),
    # hysteresis 2: every second overflow backs off; finite steps in between
    # do not forget the first one; growth resets the overflow count.
    "hysteresis2": (
        {"loss_scale": 16.0, "period": 2, "hysteresis": 2},
        [F, T, F, F, F, F, T, T, F, T, T, F],
        [
            (16, 0, 1),
            (16, 1, 1),
            (8, 0, 0),
            (8, 0, 1),
            (4, 0, 0),
            (4, 0, 1),
            (4, 1, 1),
            (8, 0, 0),
            (8, 0, 1),
            (8, 1, 1),
            (16, 0, 0),
            (16, 0, 1),
        ],
    ),
    # hysteresis 3 at max: blocked growth is no change, so overflows carry on.
    "hysteresis3_max": (
        {"loss_scale": 32.0, "period": 1, "hysteresis": 3, "max_loss_scale": 32.0},
        [F, F, T, F, T, F],
        [(32, 0, 1), (32, 0, 2), (32, 0, 2), (16, 0, 0), (32, 0, 0), (32, 0, 1)],
    ),
    # min_loss_scale=0 still floors at float32's smallest normal number.
    "tiny_floor": (
        {"loss_scale": 4 * F32_TINY, "min_loss_scale": 0.0},
        [F, F, F, F],
        [(2 * F32_TINY, 0, 0), (F32_TINY, 0, 0), (F32_TINY, 0, 0), (F32_TINY, 0, 0)],
    ),
}


@pytest.mark.parametrize("name", sorted(HAND_CASES))
def test_trajectory_by_hand(name):
    kwargs, steps, expected = HAND_CASES[name]
    _, rows = trajectory(jmp.DynamicLossScale(**kwargs), steps)
    assert rows == [(float(s), c, o) for s, c, o in expected]
    assert reference_trajectory(steps, **kwargs) == rows


def test_default_period_grows_on_2000th_finite_step():
    ls = jmp.DynamicLossScale(2.0**15)
    _, rows = trajectory(ls, [T] * 2001)
    assert rows[1998] == (2.0**15, 1999, 0)
    assert rows[1999] == (2.0**16, 0, 0)
    assert rows[2000] == (2.0**16, 1, 0)


# A fixed menu of static configurations (each compiles once); hypothesis varies
# the start scale and the step sequences, which are array leaves.
CONFIGS = [
    {"period": 1, "factor": 2, "hysteresis": 1, "log_min": 0, "log_span": 3},
    {"period": 2, "factor": 2, "hysteresis": 2, "log_min": -3, "log_span": 6},
    {"period": 3, "factor": 4.0, "hysteresis": 1, "log_min": 2, "log_span": 8},
    {"period": 1, "factor": 2, "hysteresis": 3, "log_min": 0, "log_span": 0},
    {"period": 5, "factor": 2, "hysteresis": 4, "log_min": 1, "log_span": 2},
    {"period": 2, "factor": 3, "hysteresis": 1, "log_min": 0, "log_span": 5},
    {"period": 1, "factor": 1.5, "hysteresis": 2, "log_min": -2, "log_span": 4},
]


@jax.jit
def run_trajectories(loss_scale, finite_steps):
    return jax.vmap(run_trajectory, in_axes=(None, 0))(loss_scale, finite_steps)


@hypothesis.settings(deadline=None, max_examples=40)
@hypothesis.given(
    config=st.sampled_from(CONFIGS),
    data=st.data(),
    batch=st.lists(st.lists(st.booleans(), min_size=48, max_size=48), min_size=8, max_size=8),
)
def test_trajectory_matches_reference(config, data, batch):
    # Eight sequences per compiled configuration, run at once with vmap.
    lo = 2.0 ** config["log_min"]
    hi = 2.0 ** (config["log_min"] + config["log_span"])
    start = 2.0 ** data.draw(st.integers(config["log_min"], config["log_min"] + config["log_span"]))
    exact = config["factor"] in (2, 4)
    if not exact:
        # XLA divides by a constant as a multiply by its reciprocal (an ulp off
        # for 3 and 1.5): keep the upper bound out of reach, so that rounding
        # cannot flip a growth decision, and compare scales within tolerance.
        hi = F32_MAX
    kwargs = {
        "loss_scale": start,
        "period": config["period"],
        "factor": config["factor"],
        "min_loss_scale": lo,
        "max_loss_scale": hi,
        "hysteresis": config["hysteresis"],
    }
    final, (scales, counters, overflows) = run_trajectories(
        jmp.DynamicLossScale(**kwargs), jnp.asarray(batch, bool)
    )
    for i, steps in enumerate(batch):
        expected = reference_trajectory(steps, **kwargs)
        got = np.asarray(scales[i]).tolist()
        if exact:
            assert got == [e[0] for e in expected]
        else:
            np.testing.assert_allclose(got, [e[0] for e in expected], rtol=1e-5)
        assert list(zip(np.asarray(counters[i]).tolist(), np.asarray(overflows[i]).tolist())) == [
            e[1:] for e in expected
        ]
        assert all(lo <= x <= hi for x in got)
        assert float(final.loss_scale[i]) == got[-1]


def test_min_loss_scale_survives_jit():
    ls = jmp.DynamicLossScale(4.0, min_loss_scale=2.0, max_loss_scale=64.0)
    same = jax.jit(lambda s: s)(ls)
    assert (same.min_loss_scale, same.max_loss_scale) == (2.0, 64.0)
    backed_off = jax.jit(lambda s: s.adjust(jnp.bool_(False)).adjust(jnp.bool_(False)))(ls)
    # jmp drops min_loss_scale in tree_flatten and would reach 1.0 here.
    assert float(backed_off.loss_scale) == 2.0
    assert backed_off.min_loss_scale == 2.0


@pytest.mark.parametrize(
    "value", [jnp.float16(2**15), jnp.bfloat16(2**15), np.float16(2**15)], ids=str
)
def test_half_scale_is_stored_in_float32(value):
    ls = jmp.DynamicLossScale(value, period=1)
    assert ls.loss_scale.dtype == jnp.float32
    # float16's max is 65504: the scale must be able to grow past it.
    grown = jax.jit(lambda s: s.adjust(jnp.bool_(True)).adjust(jnp.bool_(True)))(ls)
    assert grown.loss_scale.dtype == jnp.float32
    assert float(grown.loss_scale) == 2.0**17


def test_static_half_scale():
    ls = jmp.StaticLossScale(np.float16(8.0))
    out = jax.jit(lambda g: ls.unscale(g))(jnp.float16(4.0))
    assert out.dtype == jnp.float32 and float(out) == 0.5


def test_int_scale_warns_then_works():
    with pytest.warns(UserWarning, match="Expected floating type for loss_scale"):
        ls = jmp.DynamicLossScale(2**15, period=1)
    assert ls.loss_scale.dtype == jnp.float32
    out = jax.jit(lambda s: s.adjust(jnp.bool_(False)).adjust(jnp.bool_(True)))(ls)
    assert float(out.loss_scale) == 2.0**15
    with pytest.warns(UserWarning, match="Expected floating type for min_loss_scale"):
        ls = jmp.DynamicLossScale(2.0, min_loss_scale=1)
    assert ls.min_loss_scale == 1.0


@pytest.mark.parametrize(
    "kwargs, final",
    [
        ({"period": 1}, 2.0**127),  # grows until the next step would be inf
        ({"period": 1, "max_loss_scale": 2.0**20}, 2.0**20),
        ({}, 2.0**25),  # default period 2000: 10 doublings
        ({"period": 3, "factor": 3}, None),
    ],
    ids=["period1", "period1_max", "default", "factor3"],
)
def test_long_all_finite_scan_never_reaches_inf(kwargs, final):
    ls = jmp.DynamicLossScale(2.0**15, **kwargs)
    out, (scales, _, _) = run_trajectory(ls, jnp.ones([20_000], bool))
    scales = np.asarray(scales)
    assert np.isfinite(scales).all()
    assert scales.max() <= ls.max_loss_scale
    assert np.all(np.diff(scales) >= 0)
    if final is not None:
        assert float(out.loss_scale) == final
    else:  # 3**k * 2**15 stays finite: at most F32_MAX.
        assert float(out.loss_scale) * 3 > F32_MAX


# --- Pytree behaviour ------------------------------------------------------------


def assert_same_loss_scale(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb  # includes every static hyperparameter
    for x, y in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(x, y)


SCALES = {
    "noop": jmp.NoOpLossScale(),
    "static": jmp.StaticLossScale(128.0),
    "dynamic": jmp.DynamicLossScale(2.0**15),
    "dynamic_all": jmp.DynamicLossScale(
        8.0,
        counter=3,
        period=7,
        factor=3,
        min_loss_scale=0.5,
        max_loss_scale=2.0**20,
        hysteresis=3,
    ),
}


@pytest.mark.parametrize("name", sorted(SCALES))
def test_pytree_round_trips(name):
    ls = SCALES[name]
    assert_same_loss_scale(jax.jit(lambda s: s)(ls), ls)
    assert_same_loss_scale(jax.tree.map(lambda x: x, ls), ls)
    leaves, treedef = jax.tree.flatten(ls)
    assert_same_loss_scale(jax.tree.unflatten(treedef, leaves), ls)
    carried, _ = jax.lax.scan(lambda c, _: (c, None), ls, length=3)
    assert_same_loss_scale(carried, ls)


@pytest.mark.parametrize("name", sorted(SCALES))
def test_protocol_under_jit(name):
    ls = SCALES[name]
    assert isinstance(ls, jmp.LossScale)

    @jax.jit
    def use(ls, grads):
        return ls.scale(grads), ls.unscale(grads), ls.adjust(jmp.all_finite(grads))

    grads = {"w": jnp.array([1.0, 2.0], jnp.float32), "i": jnp.arange(2)}
    scaled, unscaled, adjusted = use(ls, grads)
    s = float(ls.loss_scale)
    np.testing.assert_array_equal(scaled["w"], grads["w"] * s)
    np.testing.assert_array_equal(unscaled["w"], grads["w"] / s)
    assert scaled["i"].dtype == unscaled["i"].dtype == jnp.int32
    assert jax.tree.structure(adjusted) == jax.tree.structure(ls)


def test_tree_map_to_none_and_zeros_keeps_structure():
    # Checkpointers build trees like these (orbax: one `None` per leaf); the
    # hysteresis state must not be re-created behind their back.
    for ls in SCALES.values():
        nones = jax.tree.map(lambda x: None, ls)
        assert jax.tree.leaves(nones) == []
        assert jax.tree.structure(jax.tree.map(jnp.zeros_like, ls)) == jax.tree.structure(ls)


def test_given_overflow_count_backs_off_only_on_overflow():
    ls = jmp.DynamicLossScale(8.0, hysteresis=2, overflows=jnp.int32(2))
    assert float(ls.adjust(jnp.bool_(True)).loss_scale) == 8.0
    assert float(ls.adjust(jnp.bool_(False)).loss_scale) == 4.0


def test_scan_carry_adjusts():
    ls = jmp.DynamicLossScale(2.0, period=2, hysteresis=2)
    out, _ = jax.lax.scan(lambda c, f: (c.adjust(f), None), ls, jnp.array([T, T, F, F]))
    assert (float(out.loss_scale), int(out.counter), int(out.overflows)) == (2.0, 0, 0)
    assert out.hysteresis == 2 and out.period == 2


def test_leaves():
    ls = jmp.DynamicLossScale(2.0**15)
    leaves = jax.tree.leaves(ls)
    assert len(leaves) == 2
    assert leaves[0] is ls.loss_scale and leaves[1] is ls.counter
    assert [np.asarray(x).dtype for x in leaves] == [np.float32, np.int32]
    assert jax.tree.leaves(jmp.NoOpLossScale()) == []
    assert jax.tree.leaves(jmp.StaticLossScale(4.0)) == []
    with_hysteresis = jax.tree.leaves(jmp.DynamicLossScale(2.0**15, hysteresis=2))
    assert len(with_hysteresis) == 3
    assert np.asarray(with_hysteresis[2]).dtype == np.int32
    assert int(with_hysteresis[2]) == 0


def test_jit_of_python_float_scale_does_not_retrace():
    traces = []

    @jax.jit
    def step(ls):
        traces.append(None)
        return ls.adjust(jnp.bool_(True))

    for ls in (jmp.DynamicLossScale(2.0**15), jmp.DynamicLossScale(2.0**15, hysteresis=2)):
        traces.clear()
        for _ in range(4):
            ls = step(ls)
        assert len(traces) == 1
        assert int(ls.counter) == 4


def test_jit_output_does_not_block_on_the_device():
    # Unflattening a jit output runs `__post_init__`; it must not read the
    # scale back to the host, or every train step would wait for the device.
    @jax.jit
    def slow_step(ls, x):
        x = jax.lax.fori_loop(0, 15, lambda i, x: jnp.tanh(x @ x), x)
        return ls.adjust(jmp.all_finite(x))

    ls, x = jmp.DynamicLossScale(2.0**15), jnp.full((512, 512), 1e-3, jnp.float32)
    jax.block_until_ready(slow_step(ls, x))
    out = slow_step(ls, x)
    assert not out.loss_scale.is_ready()
    assert float(out.loss_scale) == 2.0**15


# --- scale and unscale -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize(
    "ls",
    [jmp.DynamicLossScale(3.0), jmp.StaticLossScale(3.0), jmp.DynamicLossScale(2.0**15)],
    ids=["dynamic3", "static3", "dynamic2^15"],
)
def test_unscale_half_grads_in_float32(dtype, ls):
    rng = np.random.default_rng(0)
    grads = {"w": jnp.asarray(rng.normal(size=64) * 1e-3, dtype), "i": jnp.arange(3)}
    # Unscaling multiplies by the float32 reciprocal, as jmp does: within an
    # ulp of the division.
    scale = np.float32(float(ls.loss_scale))
    expected = np.asarray(grads["w"], np.float32) * (np.float32(1) / scale)
    np.testing.assert_allclose(expected, np.asarray(grads["w"], np.float32) / scale, rtol=2e-7)
    for unscale in (ls.unscale, jax.jit(ls.unscale)):
        out = unscale(grads)
        assert out["w"].dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(out["w"]), expected)
        assert out["i"].dtype == jnp.int32
    if dtype == jnp.bfloat16 and float(ls.loss_scale) == 2.0**15:
        return  # exact in bfloat16 too: nothing to tell apart
    # The check can fail: dividing in half precision gives other values.
    in_half = np.asarray((grads["w"] / jnp.asarray(ls.loss_scale, dtype)).astype(jnp.float32))
    assert not np.array_equal(in_half, expected)


def test_scale_loss():
    ls = jmp.DynamicLossScale(2.0**15)
    for scale in (ls.scale, jax.jit(ls.scale)):
        out = scale(jnp.float32(1.5))
        assert out.dtype == jnp.float32 and float(out) == 1.5 * 2**15
        # A half loss is scaled in float32: 10 * 2**15 overflows float16.
        out = scale(jnp.float16(10.0))
        assert out.dtype == jnp.float32 and float(out) == 10.0 * 2**15
    assert float(ls.scale(1.5)) == 1.5 * 2**15  # a Python float is scaled too
    assert float(jmp.StaticLossScale(4.0).scale(jnp.float32(2.0))) == 8.0
    assert jmp.NoOpLossScale().scale(1.5) == 1.5
    assert float(jax.jit(jmp.NoOpLossScale().unscale)(jnp.float32(1.5))) == 1.5


# --- all_finite and select_tree ----------------------------------------------------


@pytest.mark.parametrize("jit", [False, True])
def test_all_finite(jit):
    check = jax.jit(jmp.all_finite) if jit else jmp.all_finite
    tree = {
        "f32": jnp.ones(3),
        "bf16": jnp.ones(2, jnp.bfloat16),
        "int": jnp.arange(3),
        "bool": jnp.array([True, False]),
        "none": None,
    }
    assert check(tree).dtype == jnp.bool_ and check(tree).shape == ()
    assert bool(check(tree))
    assert bool(check({})) and bool(check({"i": jnp.arange(2), "n": None}))
    for key, bad in [
        ("f32", jnp.array([1.0, jnp.inf, 0.0])),
        ("bf16", jnp.array([jnp.nan, 1.0], jnp.bfloat16)),
        ("f32", jnp.array([-jnp.inf, 1.0, 0.0])),
    ]:
        assert not bool(check({**tree, key: bad}))
    assert not bool(check({"x": jnp.array([1.0 + 0j, jnp.inf + 0j])}))
    if not jit:  # Python floats are leaves too (static under jit).
        assert not bool(jmp.all_finite({"x": float("nan")}))
        assert bool(jmp.all_finite({"x": 1.0, "i": 3}))


@pytest.mark.parametrize("jit", [False, True])
def test_select_tree(jit):
    select = jax.jit(jmp.select_tree) if jit else jmp.select_tree
    a = {"w": jnp.ones(3), "n": jnp.int32(1), "h": jnp.ones(2, jnp.bfloat16)}
    b = {"w": jnp.zeros(3), "n": jnp.int32(2), "h": jnp.zeros(2, jnp.bfloat16)}
    for pred, want in ((True, a), (False, b)):
        out = select(jnp.bool_(pred), a, b)
        for k in a:
            assert out[k].dtype == want[k].dtype
            np.testing.assert_array_equal(out[k], want[k])


@pytest.mark.parametrize(
    "pred",
    [jnp.array([True, False]), jnp.int32(1), jnp.float32(1.0), jnp.ones([1], bool)],
    ids=["vector", "int", "float", "shape1"],
)
def test_select_tree_rejects_non_boolean_scalar(pred):
    a = {"w": jnp.ones(2)}
    for select in (jmp.select_tree, jax.jit(jmp.select_tree)):
        with pytest.raises(ValueError, match="expected boolean scalar"):
            select(pred, a, a)
        with pytest.raises(AssertionError, match="expected boolean scalar"):
            select(pred, a, a)
    with pytest.raises(ValueError, match="expected boolean scalar"):
        jmp.DynamicLossScale(2.0).adjust(pred)


# --- Bad input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, name",
    [
        ({"loss_scale": 0.0}, "loss_scale"),
        ({"loss_scale": -2.0}, "loss_scale"),
        ({"loss_scale": float("inf")}, "loss_scale"),
        ({"loss_scale": float("nan")}, "loss_scale"),
        ({"loss_scale": np.float32(-1.0)}, "loss_scale"),
        ({"loss_scale": 1e39}, "loss_scale"),  # inf in float32
        ({"loss_scale": 2.0, "period": 0}, "period"),
        ({"loss_scale": 2.0, "period": 1.5}, "period"),
        ({"loss_scale": 2.0, "factor": 1}, "factor"),
        ({"loss_scale": 2.0, "factor": 0.5}, "factor"),
        ({"loss_scale": 2.0, "factor": float("inf")}, "factor"),
        ({"loss_scale": 2.0, "factor": 1 + 1e-9}, "factor"),  # 1 in float32: never moves
        ({"loss_scale": 2.0, "factor": 1e39}, "factor"),  # inf in float32
        ({"loss_scale": 2.0, "counter": 2**40}, "counter"),  # not an int32
        ({"loss_scale": 2.0, "hysteresis": 0}, "hysteresis"),
        ({"loss_scale": 2.0, "min_loss_scale": 4.0, "max_loss_scale": 2.0}, "min_loss_scale"),
        ({"loss_scale": 0.5}, "loss_scale"),  # below the default min 1.0
        ({"loss_scale": 2.0**20, "max_loss_scale": 2.0**10}, "loss_scale"),
        ({"loss_scale": 2.0, "hysteresis": 2**31}, "hysteresis"),  # overflows are int32
        # Subnormal in float32: unscaling would overflow every gradient.
        ({"loss_scale": 1e-39, "min_loss_scale": 0.0}, "loss_scale"),
        # Python ints too large for a float are out of range, not an OverflowError.
        ({"loss_scale": 10**400}, "loss_scale"),
        ({"loss_scale": 2.0, "period": 10**400}, "period"),
        ({"loss_scale": 2.0, "factor": 10**400}, "factor"),
        ({"loss_scale": 2.0, "min_loss_scale": 10**400}, "min_loss_scale"),
        ({"loss_scale": 2.0, "counter": 10**400}, "counter"),
    ],
)
def test_bad_dynamic_arguments(kwargs, name):
    with pytest.raises(ValueError, match=name):
        jmp.DynamicLossScale(**kwargs)


@pytest.mark.parametrize("jit", [False, True])
def test_bounds_that_are_not_float32_numbers_hold_as_float32_numbers(jit):
    # 0.7 and 0.01 are not float32 numbers: `adjust` floors in float32, and the
    # state it returns is valid (eagerly it was refused: 0.69999999 < 0.7).
    adjust = jax.jit(lambda s, f: s.adjust(f)) if jit else (lambda s, f: s.adjust(f))
    for lo, steps in ((0.7, 1), (0.01, 8)):
        ls = jmp.DynamicLossScale(1.0, period=1, min_loss_scale=lo)
        for _ in range(steps):
            ls = adjust(ls, jnp.bool_(False))
        assert ls.loss_scale == np.float32(lo)
        dataclasses.replace(ls)  # Still a valid state.
    ls = jmp.DynamicLossScale(2.0, period=1, factor=1.5, max_loss_scale=2.9999999)
    assert adjust(ls, jnp.bool_(True)).loss_scale == 3.0  # 2.9999999 is 3 in float32


def test_a_zero_static_scale_says_every_step_is_skipped():
    with pytest.warns(UserWarning, match="loss_scaled skips every step"):
        ls = jmp.StaticLossScale(0)
    assert not jmp.all_finite(ls.unscale(ls.scale(jnp.ones(2))))


def test_a_cap_beyond_float32_is_float32s_largest_number():
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # No numpy overflow warning, here or in `adjust`.
        for cap in (1e39, 10**400):
            ls = jmp.DynamicLossScale(2.0**127, period=1, max_loss_scale=cap)
            assert ls.max_loss_scale == float(np.finfo(np.float32).max)
            assert ls.adjust(jnp.bool_(True)).loss_scale == 2.0**127  # 2**128 is inf


def test_a_scalar_predicate_of_another_dtype_is_not_told_to_reduce():
    with pytest.raises(ValueError, match=r"dtype int32\. Pass a boolean"):
        jmp.DynamicLossScale(2.0).adjust(jnp.int32(0))
    with pytest.raises(ValueError, match="Reduce it first"):
        jmp.DynamicLossScale(2.0).adjust(jnp.ones(2, bool))


@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), 10**400])
def test_bad_static_scale(value):
    with pytest.raises(ValueError, match="loss_scale"):
        jmp.StaticLossScale(value)


def test_unflatten_does_not_validate_or_convert_leaves():
    """tree.map to zeros or to axis specs rebuilds the tree as is (no ValueError for
    a zero scale, no float conversion of ints): unflattening never calls __init__."""
    ls = jmp.DynamicLossScale(2.0**15, hysteresis=2)
    zeros = jax.tree.map(np.zeros_like, ls)
    assert float(zeros.loss_scale) == 0.0 and zeros.min_loss_scale == 1.0
    axes = jax.tree.map(lambda _: 0, ls)
    assert (axes.loss_scale, axes.counter, axes.overflows) == (0, 0, 0)
    batched = jax.tree.map(lambda x: jnp.stack([x, x]), ls)
    adjusted = jax.vmap(lambda s: s.adjust(jnp.bool_(False)), in_axes=(axes,))(batched)
    assert adjusted.loss_scale.shape == (2,) and adjusted.hysteresis == 2
