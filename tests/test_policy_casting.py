"""Tests of a policy's pytree casts (`cast_to_compute`, `cast_to_param`,
`cast_to_output`, `cast_to_half`, `cast_to_full`): the floating leaves
change, the leaves that must pass through (integers, keys, non-arrays) do
not, matching leaves are not converted, nested trees keep their structure.
Split from `test_policy.py` (the spec grammar and `Policy` values).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jmp
from jmp_policy import Policy

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
FLOATS = (BF16, F16, F32, F64)
JAX_FLOATS = (BF16, F16, F32)  # x64 is off: jax arrays cannot hold float64.


def half() -> np.dtype:
    """The half dtype the backend should get (jmp: bfloat16 on TPU only)."""
    return BF16 if jax.devices()[0].platform == "tpu" else F16


# --------------------------------------------------------------------------
# Casting: floating leaves
# --------------------------------------------------------------------------

# Each method of this policy targets a different dtype, so a method that used
# the wrong field would be caught.
POLICY = Policy(F32, BF16, F16)
METHODS = {"cast_to_param": F32, "cast_to_compute": BF16, "cast_to_output": F16}
VALUES = [0.5, -2.0, 3.0, 0.0]  # Exact in every float dtype.


def _assert_values(out):
    np.testing.assert_array_equal(np.asarray(out).astype(np.float32), np.float32(VALUES))


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("src", JAX_FLOATS, ids=str)
def test_cast_jax_float_array(src, method, jit):
    """Jax float arrays are cast to the method's dtype, eager and under jit."""
    x = jnp.asarray(VALUES, dtype=src)
    fn = getattr(POLICY, method)
    out = (jax.jit(fn) if jit else fn)(x)
    assert isinstance(out, jax.Array)
    assert out.dtype == METHODS[method]
    _assert_values(out)


@pytest.mark.parametrize("jit", [False, True])
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_cast_numpy_float_array(src, method, jit):
    """Numpy float arrays (f64 included) are cast and stay numpy arrays; under
    jit a numpy float argument is a tracer and is cast like one."""
    x = np.asarray(VALUES, dtype=src)
    out = (jax.jit(getattr(POLICY, method)) if jit else getattr(POLICY, method))(x)
    assert isinstance(out, jax.Array) if jit else type(out) is np.ndarray
    assert out.dtype == METHODS[method]
    _assert_values(out)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("src", FLOATS, ids=str)
def test_cast_numpy_float_scalar(src, method):
    """Numpy float scalars are left alone (not arrays), as jmp leaves them."""
    x = np.asarray(1.5, dtype=src)[()]
    assert isinstance(x, np.generic)
    assert getattr(POLICY, method)(x) is x


def test_cast_to_float64_numpy():
    """A float64 target is honoured for numpy leaves (x64 does not apply to numpy)."""
    policy = Policy(F64, F64, F64)
    out = policy.cast_to_compute({"a": np.ones(2, F32), "s": np.ones((), F16)})
    assert out["a"].dtype == F64 and type(out["a"]) is np.ndarray
    assert out["s"].dtype == F64 and type(out["s"]) is np.ndarray


# --------------------------------------------------------------------------
# Casting: leaves that must pass through
# --------------------------------------------------------------------------


def _pass_through_leaves() -> dict[str, Any]:
    return {
        "jax_int32": jnp.arange(3, dtype=jnp.int32),
        "jax_uint8": jnp.arange(3, dtype=jnp.uint8),
        "jax_bool": jnp.array([True, False]),
        "jax_complex": jnp.ones(2, jnp.complex64),
        "np_int64": np.arange(3, dtype=np.int64),
        "np_bool": np.array([True, False]),
        "np_complex": np.ones(2, np.complex128),
        "np_int_scalar": np.int32(7),
        "typed_key": jax.random.key(0),
        "raw_key": jax.random.PRNGKey(0),
    }


@pytest.mark.parametrize("method", [*METHODS, "cast_to_half", "cast_to_full"])
@pytest.mark.parametrize("name", list(_pass_through_leaves()))
def test_non_float_array_leaves_unchanged_eager(name, method):
    """Int, bool, complex arrays and PRNG keys (typed and raw) are returned as is."""
    x = _pass_through_leaves()[name]
    fn = getattr(POLICY, method) if method in METHODS else getattr(jmp, method)
    assert fn(x) is x
    assert fn({"leaf": x})["leaf"] is x


@pytest.mark.parametrize("method", METHODS)
def test_non_float_array_leaves_unchanged_under_jit(method):
    """Under jit, non-float leaves keep dtype and value (keys stay keys)."""
    leaves = _pass_through_leaves()
    leaves.pop("np_complex")  # complex128 would be narrowed by jit itself (x64 off).
    out = jax.jit(getattr(POLICY, method))(leaves)
    for name, x in leaves.items():
        y = out[name]
        if name == "typed_key":
            assert jax.dtypes.issubdtype(y.dtype, jax.dtypes.prng_key)
            np.testing.assert_array_equal(jax.random.key_data(y), jax.random.key_data(x))
        else:
            expected = np.asarray(x).dtype
            if expected == np.int64:
                expected = np.dtype(np.int32)  # jit's own x64-off narrowing.
            assert y.dtype == expected, name
            np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


class _Opaque:
    pass


def _python_leaves() -> dict[str, Any]:
    return {
        "float": 1.5,
        "int": 3,
        "bool": True,
        "complex": 1j,
        "str": "text",
        "object": _Opaque(),
        "dtype_class": jnp.float32,
    }


@pytest.mark.parametrize("method", [*METHODS, "cast_to_half", "cast_to_full"])
def test_python_scalars_and_objects_unchanged_eager(method):
    """Python scalars, strings and arbitrary objects pass through by identity."""
    fn = getattr(POLICY, method) if method in METHODS else getattr(jmp, method)
    tree = _python_leaves()
    out = fn(tree)
    assert out.keys() == tree.keys()
    for name, x in tree.items():
        assert out[name] is x, name
        assert fn(x) is x, name
    assert fn(None) is None
    assert fn({"a": None, "b": [None]}) == {"a": None, "b": [None]}


@pytest.mark.parametrize("method", METHODS)
def test_python_scalars_and_objects_unchanged_under_jit(method):
    """Inside a jitted function, Python leaves closed over are still left alone."""
    tree = dict(_python_leaves(), none=None)
    seen = {}

    @jax.jit
    def f(x):
        out = getattr(POLICY, method)(dict(tree, x=x))
        seen.update(out)
        return out["x"]

    assert f(jnp.ones(2, F32)).dtype == METHODS[method]
    for name, x in tree.items():
        assert seen[name] is x, name


# --------------------------------------------------------------------------
# Casting: matching leaves are not converted
# --------------------------------------------------------------------------


def _convert_eqns(fn, tree):
    jaxpr = jax.make_jaxpr(fn)(tree).jaxpr
    return [e for e in jaxpr.eqns if e.primitive.name == "convert_element_type"]


@pytest.mark.parametrize("method", METHODS)
def test_no_convert_when_dtypes_match(method):
    """A tree already in the target dtype traces to a program with no convert op."""
    target = METHODS[method]
    tree = {
        "jax": jnp.ones((2, 3), target),
        "np": np.ones(4, target),
        "list": [jnp.zeros(1, target), jnp.arange(2)],
        "key": jax.random.key(1),
        "bool": jnp.array(True),
    }
    assert _convert_eqns(getattr(POLICY, method), tree) == []


@pytest.mark.parametrize("target", JAX_FLOATS, ids=str)
def test_one_convert_per_leaf_needing_a_cast(target):
    """Exactly one convert op per float leaf whose dtype differs from the target."""
    policy = Policy(F32, target, F32)
    tree = {
        "f": [jnp.ones(2, d) for d in JAX_FLOATS],
        "np": np.ones(3, F32),
        "i": jnp.arange(2),
        "key": jax.random.PRNGKey(0),
    }
    needing = sum(d != target for d in JAX_FLOATS) + (F32 != target)
    eqns = _convert_eqns(policy.cast_to_compute, tree)
    assert len(eqns) == needing
    assert all(e.outvars[0].aval.dtype == target for e in eqns)


@pytest.mark.parametrize("method", METHODS)
def test_matching_eager_array_is_same_object(method):
    """A jax array or numpy scalar already in the target dtype is returned as is;
    a numpy array, mutable, as a copy (as jmp's `astype` gives)."""
    target = METHODS[method]
    fn = getattr(POLICY, method)
    for x in (jnp.ones(3, target), np.ones((), target)[()]):
        assert fn(x) is x
        assert fn([x])[0] is x
    x = np.ones(3, target)
    assert fn(x) is not x and fn(x).dtype == target and (fn(x) == x).all()


# --------------------------------------------------------------------------
# Casting: nested trees
# --------------------------------------------------------------------------


class Batch(NamedTuple):
    image: Any
    label: Any
    meta: Any


def _nested_tree():
    return {
        "params": {"w": jnp.ones((2, 2), F32), "b": np.zeros(2, F16)},
        "batch": Batch(
            image=jnp.full((1, 2), 0.5, BF16),
            label=jnp.arange(1),
            meta=(1.5, None, np.float64(2.0)),
        ),
        "steps": [np.int32(3), jax.random.key(0), [jnp.zeros(1, F16)]],
    }


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("method", METHODS)
def test_nested_mixed_tree(method, jit):
    """Dicts, lists, tuples and NamedTuples keep their structure; only floats change."""
    tree = _nested_tree()
    fn = getattr(POLICY, method)
    if jit:
        # Python scalars cannot be jit arguments; keep them static via closure.
        meta = tree["batch"].meta
        stripped = {**tree, "batch": tree["batch"]._replace(meta=None)}

        @jax.jit
        def fj(t):
            t = {**t, "batch": t["batch"]._replace(meta=meta)}
            out = fn(t)
            return {**out, "batch": out["batch"]._replace(meta=out["batch"].meta[2])}

        out = fj(stripped)
        meta_out = out["batch"].meta
        assert float(meta_out) == 2.0  # the numpy scalar was left alone
    else:
        out = fn(tree)
        assert jax.tree.structure(out) == jax.tree.structure(tree)
        assert out["batch"].meta[0] == 1.5 and out["batch"].meta[1] is None
        assert out["batch"].meta[2] is tree["batch"].meta[2]  # numpy scalar: left alone
        assert out["steps"][0] is tree["steps"][0]
        assert type(out["params"]["b"]) is np.ndarray
    target = METHODS[method]
    assert isinstance(out["batch"], Batch)
    assert out["params"]["w"].dtype == target
    assert out["params"]["b"].dtype == target
    assert out["batch"].image.dtype == target
    assert out["batch"].label.dtype == jnp.int32
    assert out["steps"][2][0].dtype == target
    assert jax.dtypes.issubdtype(out["steps"][1].dtype, jax.dtypes.prng_key)


# --------------------------------------------------------------------------
# cast_to_half / cast_to_full
# --------------------------------------------------------------------------


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_cast_to_half_and_full(jit):
    """cast_to_half gives half_dtype(), cast_to_full float32; non-floats untouched."""
    tree = {
        "f32": jnp.asarray(VALUES, F32),
        "bf16": jnp.asarray(VALUES, BF16),
        "f16": jnp.asarray(VALUES, F16),
        "i": jnp.arange(4),
        "np": np.asarray(VALUES, F64),
    }
    to_half = jax.jit(jmp.cast_to_half) if jit else jmp.cast_to_half
    to_full = jax.jit(jmp.cast_to_full) if jit else jmp.cast_to_full
    halves, fulls = to_half(tree), to_full(tree)
    for name in ("f32", "bf16", "f16", "np"):
        assert halves[name].dtype == half(), name
        assert fulls[name].dtype == F32, name
        _assert_values(halves[name])
        _assert_values(fulls[name])
    assert halves["i"].dtype == fulls["i"].dtype == jnp.int32
    if not jit:
        assert type(halves["np"]) is np.ndarray and type(fulls["np"]) is np.ndarray
        assert halves["i"] is tree["i"] and fulls["f32"] is tree["f32"]
        assert halves["f16"] is tree["f16"]


def test_cast_to_full_no_convert_for_float32():
    """cast_to_full/half add a convert op only for leaves not already in their dtype."""
    assert _convert_eqns(jmp.cast_to_full, [jnp.ones(2, F32), jnp.arange(2)]) == []
    assert len(_convert_eqns(jmp.cast_to_half, [jnp.ones(2, F32), jnp.ones(2, half())])) == 1
