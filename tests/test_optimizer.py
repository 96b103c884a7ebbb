"""The optax wrapper `loss_scaled`: skipping, equivalence, composition, checkpoints."""

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jmp

from helpers import assert_bitwise_equal, bits


@pytest.fixture(autouse=True)
def _optax_promotion(request):
    # optax itself is not clean under strict promotion (adam's bias correction
    # raises a float to an int32 power, MultiSteps divides float by int32), so
    # these tests run under standard promotion; tests that request `strict`
    # (sgd, clipping: our code alone) keep the suite's strict promotion.
    if "strict" in request.fixturenames:
        yield
    else:
        with jax.numpy_dtype_promotion("standard"):
            yield


@pytest.fixture
def strict():
    yield


# --- A tiny MLP, in plain jnp -----------------------------------------------------

N_STEPS, BATCH = 12, 8


def init_params(seed=0):
    rng = np.random.default_rng(seed)
    return {
        "w1": jnp.asarray(rng.normal(size=(4, 8)) * 0.5, jnp.float32),
        "b1": jnp.zeros(8, jnp.float32),
        "w2": jnp.asarray(rng.normal(size=(8, 1)) * 0.5, jnp.float32),
        "b2": jnp.zeros(1, jnp.float32),
    }


def make_data(seed=1):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(N_STEPS, BATCH, 4)), jnp.float32)
    y = jnp.asarray(rng.normal(size=(N_STEPS, BATCH, 1)), jnp.float32)
    return x, y


def loss_fn(params, x, y):
    h = jnp.tanh(x @ params["w1"] + params["b1"])
    return jnp.mean((h @ params["w2"] + params["b2"] - y) ** 2)


def scaled_train_step(tx, inject="loss"):
    """The README's train step; `poison` (1 or inf) injects an overflow."""

    @jax.jit
    def step(params, opt_state, x, y, poison):
        loss_scale = jmp.get_loss_scale(opt_state)

        def scaled_loss(p):
            loss = loss_fn(p, x, y)
            if inject == "loss":
                loss = loss * poison
            return loss_scale.scale(loss)

        grads = jax.grad(scaled_loss)(params)
        if inject == "grad":  # as PyTorch's test does: inf in one gradient
            grads = {**grads, "w2": grads["w2"].at[3, 0].multiply(poison)}
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def control_train_step(tx):
    @jax.jit
    def step(params, opt_state, x, y):
        grads = jax.grad(loss_fn)(params, x, y)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def poison(step, bad_steps):
    return jnp.float32(jnp.inf if step in bad_steps else 1.0)


# --- PyTorch GradScaler's equivalence test --------------------------------------

BAD_STEPS = (2, 5, 6)


def inner_optimizers():
    return {
        "adam_schedule": lambda: optax.adam(optax.exponential_decay(3e-2, 1, 0.8)),
        "adamw": lambda: optax.adamw(3e-2, weight_decay=0.3),
        "sgd_momentum_clip": lambda: optax.chain(
            optax.clip_by_global_norm(0.5), optax.sgd(0.1, momentum=0.9)
        ),
    }


@pytest.mark.parametrize(
    "name, inject",
    [("adam_schedule", "loss"), ("adamw", "grad"), ("sgd_momentum_clip", "loss")],
)
def test_equivalent_to_float32_run_that_skips_the_same_steps(name, inject):
    make_inner = inner_optimizers()[name]
    x, y = make_data()
    tx = jmp.loss_scaled(make_inner(), jmp.DynamicLossScale(2.0**15, period=3))
    step = scaled_train_step(tx, inject)
    params = init_params()
    state = tx.init(params)
    for i in range(N_STEPS):
        before = (params, state.inner_state)
        params, state = step(params, state, x[i], y[i], poison(i, BAD_STEPS))
        if i in BAD_STEPS:  # a skipped step changes nothing, bit for bit
            assert_bitwise_equal((params, state.inner_state), before)

    control_tx = make_inner()
    control_step = control_train_step(control_tx)
    control_params = init_params()
    control_state = control_tx.init(control_params)
    for i in range(N_STEPS):
        if i not in BAD_STEPS:
            control_params, control_state = control_step(control_params, control_state, x[i], y[i])

    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(control_params)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    for a, b in zip(jax.tree.leaves(state.inner_state), jax.tree.leaves(control_state)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    # The run moved: the test compares trained parameters, not the initial ones.
    assert not np.allclose(params["w1"], init_params()["w1"])
    # 2**15, period 3: steps 2, 5, 6 back off; steps 0-1 (2 finite), 3-4 (2),
    # 7-9 grow once, 10-11 leave the counter at 2.
    ls = jmp.get_loss_scale(state)
    assert (float(ls.loss_scale), int(ls.counter)) == (2.0**13, 2)
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (0, 3)


def test_skipped_step_keeps_signed_zeros_and_state_bits(strict):
    params = {"w": jnp.array([0.0, -0.0, 1.5, -2.0], jnp.float32)}
    tx = jmp.loss_scaled(optax.sgd(0.1, momentum=0.9), jmp.DynamicLossScale(4.0))
    update = jax.jit(tx.update)
    state = tx.init(params)
    updates, state = update({"w": jnp.array([4.0, -4.0, 8.0, 0.0])}, state, params)
    params = optax.apply_updates(params, updates)
    params = {"w": params["w"].at[:2].set(jnp.array([0.0, -0.0]))}
    before = (params, state.inner_state)
    updates, state = update({"w": jnp.array([jnp.nan, 1.0, 2.0, 3.0])}, state, params)
    # -0.0 updates: p + (-0.0) is p for every p, signed zeros included
    # (0.0 would turn -0.0 into 0.0).
    assert bits(updates["w"]) == bits(jnp.full(4, -0.0))
    assert_bitwise_equal((optax.apply_updates(params, updates), state.inner_state), before)
    assert np.signbit(np.asarray(optax.apply_updates(params, updates)["w"][1]))


def test_counters(strict):
    params = {"w": jnp.ones(2)}
    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(2.0**10))
    update = jax.jit(tx.update)
    state = tx.init(params)
    seen = []
    for g in [jnp.nan, jnp.inf, 1.0, -jnp.inf, 1.0, 1.0]:
        _, state = update({"w": jnp.full(2, g)}, state, params)
        seen.append((int(state.notfinite_count), int(state.total_notfinite)))
        assert state.notfinite_count.dtype == jnp.int32
    assert seen == [(1, 1), (2, 2), (0, 2), (1, 3), (0, 3), (0, 3)]
    assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**7


def test_never_gives_up_unlike_apply_if_finite(strict):
    params = {"w": jnp.ones(3)}
    nan_grads = jnp.full((40, 3), jnp.nan)

    def run(tx, grads_seq):
        @jax.jit
        def go(params, state):
            def body(carry, g):
                params, state = carry
                updates, state = tx.update({"w": g}, state, params)
                return (optax.apply_updates(params, updates), state), None

            return jax.lax.scan(body, (params, state), grads_seq)[0]

        return go(params, tx.init(params))

    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15, min_loss_scale=1.0))
    out, state = run(tx, nan_grads)
    assert_bitwise_equal(out, params)
    assert float(jmp.get_loss_scale(state).loss_scale) == 1.0  # floored, not below
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (40, 40)
    # ... and it trains again at the next finite step.
    updates, state = tx.update({"w": jnp.ones(3)}, state, out)
    np.testing.assert_allclose(optax.apply_updates(out, updates)["w"], 0.9)
    assert int(state.notfinite_count) == 0

    # The contrast: optax.apply_if_finite applies the NaN update after
    # max_consecutive_errors bad steps.
    with jax.numpy_dtype_promotion("standard"):
        out, _ = run(optax.apply_if_finite(optax.sgd(0.1), max_consecutive_errors=5), nan_grads)
    assert np.isnan(np.asarray(out["w"])).all()


def test_clip_inside_sees_unscaled_gradients(strict):
    params = {"w": jnp.zeros(4)}
    true_grads = {"w": jnp.array([0.3, -0.2, 0.1, 0.25], jnp.float32)}  # norm ~0.45
    inner = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    tx = jmp.loss_scaled(inner, jmp.DynamicLossScale(2.0**15))
    state = tx.init(params)
    scaled = jmp.get_loss_scale(state).scale(true_grads)  # norm ~15000
    updates, _ = jax.jit(tx.update)(scaled, state, params)
    # Not clipped: the clip saw the true norm.
    np.testing.assert_allclose(updates["w"], -true_grads["w"], rtol=1e-7)
    # A true norm above the threshold is clipped to it.
    big = {"w": true_grads["w"] * 10}
    updates, _ = jax.jit(tx.update)(jmp.get_loss_scale(state).scale(big), state, params)
    np.testing.assert_allclose(optax.tree.norm(updates), 1.0, rtol=1e-6)
    # The check can fail: clipping the scaled gradients clips them.
    wrong = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(1.0))
    updates, _ = wrong.update(scaled, wrong.init(params), params)
    assert float(optax.tree.norm(updates)) == pytest.approx(1.0, rel=1e-6)


# --- Gradient accumulation: MultiSteps inside and outside --------------------------

LR, K = 0.1, 3


def feed(tx, micro_grads, params):
    """Feeds true micro-batch gradients, each scaled by the current loss scale."""
    update = jax.jit(tx.update)
    state = tx.init(params)
    history = []
    for g in micro_grads:
        ls = jmp.get_loss_scale(state)
        updates, state = update(ls.scale({"w": g}), state, params)
        params = optax.apply_updates(params, updates)
        history.append((params, state))
    return history


def test_multisteps_inside_skips_only_the_bad_micro_batch():
    g = [
        jnp.array([1.0, 2.0]),
        jnp.array([jnp.inf, 0.0]),
        jnp.array([3.0, -1.0]),
        jnp.array([0.5, 0.5]),
    ]
    p0 = {"w": jnp.zeros(2)}
    tx = jmp.loss_scaled(
        optax.MultiSteps(optax.sgd(LR), every_k_schedule=K), jmp.DynamicLossScale(2.0**10)
    )
    history = feed(tx, g, p0)
    (_, s0), (_, s1), (_, s2), (p3, s3) = history
    # The overflowing micro-batch: MultiSteps' state untouched, scale backed off.
    assert_bitwise_equal(s1.inner_state, s0.inner_state)
    assert float(jmp.get_loss_scale(s1).loss_scale) == 2.0**9
    assert int(s2.inner_state.mini_step) == 2
    # The step is the mean of the three finite micro-batches, accumulated
    # unscaled (in float32) although the scale changed in between.
    np.testing.assert_allclose(p3["w"], -LR * (g[0] + g[2] + g[3]) / 3, rtol=1e-6)
    assert int(s3.inner_state.gradient_step) == 1 and int(s3.total_notfinite) == 1


def test_multisteps_outside_skips_the_whole_step_and_poisons_the_accumulator():
    g = [jnp.array([1.0, 2.0]), jnp.array([jnp.inf, 0.0]), jnp.array([3.0, -1.0])]
    good = [jnp.array([0.5, 0.5])] * K
    p0 = {"w": jnp.zeros(2)}
    tx = optax.MultiSteps(
        jmp.loss_scaled(optax.sgd(LR), jmp.DynamicLossScale(2.0**10)), every_k_schedule=K
    )
    history = feed(tx, g + good, p0)
    # The overflow surfaces only at the K-th micro-step: all K are thrown away,
    # and the scale backs off once, at the step boundary.
    p, s = history[K - 1]
    assert_bitwise_equal(p, p0)
    assert float(jmp.get_loss_scale(s).loss_scale) == 2.0**9
    assert int(s.inner_opt_state.total_notfinite) == 1
    # optax resets its accumulator as (1 - emit) * acc, and 0 * nan is nan: the
    # next K finite micro-batches are lost too, and every step after them.
    p, s = history[-1]
    assert np.isnan(np.asarray(s.acc_grads["w"])).any()
    assert_bitwise_equal(p, p0)
    assert float(jmp.get_loss_scale(s).loss_scale) == 2.0**8

    # With should_skip_update_fn=skip_not_finite, MultiSteps drops the bad
    # micro-batch itself, so loss_scaled never sees it and the scale never
    # backs off: a scale that overflows every micro-batch stays forever.
    tx = optax.MultiSteps(
        jmp.loss_scaled(optax.sgd(LR), jmp.DynamicLossScale(2.0**10)),
        every_k_schedule=K,
        should_skip_update_fn=optax.skip_not_finite,
    )
    p, s = feed(tx, [jnp.array([jnp.inf, 0.0])] * (2 * K), p0)[-1]
    assert float(jmp.get_loss_scale(s).loss_scale) == 2.0**10
    assert_bitwise_equal(p, p0)


# --- Schedules and weight decay on skipped steps -----------------------------------


def test_schedule_does_not_advance_on_skipped_steps():
    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=4)
    make = lambda: optax.inject_hyperparams(optax.sgd)(learning_rate=schedule)
    p0 = {"w": jnp.ones(2)}
    tx = jmp.loss_scaled(make(), jmp.DynamicLossScale(2.0**4))
    grads = [1.0, jnp.inf, 1.0, jnp.nan, jnp.nan, 1.0]
    history = feed(tx, [jnp.full(2, g) for g in grads], p0)
    lrs = [float(s.inner_state.hyperparams["learning_rate"]) for _, s in history]
    counts = [int(s.inner_state.count) for _, s in history]
    assert counts == [1, 1, 2, 2, 2, 3]
    assert lrs == [1.0, 1.0, 0.75, 0.75, 0.75, 0.5]
    # learning rates 1.0, 0.75, 0.5 applied to gradient 1: 1 - 2.25.
    np.testing.assert_allclose(history[-1][0]["w"], -1.25)


def test_weight_decay_not_applied_on_skipped_steps():
    p0 = {"w": jnp.array([1.0, -2.0, 3.0])}
    tx = jmp.loss_scaled(optax.adamw(0.1, weight_decay=0.5), jmp.DynamicLossScale(2.0**4))
    history = feed(tx, [jnp.ones(3), jnp.full(3, jnp.nan), jnp.ones(3)], p0)
    assert_bitwise_equal(history[1][0], history[0][0])
    control = optax.adamw(0.1, weight_decay=0.5)
    p, s = p0, control.init(p0)
    for _ in range(2):
        u, s = control.update({"w": jnp.ones(3)}, s, p)
        p = optax.apply_updates(p, u)
    np.testing.assert_allclose(history[-1][0]["w"], p["w"], rtol=1e-6)
    # The check can fail: one more decayed step would differ.
    u, _ = control.update({"w": jnp.zeros(3)}, s, p)
    assert not np.allclose(optax.apply_updates(p, u)["w"], p["w"])


# --- get_loss_scale -----------------------------------------------------------------


def nestings():
    ls = jmp.DynamicLossScale(2.0**12, period=7)
    # Before the wrapper only transforms that keep inf as inf (a clip there
    # would see scaled gradients: put it inside).
    wrapped = lambda: jmp.loss_scaled(optax.sgd(0.1), ls)
    return {
        "direct": wrapped(),
        "chain": optax.chain(optax.scale(1.0), wrapped()),
        "named_chain": optax.named_chain(("clip", optax.scale(1.0)), ("opt", wrapped())),
        "multisteps_outside": optax.MultiSteps(wrapped(), every_k_schedule=2),
        "multisteps_inside": jmp.loss_scaled(
            optax.MultiSteps(optax.sgd(0.1), every_k_schedule=2), ls
        ),
        "inject_hyperparams": optax.inject_hyperparams(
            lambda learning_rate: jmp.loss_scaled(optax.sgd(learning_rate), ls)
        )(learning_rate=0.1),
        "inject_inside": jmp.loss_scaled(optax.inject_hyperparams(optax.sgd)(0.1), ls),
        "deep": optax.chain(
            optax.named_chain(("a", optax.MultiSteps(optax.chain(optax.scale(1.0), wrapped()), 2)))
        ),
    }


@pytest.mark.parametrize("name", sorted(nestings()))
def test_get_loss_scale_finds_it(name):
    tx = nestings()[name]
    params = {"w": jnp.ones(2)}
    state = tx.init(params)
    ls = jmp.get_loss_scale(state)
    assert isinstance(ls, jmp.DynamicLossScale) and ls.period == 7
    assert float(jax.jit(lambda s: jmp.get_loss_scale(s).loss_scale)(state)) == 2.0**12
    # ... and follows it through an update with an overflow.
    for _ in range(2):  # two micro-steps reach MultiSteps' step boundary
        _, state = jax.jit(tx.update)({"w": jnp.full(2, jnp.inf)}, state, params)
    assert float(jmp.get_loss_scale(state).loss_scale) < 2.0**12


def test_get_loss_scale_errors():
    params = {"w": jnp.ones(2)}
    with pytest.raises(ValueError, match="LossScaledState"):
        jmp.get_loss_scale(optax.adam(0.1).init(params))
    two = optax.chain(
        jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale()),
        jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale()),
    )
    with pytest.raises(ValueError, match="found 2"):
        jmp.get_loss_scale(two.init(params))
    # One wrapped in another (a trainer wrapping a user's wrapped optimizer):
    # gradients would be unscaled twice by a scale read from only one of them.
    nested = jmp.loss_scaled(jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale()),
                             jmp.NoOpLossScale())  # fmt: skip
    with pytest.raises(ValueError, match="found 2"):
        jmp.get_loss_scale(nested.init(params))
    with pytest.raises(TypeError, match="loss_scale"):
        jmp.loss_scaled(optax.sgd(0.1), 2.0**15)


def test_half_gradients_of_float32_parameters_give_float32_updates():
    # As plain optax: Adam's moments are float32, made from the parameters.
    params = {"w": jnp.ones(3)}
    tx = jmp.loss_scaled(optax.adam(1e-3), jmp.DynamicLossScale(2.0**4))
    updates, _ = tx.update({"w": jnp.ones(3, jnp.bfloat16)}, tx.init(params), params)
    plain, _ = optax.adam(1e-3).update(
        {"w": jnp.ones(3, jnp.bfloat16)}, optax.adam(1e-3).init(params), params
    )
    assert updates["w"].dtype == plain["w"].dtype == jnp.float32


def test_a_loss_scale_of_another_library_is_named_as_such():
    class DynamicLossScale:  # As DeepMind's jmp names its own.
        pass

    with pytest.raises(
        TypeError, match=r"jmp_policy's .* \(a test_optimizer\.(.*)DynamicLossScale\)"
    ):
        jmp.loss_scaled(optax.sgd(0.1), DynamicLossScale())


# --- Checkpointing ------------------------------------------------------------------


def test_orbax_checkpoint_restores_identical_next_step(tmp_path):
    ocp = pytest.importorskip("orbax.checkpoint")
    x, y = make_data()
    tx = jmp.loss_scaled(optax.adam(1e-2), jmp.DynamicLossScale(2.0**15, period=2, hysteresis=2))
    step = scaled_train_step(tx)
    params = init_params()
    state = tx.init(params)
    for i, bad in enumerate([False, True, False, True, True]):
        params, state = step(params, state, x[i], y[i], poison(0, [0] if bad else []))
    ls = jmp.get_loss_scale(state)
    assert float(ls.loss_scale) == 2.0**14 and int(state.total_notfinite) == 3

    checkpointer = ocp.StandardCheckpointer()
    checkpointer.save(tmp_path / "ckpt", {"params": params, "opt_state": state})
    checkpointer.wait_until_finished()
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": state})
    restored = checkpointer.restore(tmp_path / "ckpt", abstract)
    checkpointer.close()

    # Restored, not reset: scale, counters, hysteresis state and inner state.
    assert_bitwise_equal(restored, {"params": params, "opt_state": state})
    r = restored["opt_state"]
    assert (
        float(jmp.get_loss_scale(r).loss_scale),
        int(jmp.get_loss_scale(r).counter),
        int(jmp.get_loss_scale(r).overflows),
    ) == (2.0**14, 0, 1)
    assert (int(r.notfinite_count), int(r.total_notfinite)) == (2, 3)
    for bad in (False, True):
        p_bad = poison(0, [0] if bad else [])
        expected = step(params, state, x[6], y[6], p_bad)
        got = step(restored["params"], r, x[6], y[6], p_bad)
        assert_bitwise_equal(got, expected)


# --- NoOpLossScale adds only the check and the select ------------------------------


def primitives(jaxpr, out=None):
    out = set() if out is None else out
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            primitives(sub, out)
    return out


def test_noop_adds_only_the_finiteness_check_and_select(strict):
    params = {"w": jnp.ones(4), "b": jnp.ones(2, jnp.bfloat16)}
    inner = optax.sgd(0.1)
    inner_prims = primitives(jax.make_jaxpr(inner.update)(params, inner.init(params), params).jaxpr)

    def wrapped_prims(ls):
        tx = jmp.loss_scaled(inner, ls)
        return primitives(jax.make_jaxpr(tx.update)(params, tx.init(params), params).jaxpr)

    noop = wrapped_prims(jmp.NoOpLossScale())
    assert "div" not in noop
    assert noop - inner_prims <= {
        "is_finite",
        "reduce_and",
        "stack",
        "and",
        "not",
        "select_n",
        "broadcast_in_dim",
        "convert_element_type",
        "add",
        "mul",
        "max",  # the counters saturate at int32's maximum
    }
    assert "div" in wrapped_prims(jmp.StaticLossScale(8.0))  # the check can fail

    tx = jmp.loss_scaled(inner, jmp.NoOpLossScale())
    state = tx.init(params)
    updates, state = jax.jit(tx.update)(
        {"w": jnp.array([1.0, jnp.nan, 0.0, 0.0]), "b": jnp.ones(2, jnp.bfloat16)}, state, params
    )
    assert_bitwise_equal(optax.apply_updates(params, updates), params)
    assert int(state.total_notfinite) == 1
    # Finite steps: exactly the inner update, bfloat16 gradients left as they are.
    grads = {"w": jnp.arange(4.0), "b": jnp.ones(2, jnp.bfloat16)}
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert_bitwise_equal(updates, inner.update(grads, inner.init(params), params)[0])


# --- Scales below 1: unscaling itself can overflow ---------------------------------

BIG = 3e38  # finite in float32; divided by 0.5 it is not


@pytest.mark.parametrize(
    "loss_scale",
    [jmp.StaticLossScale(0.5), jmp.DynamicLossScale(0.5, min_loss_scale=0.25)],
    ids=["static", "dynamic"],
)
@pytest.mark.parametrize("leaf", ["real", "complex"])
def test_gradient_that_overflows_when_unscaled_is_skipped(loss_scale, leaf, strict):
    # A scale below 1 is the one case where finite gradients unscale to
    # non-finite ones: the check must read the unscaled gradients.
    big = jnp.float32(BIG) if leaf == "real" else jnp.complex64(1 + BIG * 1j)
    dtype = jnp.float32 if leaf == "real" else jnp.complex64
    params = {"w": jnp.ones(3, dtype), "b": jnp.ones(2, jnp.float32)}
    tx = jmp.loss_scaled(optax.sgd(0.1, momentum=0.9), loss_scale)
    state = tx.init(params)
    step = jax.jit(tx.update)
    # A finite step first, so that the momentum is not zero.
    grads = {"w": jnp.full(3, 0.25, dtype), "b": jnp.full(2, 0.25, jnp.float32)}
    _, state = step(grads, state, params)
    overflowing = {"w": grads["w"].at[1].set(big), "b": grads["b"]}
    updates, new_state = step(overflowing, state, params)
    assert int(new_state.total_notfinite) == 1
    assert all(bool(jnp.all(u == 0)) for u in jax.tree.leaves(updates))
    for a, b in zip(jax.tree.leaves(new_state.inner_state), jax.tree.leaves(state.inner_state)):
        np.testing.assert_array_equal(a, b)
    # Half the size fits after unscaling: applied.
    fitting = {"w": grads["w"].at[1].set(big * float(loss_scale.loss_scale) / 2), "b": grads["b"]}
    _, fit_state = step(fitting, state, params)
    assert int(fit_state.total_notfinite) == 0


# --- Half-precision parameters -------------------------------------------------------


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    ("inner", "loss_scale"),
    [
        (optax.adam(1e-2), jmp.DynamicLossScale(2.0**10)),
        (optax.sgd(0.1, momentum=0.9), jmp.StaticLossScale(2.0**10)),
    ],
    ids=["adam-dynamic", "sgd-static"],
)
def test_half_parameters_keep_their_state_dtypes(dtype, inner, loss_scale):
    # Unscaled gradients are float32; the optimizer state stays in the dtype
    # optax created it in (the parameters'), on taken and on skipped steps.
    params = {"w": jnp.ones(4, dtype), "b": jnp.zeros(2, dtype)}
    tx = jmp.loss_scaled(inner, loss_scale)
    state = tx.init(params)
    dtypes = jax.tree.map(lambda x: x.dtype, state.inner_state)
    step = jax.jit(tx.update)
    grads = {"w": jnp.full(4, 2.0**8, dtype), "b": jnp.full(2, -(2.0**8), dtype)}  # scaled by 2^10
    updates, state = step(grads, state, params)
    assert jax.tree.map(lambda x: x.dtype, state.inner_state) == dtypes
    # Updates in the gradients' dtype, as without the wrapper: Equinox's
    # `apply_updates` (p + u) would otherwise make the parameters float32.
    assert {x.dtype for x in jax.tree.leaves(updates)} == {np.dtype(dtype)}
    params = optax.apply_updates(params, updates)
    assert {x.dtype for x in jax.tree.leaves(params)} == {np.dtype(dtype)}
    assert float(params["w"][0]) < 1.0 and float(params["b"][0]) > 0.0
    bad = {"w": grads["w"].at[0].set(jnp.nan), "b": grads["b"]}
    skipped_updates, skipped = step(bad, state, params)
    assert int(skipped.total_notfinite) == 1
    for a, b in zip(jax.tree.leaves(skipped.inner_state), jax.tree.leaves(state.inner_state)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        assert a.dtype == b.dtype
    after = optax.apply_updates(params, skipped_updates)
    for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# --- Which counter counts applied steps ---------------------------------------------


def test_applied_steps_drive_schedules_and_train_state_step():
    """The inner optimizer's count (and a schedule on it) counts applied steps
    only; flax's `TrainState.step` counts every call unless the skipped step is
    taken back off, as the README shows; `total_notfinite` counts the skips."""
    from flax.training import train_state

    schedule = optax.linear_schedule(1.0, 0.0, transition_steps=10)
    tx = jmp.loss_scaled(
        optax.chain(optax.scale_by_schedule(schedule), optax.scale(-1.0)),
        jmp.DynamicLossScale(jnp.float32(4.0)),
    )
    params = {"w": jnp.zeros(2)}

    def make(keep_applied):
        @jax.jit
        def step(state, g):
            new = state.apply_gradients(grads=jmp.get_loss_scale(state.opt_state).scale(g))
            if keep_applied:
                skipped = new.opt_state.total_notfinite - state.opt_state.total_notfinite
                new = new.replace(step=new.step - skipped)
            return new

        return step

    grads = [1.0, jnp.nan, 1.0, jnp.inf, jnp.nan, 1.0]  # 3 applied, 3 skipped
    for keep_applied in (False, True):
        state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        step, seen = make(keep_applied), []
        for g in grads:
            state = step(state, {"w": jnp.full(2, g)})
            count = state.opt_state.inner_state[0].count  # scale_by_schedule's
            seen.append((int(state.step), int(count), int(state.opt_state.total_notfinite)))
        applied = [1, 1, 2, 2, 2, 3]
        skipped = [0, 1, 1, 2, 3, 3]
        assert [c for _, c, _ in seen] == applied
        assert [t for _, _, t in seen] == skipped
        if keep_applied:
            assert [s for s, _, _ in seen] == applied
        else:
            assert [s for s, _, _ in seen] == [1, 2, 3, 4, 5, 6]
            assert [s - t for s, _, t in seen] == applied
        # The schedule advanced once per applied step: -(1.0 + 0.9 + 0.8).
        assert float(state.params["w"][0]) == pytest.approx(-2.7)
