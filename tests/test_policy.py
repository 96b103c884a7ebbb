"""Tests of policies: spec parsing, `Policy` values, and pytree casting.

Grouped like the module: the spec grammar (`get_policy`) and its errors, `Policy`
construction and its value semantics (equality, hashing, `str`, use under
`jax.jit`), and property tests of the grammar against a small independent
reference parser. The casts of every kind of leaf: `test_policy_casting.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jmp_policy as jmp
from jmp_policy import Policy, get_policy

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
FLOATS = (BF16, F16, F32, F64)
JAX_FLOATS = (BF16, F16, F32)  # x64 is off: jax arrays cannot hold float64.

# Spellings of the grammar, written out here rather than read from the module.
DTYPE_NAMES = {
    BF16: ("bf16", "bfloat16"),
    F16: ("f16", "float16"),
    F32: ("full", "f32", "float32"),
    F64: ("f64", "float64"),
}
FIRST_NAME = {BF16: "bf16", F16: "f16", F32: "full", F64: "f64"}
ALL_DTYPE_NAMES = (*itertools.chain.from_iterable(DTYPE_NAMES.values()), "half")
KEY_NAMES = {
    "param_dtype": ("p", "params"),
    "compute_dtype": ("c", "compute"),
    "output_dtype": ("o", "output"),
}
ALL_KEY_NAMES = tuple(itertools.chain.from_iterable(KEY_NAMES.values()))
FIELDS = tuple(KEY_NAMES)
PRESETS = {
    "mixed_bfloat16": (F32, BF16, F32),
    "mixed_float16": (F32, F16, F32),
    "mixed_float8": (F32, BF16, F32),  # and matmul_dtype float8_e4m3fn
    "mixed_float8_rowwise": (F32, BF16, F32),  # FP8 scaled per row
    "mixed_mxfp8": (F32, BF16, F32),  # and the block formats
    "mixed_nvfp4": (F32, BF16, F32),
}

# Other ways users spell each dtype; all must give the same policy.
SPELLINGS = {
    BF16: (jnp.bfloat16, "bfloat16", np.dtype(jnp.bfloat16), jnp.dtype("bfloat16")),
    F16: (np.float16, jnp.float16, "float16", np.dtype("float16"), "e"),
    F32: (np.float32, jnp.float32, "float32", np.dtype("float32"), "f4"),
    F64: (np.float64, jnp.float64, "float64", np.dtype("float64"), float),
}


def half() -> np.dtype:
    """The half dtype the backend should get (jmp: bfloat16 on TPU only)."""
    return BF16 if jax.devices()[0].platform == "tpu" else F16


def dtypes_of(policy: Policy) -> tuple[np.dtype, np.dtype, np.dtype]:
    return (policy.param_dtype, policy.compute_dtype, policy.output_dtype)


def words(message: str) -> set[str]:
    return set(re.findall(r"\w+", message))


# --------------------------------------------------------------------------
# half_dtype
# --------------------------------------------------------------------------


def test_half_dtype_is_float16_off_tpu():
    """half_dtype() is the scalar type jnp.float16 on CPU/GPU (bfloat16 only on TPU), as in jmp."""
    dtype = jmp.half_dtype()
    assert dtype in (jnp.float16, jnp.bfloat16) and np.dtype(dtype) == half()
    if jax.devices()[0].platform == "cpu":
        assert dtype is jnp.float16
    # Callable, as jmp's README uses it: DynamicLossScale(half_dtype()(2 ** 15)).
    assert dtype(2**15).dtype == half()


# --------------------------------------------------------------------------
# get_policy: every accepted spec form
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name,dtype",
    [(n, d) for d, names in DTYPE_NAMES.items() for n in names],
)
def test_bare_dtype_name_sets_all_three(name, dtype):
    """A bare dtype name (any alias) sets params, compute and output."""
    assert dtypes_of(get_policy(name)) == (dtype, dtype, dtype)


def test_bare_half_is_backend_half():
    """'half' resolves to half_dtype() for all three fields."""
    assert dtypes_of(get_policy("half")) == (half(),) * 3
    assert dtypes_of(get_policy("c=half")) == (F32, half(), half())


@pytest.mark.parametrize("preset,expected", PRESETS.items())
def test_presets(preset, expected):
    """The presets expand to p=f32 with half compute and f32 output."""
    assert dtypes_of(get_policy(preset)) == expected
    assert dtypes_of(get_policy(f"  {preset}\t")) == expected


@pytest.mark.parametrize("field,key", [(f, k) for f, keys in KEY_NAMES.items() for k in keys])
def test_every_key_spelling_sets_its_field(field, key):
    """Each key alias (p/params, c/compute, o/output) sets its own field only."""
    others = [f"{KEY_NAMES[f][0]}=f64" for f in FIELDS if f != field]
    policy = get_policy(",".join([f"{key}=bf16", *others]))
    assert dtypes_of(policy) == tuple(BF16 if f == field else F64 for f in FIELDS)


@pytest.mark.parametrize(
    "spec,expected",
    [
        ("c=f16", (F32, F16, F16)),  # params default f32; output follows compute.
        ("p=f16", (F16, F16, F16)),  # compute follows params, output follows compute.
        ("o=bf16", (F32, F32, BF16)),
        ("p=bf16,o=f32", (BF16, BF16, F32)),  # compute follows params.
        ("p=f16,c=bf16", (F16, BF16, BF16)),
        ("c=bf16,o=f32", (F32, BF16, F32)),
        ("params=f64,compute=f16,output=bf16", (F64, F16, BF16)),
        ("o=f16,c=bf16,p=f64", (F64, BF16, F16)),  # order does not matter.
        ("p=full,c=float16", (F32, F16, F16)),
    ],
)
def test_defaults_and_keyed_specs(spec, expected):
    """Params default to f32, compute follows params, output follows compute."""
    assert dtypes_of(get_policy(spec)) == expected


@pytest.mark.parametrize(
    "spec",
    [
        "p = f32, c = bf16, o = f32",
        " p=f32 ,c=bf16 , o=f32 ",
        "p\t=\tf32,\tc= bf16 ,o =f32",
        "params =full ,  compute=  bfloat16,output = float32",
        "\np=f32,\nc=bf16,\no=f32\n",
    ],
)
def test_white_space_around_separators(spec):
    """White space around ',' and '=' (and at the ends) is ignored."""
    assert dtypes_of(get_policy(spec)) == (F32, BF16, F32)


def test_white_space_around_bare_name():
    """A bare dtype name may be padded with white space."""
    assert dtypes_of(get_policy("  bf16 ")) == (BF16,) * 3


@pytest.mark.parametrize("spec", ["c=f16,c=bf16", "p=f32,c=bf16,params=bf16", "o=f16, output=f32"])
def test_repeated_key_is_a_value_error(spec):
    """A dtype given twice is a ValueError naming the spec and both parts (jmp: last wins).

    A deliberate difference from jmp 0.0.4, listed in the README.
    """
    with pytest.raises(ValueError, match="Duplicate key") as info:
        get_policy(spec)
    message = str(info.value)
    assert "policy spec" in message and repr(spec) in message
    assert repr(spec.split(",")[0].strip()) in message  # the part that set it first


def test_get_policy_of_policy_is_identity():
    """get_policy(policy) returns that very policy."""
    policy = Policy(F32, BF16, F16)
    assert get_policy(policy) is policy


def test_get_policy_rejects_non_string():
    """Anything but a str or Policy is a TypeError (as in jmp), not a silent policy."""
    for spec in (None, 3, b"f16", F16):
        with pytest.raises(TypeError):
            get_policy(spec)


# --------------------------------------------------------------------------
# get_policy: errors
# --------------------------------------------------------------------------

_KEYS = "keys"
_DTYPES = "dtypes"


@pytest.mark.parametrize(
    "spec,quoted,lists",
    [
        ("x=f16", "'x'", {_KEYS}),
        ("c=f16,x=f16", "'x'", {_KEYS}),
        ("C=f16", "'C'", {_KEYS}),
        ("c=f17", "'f17'", {_DTYPES}),
        ("c = f16 , o = f17", "'f17'", {_DTYPES}),
        ("compute_float16", "'compute_float16'", {_DTYPES}),
        ("F16", "'F16'", {_DTYPES}),
        ("", "''", {_DTYPES}),
        ("c=f16,,o=f32", "''", {_KEYS, _DTYPES}),
        ("c=f16,", "''", {_KEYS, _DTYPES}),
        ("c==f16", "'c==f16'", {_KEYS, _DTYPES}),
        ("=f16", "'=f16'", {_KEYS, _DTYPES}),
        ("c=f16=", "'c=f16='", {_KEYS, _DTYPES}),
        ("c=", "'c='", {_KEYS, _DTYPES}),
        ("c=f16,bf16", "'bf16'", {_KEYS, _DTYPES}),
        ("mixed_bfloat16,o=f16=", "'o=f16='", {_KEYS, _DTYPES}),
    ],
)
def test_bad_spec_raises_value_error_quoting_the_part(spec, quoted, lists):
    """A bad spec raises ValueError that quotes the bad part and lists what is accepted."""
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    message = str(info.value)
    assert quoted in message
    found = words(message)
    if _KEYS in lists:
        assert set(ALL_KEY_NAMES) <= found, message
    if _DTYPES in lists:
        assert set(ALL_DTYPE_NAMES) <= found, message


@pytest.mark.parametrize("spec", ["c=f17", "compute_float16", "p=f32,c=float8", "half16"])
def test_unknown_dtype_message(spec):
    """jmp compatibility: an unknown dtype's message contains 'Unknown dtype'."""
    with pytest.raises(ValueError, match="Unknown dtype"):
        get_policy(spec)


# --------------------------------------------------------------------------
# Policy construction
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", FLOATS, ids=str)
def test_construction_normalises_every_spelling(dtype):
    """Every spelling of a float dtype is stored as the same JAX scalar type (as jmp's
    get_policy stores it: `jnp.float32`), which is also equal to the `np.dtype`."""
    for spelling in SPELLINGS[dtype]:
        policy = Policy(spelling, spelling, spelling)
        for field in dtypes_of(policy):
            assert field is getattr(jnp, dtype.name)
            assert field == dtype and np.dtype(field) == dtype


_BAD_DTYPES = [
    pytest.param(jnp.int32, id="jnp.int32"),
    pytest.param(np.int8, id="np.int8"),
    pytest.param("int32", id="'int32'"),
    pytest.param(bool, id="bool"),
    pytest.param(jnp.bool_, id="jnp.bool_"),
    pytest.param(np.complex64, id="complex64"),
    pytest.param("not_a_dtype", id="'not_a_dtype'"),
    pytest.param(object(), id="object()"),
    pytest.param(1.5, id="1.5"),
    pytest.param(jax.random.key(0).dtype, id="key-dtype"),
]


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("bad", _BAD_DTYPES)
def test_non_float_dtype_is_type_error_naming_field(field, bad):
    """A non-floating dtype raises TypeError naming the offending field only."""
    kwargs = dict.fromkeys(FIELDS, F32)
    kwargs[field] = bad
    with pytest.raises(TypeError) as info:
        Policy(**kwargs)
    message = str(info.value)
    assert field in message
    assert not any(other in message for other in FIELDS if other != field)


@pytest.mark.parametrize("field", FIELDS)
def test_none_dtype_is_type_error(field):
    """None is not a dtype (np.dtype(None) would silently mean float64)."""
    kwargs = dict.fromkeys(FIELDS, F32)
    kwargs[field] = None
    with pytest.raises(TypeError, match=field):
        Policy(**kwargs)


@pytest.mark.parametrize("bad", ["(f4,2)", (np.float32, -1)], ids=["syntax", "shape"])
def test_malformed_dtype_is_type_error(bad):
    """Whatever np.dtype raises on garbage, Policy raises TypeError naming the field."""
    with pytest.raises(TypeError, match="compute_dtype"):
        Policy(F32, bad, F32)


_OTHER_FLOATS = [
    # longdouble is float64 on some platforms; only the wider one is "other".
    *(
        [pytest.param(np.dtype(np.longdouble), id="longdouble")]
        if np.dtype(np.longdouble) not in FLOATS
        else []
    ),
    pytest.param(np.dtype(">f4"), id="big-endian-f4"),
    pytest.param(np.dtype(jnp.float8_e4m3fn), id="float8_e4m3fn"),
    pytest.param(np.dtype(jnp.float8_e5m2), id="float8_e5m2"),
]


@pytest.mark.parametrize("dtype", _OTHER_FLOATS)
def test_other_float_dtypes_rejected_or_round_trip(dtype):
    """A float dtype outside the grammar is either rejected (TypeError) or prints a
    spec that parses back; it must never give a policy whose str() crashes."""
    try:
        policy = Policy(F32, dtype, F32)
    except TypeError as e:
        assert "compute_dtype" in str(e)
        return
    assert get_policy(str(policy)) == policy


# --------------------------------------------------------------------------
# Policy value semantics: equality, hashing, frozen, str, jit
# --------------------------------------------------------------------------


def test_equal_and_same_hash_across_spellings():
    """Policies built from different dtype spellings are equal and hash equally."""
    dtypes = (F32, BF16, F16)
    policies = [
        Policy(*spellings) for spellings in itertools.product(*(SPELLINGS[d] for d in dtypes))
    ]
    policies.append(get_policy("p=float32, c=bfloat16, o=float16"))
    first = policies[0]
    for policy in policies:
        assert policy == first
        assert hash(policy) == hash(first)
    assert len(set(policies)) == 1
    assert {first: "x"}[Policy("float32", "bfloat16", "float16")] == "x"


def test_different_policies_are_unequal():
    """Equality is by all three fields."""
    base = Policy(F32, BF16, F32)
    assert base != base.with_param_dtype(F16)
    assert base != base.with_compute_dtype(F16)
    assert base != base.with_output_dtype(F16)
    assert base != "p=full,c=bf16,o=full"


@pytest.mark.parametrize("field", FIELDS)
def test_frozen(field):
    """A policy is immutable (so it is safe as a jit static argument)."""
    policy = Policy(F32, BF16, F32)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(policy, field, F16)
    assert dtypes_of(policy) == (F32, BF16, F32)


@pytest.mark.parametrize(
    "policy,expected",
    [
        (Policy(F32, F32, F32), "p=full,c=full,o=full"),
        (Policy(F32, BF16, F32), "p=full,c=bf16,o=full"),
        (Policy(F16, F64, BF16), "p=f16,c=f64,o=bf16"),
        (Policy(np.dtype("float32"), np.dtype("float16"), np.float32), "p=full,c=f16,o=full"),
        (Policy("float64", jnp.bfloat16, jnp.float16), "p=f64,c=bf16,o=f16"),
        (get_policy("mixed_bfloat16"), "p=full,c=bf16,o=full"),
    ],
)
def test_str_prints_jmp_first_names(policy, expected):
    """str() uses jmp's first name of each dtype: full, bf16, f16, f64."""
    assert str(policy) == expected


@pytest.mark.parametrize("dtypes", list(itertools.product(FLOATS, repeat=3)), ids=str)
def test_str_round_trips_for_every_combination(dtypes):
    """get_policy(str(p)) == p for all 64 combinations, whatever the dtype spelling."""
    spelled = [dtypes, *(tuple(SPELLINGS[d][i] for d in dtypes) for i in (0, 2))]
    for spellings in spelled:
        policy = Policy(*spellings)
        text = str(policy)
        assert text == "p={},c={},o={}".format(*(FIRST_NAME[d] for d in dtypes))
        again = get_policy(text)
        assert again == policy and hash(again) == hash(policy)
        assert dtypes_of(again) == dtypes


def test_static_jit_argument_shares_one_trace():
    """A policy works as a jit static argument; equal policies share one trace."""
    traces = []

    @functools.partial(jax.jit, static_argnums=1)
    def f(x, policy):
        traces.append(policy)
        return policy.cast_to_output(policy.cast_to_compute(x) * 2)

    x = jnp.ones(3, jnp.float32)
    outs = [
        f(x, Policy(np.float32, jnp.bfloat16, "float32")),
        f(x, Policy(np.dtype("float32"), "bfloat16", jnp.float32)),
        f(x, get_policy("mixed_bfloat16")),
        f(x, get_policy(" p = f32 , c = bfloat16 ")).astype(F32),  # o=bf16: new trace
    ]
    assert len(traces) == 2
    assert [o.dtype for o in outs[:3]] == [F32] * 3
    f(x, get_policy("mixed_bfloat16"))
    assert len(traces) == 2
    f(x, get_policy("mixed_float16"))
    assert len(traces) == 3
    np.testing.assert_array_equal(np.asarray(outs[0]), np.full(3, 2.0, np.float32))


# --------------------------------------------------------------------------
# with_param_dtype / with_compute_dtype / with_output_dtype
# --------------------------------------------------------------------------

_WITH = {
    "param_dtype": "with_param_dtype",
    "compute_dtype": "with_compute_dtype",
    "output_dtype": "with_output_dtype",
}


@pytest.mark.parametrize("field", FIELDS)
@pytest.mark.parametrize("spelling", [jnp.float16, "float16", np.dtype("float16")], ids=str)
def test_with_dtype_replaces_one_field(field, spelling):
    """with_X_dtype returns a new, normalised policy changing X only."""
    policy = Policy(F32, BF16, F64)
    new = getattr(policy, _WITH[field])(spelling)
    assert isinstance(new, Policy) and new is not policy
    expected = dict(zip(FIELDS, dtypes_of(policy)), **{field: F16})
    assert dtypes_of(new) == tuple(expected[f] for f in FIELDS)
    assert all(d is getattr(jnp, np.dtype(d).name) for d in dtypes_of(new))
    assert dtypes_of(policy) == (F32, BF16, F64)  # Original untouched.
    assert get_policy(str(new)) == new


@pytest.mark.parametrize("field", FIELDS)
def test_with_dtype_validates(field):
    """with_X_dtype rejects a non-floating dtype with a TypeError naming X."""
    with pytest.raises(TypeError, match=field):
        getattr(Policy(F32, BF16, F32), _WITH[field])(jnp.int32)


# --------------------------------------------------------------------------
# Property tests of the grammar
# --------------------------------------------------------------------------

_HALF = half()
_NAME_TO_DTYPE = {n: d for d, names in DTYPE_NAMES.items() for n in names} | {"half": _HALF}
_KEY_TO_FIELD = {k: f for f, keys in KEY_NAMES.items() for k in keys}

# An independent, regex-based reader of the grammar. `\s` and `str.strip` agree
# on what white space is (both use Unicode's definition).
_NAME_RE = "|".join(sorted(map(re.escape, _NAME_TO_DTYPE), key=len, reverse=True))
_KEY_RE = "|".join(sorted(_KEY_TO_FIELD, key=len, reverse=True))
# The matmul key (`m`/`matmul`) takes its own names.
_MATMUL_NAMES = {"bf16", "bfloat16", "f16", "float16", "f8", "float8", "float8_e4m3fn", "half"}
_MNAME_RE = "|".join(sorted(_MATMUL_NAMES, key=len, reverse=True))
_PART_RE = rf"\s*(?:(?:{_KEY_RE})\s*=\s*(?:{_NAME_RE})|(?:matmul|m)\s*=\s*(?:{_MNAME_RE}))\s*"
_BARE = re.compile(rf"\s*({_NAME_RE}|{'|'.join(PRESETS)})\s*")
_KEYED = re.compile(rf"{_PART_RE}(?:,{_PART_RE})*")
_PAIR = re.compile(rf"({_KEY_RE}|matmul|m)\s*=\s*(\w+)")


def _resolve(assigned: dict[str, np.dtype]) -> tuple[np.dtype, np.dtype, np.dtype]:
    p = assigned.get("param_dtype", F32)
    c = assigned.get("compute_dtype", p)
    return p, c, assigned.get("output_dtype", c)


def reference_parse(spec: str):
    """The (p, c, o) the grammar gives `spec`, or None when it is not in the grammar."""
    if m := _BARE.fullmatch(spec):
        name = m.group(1)
        return PRESETS[name] if name in PRESETS else (_NAME_TO_DTYPE[name],) * 3
    if _KEYED.fullmatch(spec):
        assigned = {}
        for key, name in _PAIR.findall(spec):
            field = _KEY_TO_FIELD.get(key, "matmul_dtype")
            if field in assigned:
                return None  # A field given twice is an error.
            assigned[field] = _NAME_TO_DTYPE.get(name)
        return _resolve(assigned)
    return None


_ws = st.sampled_from(["", "", " ", "  ", "\t", "\n", " \t "])
_dtype_name = st.sampled_from(sorted(_NAME_TO_DTYPE))
_key = st.sampled_from(sorted(_KEY_TO_FIELD))


@st.composite
def valid_specs(draw):
    """A valid spec and the dtypes it must give, built from the grammar's parts."""
    kind = draw(st.sampled_from(["bare", "preset", "keyed"]))
    if kind == "bare":
        name = draw(_dtype_name)
        return draw(_ws) + name + draw(_ws), (_NAME_TO_DTYPE[name],) * 3
    if kind == "preset":
        name = draw(st.sampled_from(sorted(PRESETS)))
        return draw(_ws) + name + draw(_ws), PRESETS[name]
    pairs = draw(
        st.lists(
            st.tuples(_key, _dtype_name),
            min_size=1,
            max_size=3,
            unique_by=lambda pair: _KEY_TO_FIELD[pair[0]],  # each field at most once
        )
    )
    parts = [
        draw(_ws) + key + draw(_ws) + "=" + draw(_ws) + name + draw(_ws) for key, name in pairs
    ]
    assigned = {}
    for key, name in pairs:
        assigned[_KEY_TO_FIELD[key]] = _NAME_TO_DTYPE[name]
    return ",".join(parts), _resolve(assigned)


_PROPS = settings(max_examples=200, deadline=None)


@_PROPS
@given(valid_specs())
def test_property_valid_specs_parse_and_round_trip(case):
    """Random valid specs give the policy the grammar predicts, and str round-trips."""
    spec, expected = case
    assert reference_parse(spec) == expected  # The reference agrees with itself.
    policy = get_policy(spec)
    assert dtypes_of(policy) == expected
    assert get_policy(str(policy)) == policy


@st.composite
def mutated_specs(draw):
    """A valid spec with one character inserted, deleted or replaced: near misses."""
    spec, _ = draw(valid_specs())
    i = draw(st.integers(0, len(spec)))
    char = draw(st.sampled_from(list(",= xpc_f1=\u00a0") + [""]))
    end = draw(st.integers(i, min(len(spec), i + 1)))
    return spec[:i] + char + spec[end:]


_grammar_alphabet = st.text(alphabet=",= \tpcoaramsutfbl16248x_h", max_size=30)


@_PROPS
@given(st.one_of(st.text(max_size=30), _grammar_alphabet, mutated_specs()))
def test_property_any_text_parses_as_reference_or_value_error(spec):
    """Any text either parses exactly as the reference says or raises ValueError
    (never another exception) with a message listing what is accepted."""
    expected = reference_parse(spec)
    if expected is not None:
        assert dtypes_of(get_policy(spec)) == expected
        return
    with pytest.raises(ValueError) as info:
        get_policy(spec)
    found = words(str(info.value))
    assert set(ALL_KEY_NAMES) <= found or set(ALL_DTYPE_NAMES) <= found or _MATMUL_NAMES <= found, (
        str(info.value)
    )


@_PROPS
@given(st.tuples(*[st.sampled_from(FLOATS)] * 3), st.data())
def test_property_str_round_trip_any_spelling(dtypes, data):
    """For any dtypes and any spelling of them, str() parses back to an equal policy."""
    spellings = [data.draw(st.sampled_from(SPELLINGS[d])) for d in dtypes]
    policy = Policy(*spellings)
    assert dtypes_of(policy) == dtypes
    assert get_policy(str(policy)) == policy
    assert reference_parse(str(policy)) == dtypes
