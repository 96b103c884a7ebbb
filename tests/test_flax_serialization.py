"""Loss scales and `loss_scaled`'s state in Flax checkpoints (`flax.serialization`).

Flax's own `DynamicScale` round-trips through `to_bytes`/`from_bytes`; the
`loss_scaled` state that replaces it must too, inside a `TrainState`, whether
Flax was imported before jmp_policy or after it.
"""

import pathlib
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import serialization
from flax.training import train_state

import jmp_policy as jmp

ROOT = pathlib.Path(__file__).resolve().parent.parent

LOSS_SCALES = {
    "dynamic": lambda: jmp.DynamicLossScale(2.0**15, period=2),
    "hysteresis": lambda: jmp.DynamicLossScale(2.0**15, period=3, hysteresis=2, min_loss_scale=4.0),
    "static": lambda: jmp.StaticLossScale(128.0),
    "noop": jmp.NoOpLossScale,
}


def _trained(loss_scale) -> train_state.TrainState:
    """A TrainState after four steps, one non-finite: scale and counters moved."""
    params = {"w": jnp.full((3, 2), 0.5), "b": jnp.zeros(2)}
    tx = jmp.loss_scaled(optax.sgd(1e-2, momentum=0.9), loss_scale)
    state = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
    step = jax.jit(lambda s, g: s.apply_gradients(grads=g))
    for value in (1.0, np.inf, 2.0, 3.0):
        state = step(state, jax.tree.map(lambda p: jnp.full_like(p, value), params))
    return state


def _bits(tree):
    return [(np.asarray(x).dtype, np.asarray(x).tobytes()) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize("kind", LOSS_SCALES)
def test_train_state_round_trips_through_to_bytes(kind):
    state = _trained(LOSS_SCALES[kind]())
    fresh = train_state.TrainState.create(
        apply_fn=None, params=jax.tree.map(jnp.zeros_like, state.params), tx=state.tx
    )
    restored = serialization.from_bytes(fresh, serialization.to_bytes(state))
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    assert _bits(restored) == _bits(state)
    scale, saved = jmp.get_loss_scale(restored.opt_state), jmp.get_loss_scale(state.opt_state)
    assert type(scale) is type(saved)
    if kind in ("static", "noop"):  # No leaves: the hyperparameters are the target's.
        assert scale == saved
    assert int(restored.opt_state.total_notfinite) == 1
    # The restored state trains on as the original does.
    grads = jax.tree.map(jnp.ones_like, state.params)
    assert _bits(restored.apply_gradients(grads=grads)) == _bits(state.apply_gradients(grads=grads))


def test_state_dict_holds_the_leaves_by_name():
    state = _trained(LOSS_SCALES["hysteresis"]())
    scale = jmp.get_loss_scale(state.opt_state)
    as_dict = serialization.to_state_dict(scale)
    assert sorted(as_dict) == ["counter", "loss_scale", "overflows"]
    back = serialization.from_state_dict(jmp.DynamicLossScale(1.0, period=3, hysteresis=2), as_dict)
    assert _bits(back) == _bits(scale) and (back.period, back.hysteresis) == (3, 2)
    assert serialization.to_state_dict(jmp.StaticLossScale(8.0)) == {}
    assert serialization.to_state_dict(jmp.NoOpLossScale()) == {}
    # loss_scaled's own state, as `to_state_dict`/`from_state_dict` see it.
    opt_state = state.opt_state
    as_dict = serialization.to_state_dict(opt_state)
    assert sorted(as_dict) == ["inner_state", "loss_scale", "notfinite_count", "total_notfinite"]
    back = serialization.from_state_dict(state.tx.init(state.params), as_dict)
    assert type(back) is jmp.LossScaledState and _bits(back) == _bits(opt_state)


def test_restoring_into_a_target_of_another_shape_names_the_fields():
    saved = serialization.to_state_dict(jmp.DynamicLossScale(8.0, hysteresis=2))
    with pytest.raises(ValueError, match="overflows"):
        serialization.from_state_dict(jmp.DynamicLossScale(8.0), saved)


@pytest.mark.parametrize("flax_first", [True, False], ids=["flax-first", "jmp-policy-first"])
def test_registered_whichever_is_imported_first(flax_first):
    """In a fresh interpreter: Flax imported before or after jmp_policy, a loss scale
    serializes; importing jmp_policy alone loads no Flax."""
    code = textwrap.dedent(
        f"""
        import sys
        if {flax_first}:
            import flax.serialization
        import jmp_policy
        assert {flax_first} or "flax" not in sys.modules
        import inspect
        from flax import serialization
        inspect.getsource(serialization)  # Flax's module loaded as ever.
        scale = jmp_policy.DynamicLossScale(2.0**10, counter=3)
        back = serialization.from_bytes(scale, serialization.to_bytes(scale))
        print(float(back.loss_scale), int(back.counter))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.split() == ["1024.0", "3"]


@pytest.mark.parametrize(
    "saved, target, bound",
    [
        # A scale that grew to 2^15, restored into a scale capped at 2048.
        ({}, {"max_loss_scale": 2048.0}, "max_loss_scale"),
        # A counter at 15, restored into a scale whose period is 10.
        ({"counter": np.int32(15), "period": 20}, {"period": 10}, "period"),
    ],
)
def test_a_restored_scale_outside_its_targets_bounds_is_refused_at_restore(saved, target, bound):
    data = serialization.to_bytes(jmp.DynamicLossScale(np.float32(2.0**15), **saved))
    into = jmp.DynamicLossScale(np.float32(1.0), **target)
    with pytest.raises(ValueError, match=bound):
        serialization.from_bytes(into, data)
    # Within the bounds, the values come back.
    restored = serialization.from_bytes(jmp.DynamicLossScale(np.float32(1.0), period=20), data)
    assert float(restored.loss_scale) == 2.0**15 and restored.period == 20
