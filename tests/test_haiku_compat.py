"""Haiku's own mixed-precision tests, from the installed dm-haiku wheel, with
`jmp` pointed at jmp_policy.

Haiku's `hk.mixed_precision` is the largest user of jmp's API: its test file
builds policies with `jmp.get_policy` and checks the dtypes Haiku modules
create and return under them. Here the file is read from the wheel and run
with `sys.modules["jmp"]` set to `jmp_policy` while it is imported, so the
tests call jmp_policy wherever they call jmp; nothing of Haiku is copied into
this repository.
"""

import importlib.resources
import sys
import types

import jax
import pytest

import jmp_policy

pytest.importorskip("haiku")
pytest.importorskip("absl.testing.absltest")


def _load_haiku_test(filename: str) -> types.ModuleType:
    source = importlib.resources.files("haiku._src").joinpath(filename).read_text()
    assert "\nimport jmp\n" in source, f"haiku's {filename} changed shape"
    module = types.ModuleType(f"haiku_upstream_{filename[:-3]}")
    saved = sys.modules.get("jmp")
    sys.modules["jmp"] = jmp_policy  # only while the test module binds its `jmp`
    try:
        exec(compile(source, f"haiku/_src/{filename}", "exec"), module.__dict__)
    finally:
        if saved is None:
            del sys.modules["jmp"]
        else:
            sys.modules["jmp"] = saved
    assert module.jmp is jmp_policy
    return module


_mixed_precision_tests = _load_haiku_test("mixed_precision_test.py")

HaikuMixedPrecisionTest = type(
    "HaikuMixedPrecisionTest", (_mixed_precision_tests.MixedPrecisionTest,), {}
)

del _mixed_precision_tests


def test_all_of_haikus_tests_are_collected():
    """The wheel's test class still has the tests this file relies on (13 in 0.0.17)."""
    names = [n for n in dir(HaikuMixedPrecisionTest) if n.startswith("test")]
    assert len(names) >= 13, names


@pytest.fixture(autouse=True)
def _standard_promotion():
    # Haiku's tests mix float16 and float32 as users do, under standard
    # promotion; the rest of our suite runs under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


def _linear_refusing(policy):
    """A Haiku Linear under `hk.mixed_precision` with `policy` (left set: the caller
    clears it), whose `init` must refuse the FP8 matmul dtype; `(net, x)`."""
    import haiku as hk
    import jax
    import jax.numpy as jnp

    net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(4)(x)))
    x = jnp.ones((2, 3))
    hk.mixed_precision.set_policy(hk.Linear, policy)
    try:
        with pytest.raises(ValueError, match=r"matmul dtype \(m=float8_e4m3fn\) Haiku cannot"):
            net.init(jax.random.key(0), x)
    except BaseException:
        hk.mixed_precision.clear_policy(hk.Linear)
        raise
    return net, x


def test_a_matmul_dtype_is_refused_by_haiku_and_taken_by_autocast():
    import haiku as hk
    import jax

    from helpers import lowered_ops

    policy = jmp_policy.get_policy("p=f32,c=bf16,o=f32,m=float8_e4m3fn")
    net, x = _linear_refusing(policy)
    try:
        # The way it names: Haiku without the matmul dtype, autocast with it.
        hk.mixed_precision.set_policy(hk.Linear, policy.with_matmul_dtype(None))
        params = net.init(jax.random.key(0), x)
        apply = jmp_policy.autocast(net.apply, policy)
        dots = [o for o in lowered_ops(apply, params, x) if o.name == "dot_general"]
        assert [o.operand_types for o in dots] == [("f8E4M3FN", "f8E4M3FN")]
    finally:
        hk.mixed_precision.clear_policy(hk.Linear)


def test_a_reduce_dtype_is_refused_by_haiku_too():
    # Haiku runs products as written: `r=f32` would be dropped silently.
    import haiku as hk
    import jax
    import jax.numpy as jnp

    net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(4)(x)))
    hk.mixed_precision.set_policy(hk.Linear, jmp_policy.get_policy("mixed_bfloat16,r=f32"))
    try:
        with pytest.raises(ValueError, match=r"reduce dtype \(r=float32\) Haiku cannot"):
            net.init(jax.random.key(0), jnp.ones((2, 3)))
    finally:
        hk.mixed_precision.clear_policy(hk.Linear)


def test_haiku_is_recognised_through_a_policy_subclass():
    """Haiku is recognised by what it says (`hk.mixed_precision.current_policy()`),
    not by who calls: a jmp-style Policy subclass whose `cast_to_compute` calls
    `super()` (a logging policy) was let through, its matmul dtype silently
    dropped. A user's own cast outside Haiku's policy scope is not refused."""
    import dataclasses

    import haiku as hk
    import jax.numpy as jnp

    @dataclasses.dataclass(frozen=True)
    class LoggingPolicy(jmp_policy.Policy):
        def cast_to_compute(self, x):
            return super().cast_to_compute(x)

    policy = LoggingPolicy("f32", "bf16", "f32", matmul_dtype="f8")
    _, x = _linear_refusing(policy)
    hk.mixed_precision.clear_policy(hk.Linear)
    assert policy.cast_to_compute(x).dtype == jnp.bfloat16  # No Haiku policy in force.
