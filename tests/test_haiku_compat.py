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


def test_a_matmul_dtype_is_refused_by_haiku_and_taken_by_autocast():
    import haiku as hk
    import jax
    import jax.numpy as jnp

    from helpers import lowered_ops

    policy = jmp_policy.get_policy("p=f32,c=bf16,o=f32,m=float8_e4m3fn")
    net = hk.without_apply_rng(hk.transform(lambda x: hk.Linear(4)(x)))
    x = jnp.ones((2, 3))
    hk.mixed_precision.set_policy(hk.Linear, policy)
    try:
        with pytest.raises(ValueError, match=r"matmul dtype \(m=float8_e4m3fn\) Haiku cannot"):
            net.init(jax.random.key(0), x)
        # The way it names: Haiku without the matmul dtype, autocast with it.
        hk.mixed_precision.set_policy(hk.Linear, policy.with_matmul_dtype(None))
        params = net.init(jax.random.key(0), x)
        apply = jmp_policy.autocast(net.apply, policy)
        dots = [o for o in lowered_ops(apply, params, x) if o.name == "dot_general"]
        assert [o.operand_types for o in dots] == [("f8E4M3FN", "f8E4M3FN")]
    finally:
        hk.mixed_precision.clear_policy(hk.Linear)


@pytest.mark.slow
def test_a_haiku_resnet_under_autocast_is_as_good_as_haikus_own_bf16_config():
    # Haiku's own ResNet (BatchNorm state, convolutions), its weights random:
    # autocast against Haiku's hand-written half config, hk.mixed_precision.
    import haiku as hk
    import jax
    import jax.numpy as jnp
    import numpy as np

    def net_fn(x, is_training):
        net = hk.nets.ResNet(
            [1, 1, 1, 1], num_classes=10, channels_per_group=(8, 16, 16, 16),
            bottleneck=False, resnet_v2=False, initial_conv_config={"output_channels": 8},
        )  # fmt: skip
        return net(x, is_training=is_training)

    net = hk.transform_with_state(net_fn)
    x = jax.random.normal(jax.random.key(0), (4, 16, 16, 3))
    params, state = net.init(jax.random.key(1), x, True)
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(2), len(leaves))
    params = treedef.unflatten(
        [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
    )
    want, _ = net.apply(params, state, None, x, False)

    hk.mixed_precision.set_policy(hk.nets.ResNet, jmp_policy.get_policy("p=f32,c=bf16,o=f32"))
    try:
        hand, _ = hk.transform_with_state(net_fn).apply(params, state, None, x, False)
    finally:
        hk.mixed_precision.clear_policy(hk.nets.ResNet)
    hand_err = float(jnp.max(jnp.abs(hand - want)))

    apply = jmp_policy.autocast(net.apply, "mixed_bfloat16")
    out, _ = apply(params, state, None, x, False)
    assert out.dtype == jnp.float32
    assert float(jnp.max(jnp.abs(out - want))) <= 1.5 * hand_err

    # A train step: BatchNorm's statistics come back float32 and finite.
    def loss(p, s):
        logits, s = apply(p, s, None, x, True)
        return jnp.mean(logits**2), s

    (value, new_state), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, state)
    stats = [a for a in jax.tree.leaves(new_state) if jnp.issubdtype(a.dtype, jnp.floating)]
    assert stats and all(a.dtype == jnp.float32 for a in stats)
    assert np.isfinite(float(value)) and all(
        bool(jnp.all(jnp.isfinite(g))) and g.dtype == jnp.float32 for g in jax.tree.leaves(grads)
    )
