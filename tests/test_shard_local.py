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
from helpers import import_benchmark
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


def exact_loss_and_grads(x, w, dims=DIMS):
    def loss(x, w):
        y = jax.lax.dot_general(x, w, dims, precision="highest")
        return jnp.sum(jnp.tanh(y))

    return jax.value_and_grad(loss, argnums=(0, 1))(x, w)


# (x's shape, w's shape, x's spec, w's spec) on 4 devices: a batch of 6, a
# contraction of 10, an output of 6 (padded shards: XLA leaves the padding
# undefined, each device's amax and sum must not read it)
UNEVEN = {
    "batch": ((6, 32), (32, 8), P("x"), P()),
    "contraction": ((8, 10), (10, 8), P(None, "x"), P("x")),
    "output": ((8, 32), (32, 6), P(), P(None, "x")),
}


@pytest.mark.parametrize("scaling", ["tensor", "rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("layout", UNEVEN)
def test_shards_the_mesh_does_not_divide(layout, scaling):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
    x_shape, w_shape, x_spec, w_spec = UNEVEN[layout]
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.integers(-4, 5, size=x_shape) / 8, jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, size=w_shape) / 4, jnp.float32)
    dims = (((1,), (0,)), ((), ()))

    def product(x, w, placed=True):
        if placed:
            x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, x_spec))
            w = jax.lax.with_sharding_constraint(w, NamedSharding(mesh, w_spec))
        return jmp.fp8_dot_general(x, w, dims, scaling=scaling)

    if scaling == "nvfp4":  # e2m1 elements are not exact: no worse than on one device
        errors = [float(jnp.abs(jax.jit(product, static_argnums=2)(x, w, placed) - x @ w).max())
                  for placed in (True, False)]  # fmt: skip
        assert errors[0] <= 1.2 * errors[1], errors
    loss = lambda x, w: jnp.sum(jnp.tanh(product(x, w)))  # noqa: E731
    sharded = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    if scaling == "nvfp4":
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in sharded[1])
        return
    want = exact_loss_and_grads(x, w, dims)
    np.testing.assert_allclose(sharded[0], want[0], rtol=1e-5)
    for got, exact in zip(sharded[1], want[1]):
        np.testing.assert_allclose(got, exact, atol=0.07 * float(jnp.abs(exact).max()))


# 2 x 4 (data x model): the kernel on its contraction over model (x's
# contraction is replicated there: a local slice); FSDP x TP (the kernel on
# both axes)
MESH_2D = {
    "rows": (P("data"), P("model")),
    "fsdp_tp": (P("data"), P("data", "model")),
    "both_contracted": (P("data", None, "model"), P("model", "data")),
}


@pytest.mark.parametrize("scaling", ["tensor", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("layout", MESH_2D)
def test_a_2d_mesh_sends_at_most_bf16s_bytes_and_gives_exact_gradients(layout, scaling, capfd):
    # Each gradient in its operand's sharding (asked of both programs); no
    # "Involuntary full rematerialization" (XLA gathering a whole array to
    # reshard it).
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    gpu_collectives = import_benchmark("gpu_collectives")
    mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.integers(-4, 5, size=(16, 4, 64)) / 8, jnp.float32)
    w = jnp.asarray(rng.integers(-4, 5, size=(64, 24)) / 4, jnp.float32)
    xs, ws = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((x, w), MESH_2D[layout]))

    def step(product):
        loss = lambda x, w: jnp.sum(jnp.tanh(product(x, w)))  # noqa: E731
        shardings = (NamedSharding(mesh, P()), (xs.sharding, ws.sharding))
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), out_shardings=shardings)

    def sent(step):
        compiled = step.lower(xs, ws).compile().as_text()
        return gpu_collectives.summary(gpu_collectives.collectives(compiled, 8))

    fp8 = step(lambda x, w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling))
    bf16 = step(lambda x, w: jax.lax.dot_general(
        x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), DIMS, preferred_element_type=jnp.float32
    ))  # fmt: skip
    capfd.readouterr()
    fp8_sent = sent(fp8)
    assert "Involuntary full rematerialization" not in capfd.readouterr().err
    # On XLA:CPU both send float32 (bf16 widened, FP8 as f16): bytes compare.
    assert fp8_sent["megabytes_per_device"] <= sent(bf16)["megabytes_per_device"], fp8_sent
    loss, grads = fp8(xs, ws)
    if scaling == "nvfp4":  # e2m1 elements are not exact: no worse than on one device
        forward = jax.jit(lambda x, w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling))
        exact = jnp.einsum("bsi,io->bso", x, w, precision="highest")
        errors = [float(jnp.abs(forward(*a) - exact).max()) for a in ((xs, ws), (x, w))]
        assert errors[0] <= 1.2 * errors[1], errors
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in grads)
        return
    want = exact_loss_and_grads(x, w)
    np.testing.assert_allclose(loss, want[0], rtol=1e-5)
    for got, exact in zip(grads, want[1]):
        np.testing.assert_allclose(got, exact, atol=0.07 * float(jnp.abs(exact).max()))


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["fsdp_tp", "tp_rows", "explicit_auto"])
def test_the_benchmark_transformers_2d_layouts_under_fp8(layout):
    # The GPU collectives benchmark's train step (Adam, the linen Transformer
    # LM) over 2 x 4 CPU devices: each FP8 recipe sends at most
    # mixed_bfloat16's bytes, without XLA's involuntary full rematerialization,
    # and every parameter and Adam moment comes back in bf16's sharding.
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    gpu_collectives = import_benchmark("gpu_collectives")
    rows = {}
    for variant in ("mixed_bfloat16", "mixed_float8", "mixed_mxfp8"):
        compiled, remats = gpu_collectives.compile_step(variant, layout, jax.devices()[:8])
        sent = gpu_collectives.summary(gpu_collectives.collectives(compiled.as_text(), 8))
        specs = [s.spec for s in jax.tree.leaves(compiled.output_shardings)]
        rows[variant] = (sent["megabytes_per_device"], remats, specs)
    bytes_bf16, _, specs_bf16 = rows["mixed_bfloat16"]
    for variant, (sent, remats, specs) in rows.items():
        assert remats == 0, (variant, remats)
        assert sent <= bytes_bf16, (variant, sent, bytes_bf16)
        assert specs == specs_bf16, variant


@pytest.mark.parametrize("policy", ["mixed_float8", "mixed_mxfp8"])
def test_explicit_and_auto_axes_together(policy, capfd):
    # data Explicit (the batch's sharding in its type), model Auto (the
    # kernels tensor-parallel, which types do not show): the products see
    # both, so nothing is gathered that bf16 does not gather, and each
    # gradient is sharded as bf16's; values as on one device.
    import flax.linen as nn

    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    gpu_collectives = import_benchmark("gpu_collectives")
    types = jax.sharding.AxisType
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(types.Explicit, types.Auto))
    model = nn.Sequential([nn.Dense(64), nn.relu, nn.Dense(32)])
    x = jnp.asarray(np.random.default_rng(7).normal(size=(16, 32)), jnp.float32)
    params = model.init(jax.random.key(0), x)
    specs = {"layers_0": {"kernel": P(None, "model"), "bias": P("model")},
             "layers_2": {"kernel": P("model", None), "bias": P()}}  # fmt: skip

    def grad_fn(policy):
        apply = jmp.with_policy(model.apply, policy)
        loss = lambda p, x: jnp.sum(apply(p, x).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss))

    one_device = grad_fn(policy)(params, x)
    with jax.set_mesh(mesh):
        placed = {"params": jax.tree.map(
            lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), params["params"], specs
        )}  # fmt: skip
        xs = jax.device_put(x, P("data"))
        sent, grads = {}, {}
        for name in ("mixed_bfloat16", policy):
            step = grad_fn(name)
            capfd.readouterr()
            compiled = step.lower(placed, xs).compile().as_text()
            assert "Involuntary full rematerialization" not in capfd.readouterr().err
            sent[name] = gpu_collectives.summary(gpu_collectives.collectives(compiled, 8))
            grads[name] = step(placed, xs)
    assert sent[policy]["megabytes_per_device"] <= sent["mixed_bfloat16"]["megabytes_per_device"]
    for got, half, want in zip(*map(jax.tree.leaves, (grads[policy], grads["mixed_bfloat16"],
                                                       one_device))):  # fmt: skip
        assert got.sharding.is_equivalent_to(half.sharding, got.ndim), (got.sharding, half.sharding)
        np.testing.assert_allclose(got, want, atol=0.1 * float(jnp.abs(want).max()))
