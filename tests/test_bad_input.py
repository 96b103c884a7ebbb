"""Bad input to the public API: a clear `TypeError`/`ValueError` naming the
argument and what is accepted, and nothing half-applied (a failed call leaves
the state, the policy and the model as they were); and property tests of
casting over random mixed pytrees (exactly the floating leaves change).
Split from `test_reliability.py`, the silent failures.
"""

from __future__ import annotations

import dataclasses
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

import jmp_policy as jmp
import jmp_policy.nnx as jnnx
from jmp_policy import Policy

from helpers import assert_bitwise_equal

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32, 2**-126
F32_MAX = float(np.finfo(np.float32).max)


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
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 16)), jnp.float32), "b": jnp.zeros(16)}
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
        lambda: tx.update({"w": grads["w"]}, state, params),  # a wrong grads tree
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
