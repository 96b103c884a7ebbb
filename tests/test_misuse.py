"""Misuse fails at the call with a clear error (issue points 5-12).

One test per case: the exception type, and a message that names the argument,
the value given and what is accepted.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jmp_policy as jmp
import jmp_policy.nnx as jnnx

INT32_MAX = int(np.iinfo(np.int32).max)
MATMUL = (((1,), (0,)), ((), ()))


def test_period_beyond_int32_is_a_value_error_at_construction():
    """5: a period the int32 counter cannot reach fails at construction, not in `adjust`."""
    with pytest.raises(ValueError) as info:
        jmp.DynamicLossScale(2.0**15, period=int(1e10))
    message = str(info.value)
    assert message.startswith("period ") and "10000000000" in message
    assert str(INT32_MAX) in message
    # The largest accepted period works under jit.
    s = jmp.DynamicLossScale(2.0**15, period=INT32_MAX)
    assert int(jax.jit(lambda s: s.adjust(jnp.asarray(True)))(s).counter) == 1


def test_duplicate_key_in_policy_spec_is_a_value_error():
    """6: a dtype given twice in a spec (jmp: the last silently wins)."""
    spec = "p=f32,c=bf16,params=bf16"
    with pytest.raises(ValueError) as info:
        jmp.get_policy(spec)
    message = str(info.value)
    assert "policy spec" in message and repr(spec) in message
    assert "'params'" in message and "'p=f32'" in message  # both parts named


def test_misspelt_primitive_name_is_a_value_error_with_close_matches():
    """7: a misspelt name in a primitive list would silently match nothing."""
    with pytest.raises(ValueError) as info:
        jmp.autocast(
            jnp.tanh, "mixed_bfloat16", float32_primitives=jmp.FLOAT32_PRIMITIVES | {"tahn"}
        )
    message = str(info.value)
    assert "float32_primitives" in message and "'tahn'" in message and "'tanh'" in message
    # Every name of jax.extend.core.primitives and of the default lists is accepted.
    prims = vars(jax.extend.core.primitives).values()
    everything = {p.name for p in prims if isinstance(p, jax.extend.core.Primitive)}
    jmp.autocast(jnp.tanh, "mixed_bfloat16", promote_primitives=everything | jmp.PROMOTE_PRIMITIVES)


def test_plain_optax_state_in_loss_scaled_update_is_a_type_error():
    """8: the inner optimizer's state passed to `loss_scaled(...).update`."""
    params = {"w": jnp.ones(2)}
    inner = optax.sgd(0.1)
    tx = jmp.loss_scaled(inner, jmp.NoOpLossScale())
    with pytest.raises(TypeError) as info:
        tx.update(params, inner.init(params), params)
    message = str(info.value)
    assert "state must be the LossScaledState" in message and "got a tuple" in message


def test_rules_typo_on_a_leaf_nnx_module_says_it_has_no_submodules():
    """9: a path pattern on a module without submodules (was: 'such as []')."""
    model = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError) as info:
        jnnx.with_policy(model, "mixed_bfloat16", rules={"kernal": "f32"})
    message = str(info.value)
    assert "rules path pattern 'kernal'" in message and "[]" not in message
    assert "Linear has no submodules" in message and "{Linear: policy}" in message


@pytest.mark.parametrize("tree", ["abc", {"w": jnp.ones(2), "name": "layer"}, [object()]])
def test_all_finite_of_a_non_array_leaf_is_a_type_error(tree):
    """10: `all_finite("abc")` returned True."""
    with pytest.raises(TypeError) as info:
        jmp.all_finite(tree)
    message = str(info.value)
    assert "leaf of tree must be an array or a number" in message
    bad = next(x for x in jax.tree.leaves(tree) if not isinstance(x, jax.Array))
    assert repr(bad) in message


def test_half_dot_general_shape_mismatch_names_the_dimensions():
    """11: contracting sizes that differ, reported as lax.dot_general reports them."""
    with pytest.raises(TypeError) as info:
        jmp.half_dot_general(jnp.ones((2, 2)), jnp.ones((3, 2)), MATMUL)
    message = str(info.value)
    assert message.startswith("half_dot_general: lhs of shape (2, 2) and rhs of shape (3, 2)")
    assert "contracting dimensions to have the same shape, got (2,) and (3,)" in message
    with pytest.raises(ValueError, match="half_conv_general_dilated: lhs of shape .* 2 // 1 != 4"):
        jmp.half_conv_general_dilated(jnp.ones((1, 2, 5)), jnp.ones((3, 4, 2)), (1,), "VALID")


def _half_matmul(w):
    return jmp.half_dot_general(jnp.linspace(-1, 1, 6).reshape(2, 3), w, MATMUL)


_autocast_matmul = jmp.autocast(lambda w: jnp.ones((2, 3)) @ w, "mixed_bfloat16")


@pytest.mark.parametrize(
    "fn", [_half_matmul, _autocast_matmul], ids=["half_dot_general", "autocast"]
)
@pytest.mark.parametrize(
    "transform",
    [
        lambda f, w: jax.jvp(f, (w,), (w,)),
        lambda f, w: jax.jacfwd(f)(w),
    ],
    ids=["jvp", "jacfwd"],
)
def test_forward_mode_says_what_to_use_instead(fn, transform):
    """11: forward mode through the custom-VJP matmuls names the way out."""
    w = jnp.ones((3, 2))
    with pytest.raises(TypeError) as info:
        transform(fn, w)
    message = str(info.value)
    assert message.startswith("Forward-mode differentiation (jax.jvp, jax.jacfwd")
    assert "half_dot_general" in message and "jax.grad" in message
    assert "preferred_element_type=jnp.float32" in message
    # Reverse mode works, and the suggested forward-mode replacement does too.
    assert jax.grad(lambda v: fn(v).sum())(w).shape == w.shape

    def plain(v):
        x = jnp.ones((2, 3), jnp.bfloat16)
        v = v.astype(jnp.bfloat16)
        return lax.dot_general(x, v, MATMUL, preferred_element_type=jnp.float32)

    assert jax.jvp(plain, (w,), (w,))[1].dtype == jnp.float32


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_loss_scaled_counters_saturate_at_int32_max(jit):
    """12: the counters stay at 2**31 - 1 instead of wrapping to -2**31."""
    params = {"w": jnp.ones(2)}
    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale())
    state = tx.init(params)._replace(
        notfinite_count=jnp.asarray(INT32_MAX - 1, jnp.int32),
        total_notfinite=jnp.asarray(INT32_MAX - 1, jnp.int32),
    )
    update = jax.jit(tx.update) if jit else tx.update
    nan = {"w": jnp.full(2, jnp.nan)}
    seen = []
    for _ in range(3):
        _, state = update(nan, state, params)
        seen.append((int(state.notfinite_count), int(state.total_notfinite)))
    assert seen == [(INT32_MAX, INT32_MAX)] * 3
    assert state.total_notfinite.dtype == jnp.int32
    _, state = update(params, state, params)  # a finite step restarts the run count only
    assert (int(state.notfinite_count), int(state.total_notfinite)) == (0, INT32_MAX)


def test_forward_over_reverse_works():
    """Forward mode over reverse mode (`jax.hessian`) differentiates the custom
    VJP's forward and backward functions, which JAX supports: no error, and
    the Hessian of a quadratic agrees with float32's up to bfloat16 rounding."""
    x = jnp.linspace(-1, 1, 6).reshape(2, 3)
    w = jnp.full((3, 2), 0.5)
    ours = jax.jit(jax.hessian(lambda v: (jmp.half_dot_general(x, v, MATMUL) ** 2).sum()))(w)
    exact = jax.hessian(lambda v: ((x @ v) ** 2).sum())(w)
    np.testing.assert_allclose(ours, exact, atol=2**-7 * 2)


def test_deepminds_jmp_policy_is_named_as_another_librarys_with_the_way_over():
    real_jmp = pytest.importorskip("jmp")
    theirs = real_jmp.get_policy("params=float32,compute=bfloat16,output=float32")
    for call, name in [
        (lambda: jmp.get_policy(theirs), "policy_name"),
        (lambda: jmp.autocast(lambda x: x, theirs), "policy"),
        (lambda: jmp.with_policy(lambda x: x, theirs), "policy"),
        (lambda: jnnx.PolicyModule(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), theirs), "policy"),
    ]:
        with pytest.raises(
            TypeError, match=rf"^{name} must be .* \(a jmp\.Policy, another library"
        ):
            call()
    same = jmp.Policy(theirs.param_dtype, theirs.compute_dtype, theirs.output_dtype)
    assert same == jmp.get_policy("p=f32,c=bf16,o=f32")
    with pytest.raises(TypeError, match="^policy must be a policy spec string.*got 3"):
        jmp.autocast(lambda x: x, 3)


def test_a_linen_module_itself_is_refused_for_its_apply():
    import flax.linen as nn

    with pytest.raises(
        TypeError, match=r"got the module Dense itself; .*with_policy\(model\.apply"
    ):
        jmp.with_policy(nn.Dense(3), "mixed_bfloat16")
