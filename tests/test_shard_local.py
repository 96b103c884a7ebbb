"""Per-tensor FP8 products under `jit` over 8 devices: each device scales the
blocks it holds by their own amax, so no all-reduce carries an activation's
amax, whichever is saved for the backward pass; a weight gathered whole (FSDP)
is gathered in FP8, its scale one max over its shards."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp
from jmp_policy.engine.products import shard_local

DIMS = (((2,), (0,)), ((), ()))  # (batch, seq, in) x (in, out)


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:8]), ("x",))


def loss_and_grads(residuals, x, w):
    def loss(x, w):
        y = jmp.fp8_dot_general(x, w, DIMS, residuals=residuals)
        return jnp.sum(jnp.tanh(y))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def all_reduces(compiled_text):
    """(all-reduces, those of one element) in a compiled program."""
    found = re.findall(r"= \(?(\w+)\[([0-9,]*)\][^=]*? all-reduce(?:-start)?\(", compiled_text)
    return len(found), sum(dims == "" for _, dims in found)


def maxima_and_gathers(compiled_text):
    """(all-reduces taking a maximum, the element types all-gathered)."""
    computations = dict(re.findall(r"\n(%[\w.\-]+) (.*?)\n}", compiled_text, re.S))
    reduced = re.findall(r" all-reduce(?:-start)?\(.*?to_apply=(%[\w.\-]+)", compiled_text)
    gathered = re.findall(r"= (\w+)\[[0-9,]*\][^=]*? all-gather(?:-start)?\(", compiled_text)
    return sum(" maximum(" in computations.get(c, "") for c in reduced), gathered


# data parallel; the contraction sharded (row-parallel); the output sharded
# (column-parallel); both on one axis (FSDP: the weight is gathered)
LAYOUTS = {
    "data": (P("x"), P()),
    "contraction": (P(None, None, "x"), P("x")),
    "columns": (P(), P(None, "x")),
    "fsdp": (P("x"), P("x")),
}


@pytest.mark.parametrize("residuals", ["quantized", "operands"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_only_a_gathered_weights_amax_is_all_reduced_and_exact_gradients(mesh, layout, residuals):
    # Small integers times powers of two are e4m3 (and e5m2) numbers: every
    # layout's per-shard scales give float32's exact result.
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.integers(-4, 5, size=(16, 4, 32)) / 8, jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, size=(32, 24)) / 4, jnp.float32)
    xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), LAYOUTS[layout]))
    step = loss_and_grads(residuals, xs, ws)
    loss, (dx, dw) = step(xs, ws)
    exact = jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.tanh(jnp.einsum("bsi,io->bso", x, w, precision="highest"))),
        argnums=(0, 1),
    )(x, w)
    np.testing.assert_allclose(loss, exact[0], rtol=1e-6)
    # The gradient through tanh is not an e5m2 number: within e5m2's rounding.
    for got, want in zip((dx, dw), exact[1]):
        np.testing.assert_allclose(got, want, atol=0.07 * float(jnp.abs(want).max()))
    compiled = step.lower(xs, ws).compile().as_text()
    total, scalars = all_reduces(compiled)
    maxima, gathered = maxima_and_gathers(compiled)
    if layout == "fsdp" and residuals == "quantized":
        # The weight's FP8 copy serves both passes: its scale's one maximum,
        # its elements gathered in FP8 (XLA:CPU widens them to f16).
        assert (maxima, gathered) == (1, ["f16"]), (maxima, gathered)
    else:
        assert maxima == 0, (layout, residuals, maxima)
        assert set(gathered) <= {"f32"}, gathered
    assert scalars <= 1 + (maxima > 0), (layout, total, scalars)  # the loss's own sum
    # Row-wise scales are still global: an amax over the sharded batch is reduced.
    rowwise = jax.jit(
        jax.grad(lambda x, w: jnp.sum(jmp.fp8_dot_general(x, w, DIMS, scaling="rowwise")), 1)
    )
    if layout == "data":
        assert all_reduces(rowwise.lower(xs, ws).compile().as_text())[0] > total


def test_sharded_results_are_close_to_one_devices(mesh):
    rng = np.random.default_rng(1)
    x = jnp.asarray(
        rng.normal(size=(16, 4, 32)) * np.repeat([1.0, 30.0], 8)[:, None, None], jnp.float32
    )
    w = jnp.asarray(rng.normal(size=(32, 24)), jnp.float32)
    one = loss_and_grads(None, x, w)(x, w)
    xs = jax.device_put(x, NamedSharding(mesh, P("x")))
    sharded = loss_and_grads(None, xs, w)(xs, w)
    np.testing.assert_allclose(sharded[0], one[0], rtol=0.05)
    for a, b in zip(sharded[1], one[1]):
        np.testing.assert_allclose(a, b, atol=0.1 * float(jnp.abs(b).max()))


@pytest.mark.parametrize("dims, shapes", [
    ((((2,), (0,)), ((), ())), ((3, 4, 5), (5, 6))),
    ((((1,), (2,)), ((0,), (0,))), ((2, 5, 3), (2, 4, 5))),
    ((((0, 2), (1, 0)), ((), ())), ((5, 3, 4), (4, 5, 2))),
])  # fmt: skip
def test_transposed_dims_are_jaxs_transpose(dims, shapes):
    rng = np.random.default_rng(2)
    lhs, rhs = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
    out, vjp = jax.vjp(lambda a, b: jax.lax.dot_general(a, b, dims), lhs, rhs)
    g = jnp.asarray(rng.normal(size=out.shape), jnp.float32)
    want = vjp(g)
    for side, other, w in (("lhs", rhs, want[0]), ("rhs", lhs, want[1])):
        t_dims, order = shard_local.transposed_dims(dims, (lhs.ndim, rhs.ndim), side)
        got = jax.lax.transpose(jax.lax.dot_general(g, other, t_dims), order)
        np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-5)


EXPLICIT = {  # (x's spec, w's spec, the product's out_sharding)
    "data": (P("x"), P(), None),
    "columns": (P(), P(None, "x"), None),
    "contraction": (P(None, None, "x"), P("x"), P()),
}


@pytest.mark.parametrize("scaling", ["tensor", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("layout", EXPLICIT)
def test_under_explicit_sharding_the_types_partition_the_products(scaling, layout):
    # Shardings in types (`AxisType.Explicit`): each product is partitioned as
    # `jit` partitions it, read from the operands' types; each gradient has its
    # operand's sharding; the result `lax.dot_general`'s (or `out_sharding`).
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.integers(-4, 5, size=(16, 4, 32)) / 8, jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, size=(32, 24)) / 4, jnp.float32)
    x_spec, w_spec, out_sharding = EXPLICIT[layout]

    def spec(a):
        return P(*[*jax.typeof(a).sharding.spec, *[None] * a.ndim][: a.ndim])

    def loss(x, w):
        y = jmp.fp8_dot_general(x, w, DIMS, scaling=scaling, out_sharding=out_sharding)
        assert spec(y) == spec(jax.lax.dot_general(x, w, DIMS, out_sharding=out_sharding))
        return jnp.sum(jnp.tanh(y))

    with jax.set_mesh(mesh):
        xs, ws = jax.device_put(x, x_spec), jax.device_put(w, w_spec)
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        value, grads = step(xs, ws)
        compiled = step.lower(xs, ws).compile().as_text()
    assert [spec(g) for g in grads] == [spec(xs), spec(ws)]
    assert spec(xs) != spec(ws) or layout == "contraction"
    assert maxima_and_gathers(compiled)[0] == 0  # each device's own scales
    exact = jax.value_and_grad(
        lambda x, w: jnp.sum(jnp.tanh(jnp.einsum("bsi,io->bso", x, w, precision="highest"))),
        argnums=(0, 1),
    )(x, w)
    if scaling != "nvfp4":  # e2m1 elements: the operands are not exact in FP4
        np.testing.assert_allclose(value, exact[0], rtol=1e-5)  # the sum's order
        for got, want in zip(grads, exact[1]):
            np.testing.assert_allclose(got, want, atol=0.07 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float8", "mixed_mxfp8"])
def test_a_policy_runs_a_model_whose_types_hold_its_shardings(policy):
    # A linen model under `with_policy` and `autocast`, data parallel with
    # explicit axes: its kernel's gradient replicated as the kernel is (and
    # `autocast` keeps the types' shardings through `jax.nn.relu`'s own jit).
    import flax.linen as nn

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = jax.make_mesh((8,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
    model = nn.Sequential([nn.Dense(32), nn.relu, nn.Dense(8)])
    x = jnp.asarray(np.random.default_rng(4).normal(size=(16, 32)), jnp.float32)
    params = model.init(jax.random.key(0), x)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("x"))
        for transform in (jmp.with_policy, jmp.autocast):
            apply = transform(model.apply, policy)
            grads = jax.jit(jax.grad(lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2)))(
                params, xs
            )
            kernel = grads["params"]["layers_0"]["kernel"]
            assert not any(jax.typeof(kernel).sharding.spec), policy
            assert bool(jnp.all(jnp.isfinite(kernel))) and float(jnp.abs(kernel).max()) > 0
