"""optax's `apply_if_finite` tests, ported to `loss_scaled`.

From optax 0.2.8's `optax/transforms/_conditionality_test.py`
(`ConditionalityTest`), kept step for step where `loss_scaled` is meant to
behave as `apply_if_finite`: a finite step is the inner update, a non-finite
step leaves the parameters and the inner state unchanged, `notfinite_count`
counts the non-finite steps in a row and `total_notfinite` all of them.

Where the two differ on purpose, the port asserts `loss_scaled`'s behaviour:

* `apply_if_finite(inner, max_consecutive_errors)` applies the non-finite
  update once the count reaches its limit (its tests end with a NaN in the
  parameters); `loss_scaled` never applies one (a NaN in the weights cannot
  be undone; the loss scale is what changes).
* `ApplyIfFiniteState.last_finite` has no field in `LossScaledState`: it is
  `notfinite_count == 0`.

Each test runs with `NoOpLossScale` (the gradients as optax's test makes
them) and with `DynamicLossScale`, on gradients of the scaled loss.
"""

import jax
import jax.numpy as jnp
import optax
import pytest

import jmp_policy as jmp

LOSS_SCALES = {
    "noop": jmp.NoOpLossScale(),
    "dynamic": jmp.DynamicLossScale(jnp.float32(2.0**4)),
}


def _build_sgd():
    return optax.sgd(1.0)


def _build_stateful_sgd():
    # As optax's: momentum 0.0 rather than None, so that a momentum state exists.
    return optax.sgd(1.0, momentum=0.0)


def _build_sgd_extra_args():
    def init_fn(params):
        del params
        return {"foo": 1}

    def update_fn(grads, state, params=None, *, foo=None, **extra_args):
        del extra_args, foo, params
        return grads, state

    t = optax.GradientTransformationExtraArgs(init_fn, update_fn)
    return optax.chain(_build_sgd(), t)


def _last_finite(state) -> bool:
    return int(state.notfinite_count) == 0


@pytest.fixture(autouse=True)
def _standard_promotion():
    # optax's own code is not clean under the suite's strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
@pytest.mark.parametrize(
    "opt_builder",
    [_build_sgd, _build_stateful_sgd, _build_sgd_extra_args],
    ids=["sgd", "stateful_sgd", "sgd_extra_args"],
)
def test_apply_if_finite(opt_builder, loss_scale):
    one = jnp.array(1.0)
    nan = jnp.array(jnp.nan)

    def fn(p, x):
        return p * x

    params = jnp.array(0.0)
    opt = jmp.loss_scaled(opt_builder(), loss_scale)
    state = opt.init(params)

    # The gradients of the scaled loss, at the current scale (a pytree argument).
    scaled_grad = jax.jit(jax.grad(lambda p, x, scale: scale.scale(fn(p, x))))

    def grads_fn(p, x):
        return scaled_grad(p, x, jmp.get_loss_scale(state))

    # Do one successful param update
    grads = grads_fn(params, one)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    # Exactly sgd's step in all cases.
    assert float(params) == -1.0
    assert _last_finite(state)
    inner_after_first = state.inner_state
    # Check 2 rejected param updates
    for step in range(2):
        grads = grads_fn(params, nan)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert float(params) == -1.0
        assert not _last_finite(state)
        assert int(state.notfinite_count) == step + 1
        # The inner state is kept as it was (optax's test does not check this).
        same = jax.tree.map(jnp.array_equal, inner_after_first, state.inner_state)
        assert jax.tree.structure(state.inner_state) == jax.tree.structure(inner_after_first)
        assert all(bool(x) for x in jax.tree.leaves(same))
    # Next successful param update
    grads = grads_fn(params, one)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert float(params) == -2.0
    assert _last_finite(state)
    # Again 2 rejected param updates
    for step in range(2):
        grads = grads_fn(params, nan)
        updates, state = opt.update(grads, state, params)
        params = optax.apply_updates(params, updates)
        assert float(params) == -2.0
        assert not _last_finite(state)
        assert int(state.notfinite_count) == step + 1
    # apply_if_finite(..., 2) would now apply the NaN update; loss_scaled never does.
    grads = grads_fn(params, nan)
    updates, state = opt.update(grads, state, params)
    params = optax.apply_updates(params, updates)
    assert float(params) == -2.0
    assert int(state.notfinite_count) == 3
    assert int(state.total_notfinite) == 5


@pytest.mark.parametrize("loss_scale", LOSS_SCALES.values(), ids=LOSS_SCALES.keys())
def test_apply_if_finite_pmap(loss_scale):
    # As in optax's test:
    # * pmap is applied to the gradient computation and the optimization;
    # * the NaNs are caused inside the function and do not come from the inputs.
    half = jnp.ones([1]) / 2.0
    two = jnp.ones([1]) * 2.0  # Causes a NaN in arctanh

    def fn(p, x):
        return jnp.arctanh(x) * p

    opt = jmp.loss_scaled(optax.sgd(1.0), loss_scale)

    def fn_update(params, opt_state, x):
        scale = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: scale.scale(fn(p, x)))(params)
        grads = jax.lax.psum(grads, axis_name="i")
        updates, new_opt_state = opt.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        return new_params, new_opt_state

    fn_update = jax.pmap(fn_update, axis_name="i")

    params = jnp.array(0.0)
    opt_state = opt.init(params)
    params = jax.tree.map(lambda x: x[None], params)
    opt_state = jax.tree.map(lambda x: x[None], opt_state)
    # Do one successful param update
    params, opt_state = fn_update(params, opt_state, half)
    assert opt_state.notfinite_count.item() == 0
    assert float(params[0]) == pytest.approx(-float(jnp.arctanh(0.5)))
    # Check 2 rejected param updates
    for step in range(2):
        params, opt_state = fn_update(params, opt_state, two)
        assert opt_state.notfinite_count.item() == step + 1
    # Next successful param update
    params, opt_state = fn_update(params, opt_state, half)
    assert opt_state.notfinite_count.item() == 0
    # Again 2 rejected param updates
    for step in range(2):
        params, opt_state = fn_update(params, opt_state, two)
        assert opt_state.notfinite_count.item() == step + 1
    # apply_if_finite would apply this one; loss_scaled skips it too.
    params, opt_state = fn_update(params, opt_state, two)
    assert opt_state.total_notfinite.item() == 5
    assert float(params[0]) == pytest.approx(-2 * float(jnp.arctanh(0.5)))
