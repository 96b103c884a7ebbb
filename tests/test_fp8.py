"""FP8 scaling (`fp8_dot_general(scaling=...)`, `mixed_float8_rowwise`) and second order.

* Policy: `fp8_scaling`, spelt `m=f8_rowwise`, round-trips through `str`;
  bad values are `ValueError`s naming the field.
* One outlier of 1e6 in one row: row-wise, every other row of the output,
  of the input gradient and of the weight gradient keeps the error it has
  without the outlier (within 1.2x); per tensor they are flushed to zero.
* Forward over reverse: Hessian-vector products of an MLP under
  `mixed_float8` and `mixed_float8_rowwise` are finite and within 10% of
  float32's; `jax.hessian` of `fp8_dot_general` is finite, and exact where
  the function is quadratic (straight-through tangents). Plain `jax.jvp`
  raises the library's own error.
* Both scalings: a NaN step under `loss_scaled` is skipped with parameters
  bit-identical (tests/test_matmul_dtype.py, parametrized), `jax.jit` over 8
  devices gives the single-device step, and `with_policy`, rules,
  `jmp_policy.nnx` and `autocast` apply row-wise scaling where the policy
  asks for it (an outlier sample leaves the others' outputs alone).
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp
import jmp_policy.nnx as jnnx

F32 = np.dtype(np.float32)
BF16 = np.dtype(jnp.bfloat16)
E4M3 = np.dtype(jnp.float8_e4m3fn)
DIMS = (((1,), (0,)), ((), ()))
ROWWISE = "mixed_float8_rowwise"


def _normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), F32)


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# ------------------------------------------------------------------- policy


def test_rowwise_preset_spec_and_str_round_trip():
    policy = jmp.get_policy(ROWWISE)
    assert policy == jmp.Policy(F32, BF16, F32, E4M3, fp8_scaling="rowwise")
    assert str(policy) == "p=full,c=bf16,o=full,m=f8_rowwise"
    assert jmp.get_policy(str(policy)) == policy
    assert policy != jmp.get_policy("mixed_float8")
    assert hash(policy) != hash(jmp.get_policy("mixed_float8"))
    assert jmp.get_policy("mixed_float8").fp8_scaling == "tensor"
    for spec in (
        "c=bf16, o=f32, matmul = float8_rowwise",
        "p=f32,c=bf16,o=f32,m=float8_e4m3fn_rowwise",
    ):
        assert jmp.get_policy(spec) == policy, spec
    # The four positional fields are as before.
    assert jmp.Policy(F32, BF16, F32, "f8") == jmp.get_policy("mixed_float8")
    assert policy.with_compute_dtype(jnp.float16).fp8_scaling == "rowwise"
    assert policy.with_fp8_scaling("tensor") == jmp.get_policy("mixed_float8")
    assert jmp.get_policy("mixed_float8").with_fp8_scaling("rowwise") == policy
    # Another matmul dtype drops the FP8 scaling.
    assert policy.with_matmul_dtype(None) == jmp.get_policy("mixed_bfloat16")
    assert policy.with_matmul_dtype("f8") == policy


@pytest.mark.parametrize("value", ["row", "tensorwise", None, 1])
def test_bad_fp8_scaling_is_value_error(value):
    with pytest.raises(ValueError, match="Policy.fp8_scaling must be one of 'tensor', 'rowwise'"):
        jmp.Policy(F32, BF16, F32, E4M3, fp8_scaling=value)
    with pytest.raises(ValueError, match=r"scaling must be one of 'tensor', 'rowwise'.*got"):
        jmp.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), DIMS, scaling=value)


def test_a_matmul_name_with_its_scaling_sets_the_field():
    # `Policy(..., "f8_rowwise")` reads as the spec does; a scaling given
    # besides that disagrees is a ValueError naming both.
    assert jmp.Policy(F32, BF16, F32, "f8_rowwise") == jmp.get_policy(ROWWISE)
    assert jmp.Policy(F32, BF16, F32, "f8_rowwise", fp8_scaling="rowwise").fp8_scaling == "rowwise"
    with pytest.raises(ValueError, match="has the scaling 'rowwise', but fp8_scaling='mxfp8'"):
        jmp.Policy(F32, BF16, F32, "f8_rowwise", fp8_scaling="mxfp8")


def test_fp8_dot_general_shape_mismatch_names_the_dimensions():
    with pytest.raises(TypeError, match=r"fp8_dot_general: lhs of shape \(2, 3\) and rhs"):
        jmp.fp8_dot_general(jnp.ones((2, 3)), jnp.ones((4, 5)), DIMS, scaling="rowwise")


def test_rowwise_without_fp8_matmul_is_value_error():
    for matmul in (None, BF16):
        with pytest.raises(ValueError, match="needs the matmul dtype float8_e4m3fn"):
            jmp.Policy(F32, BF16, F32, matmul, fp8_scaling="rowwise")
    for spec, quoted in [("m=bf16_rowwise", "'bf16_rowwise'"), ("c=f8_rowwise", "'f8_rowwise'")]:
        with pytest.raises(ValueError, match=quoted):
            jmp.get_policy(spec)


# ------------------------------------------------------- lowered program


@pytest.mark.parametrize("scaling,amaxes,copies", [("tensor", 3, (2, 1)), ("rowwise", 6, (4, 2))])
def test_fp8_operands_go_straight_into_the_products(scaling, amaxes, copies):
    # Forward e4m3 x e4m3, backward e5m2 x e4m3, all with float32 results; the
    # amax reductions: lhs, rhs and the gradient per tensor; row-wise also
    # lhs and rhs along their other axes and the gradient along its other one.
    # The FP8 copies: per tensor, the forward product takes the e4m3 copies
    # it saves, and both backward products one e5m2 gradient; row-wise, each
    # scaling its own. Counted in the compiled program: JAX's lists each
    # per-tensor quantization twice (the product's and the copy saved for an
    # unpartitioned backward pass, see shard_local), which XLA merges.
    def f(x, w, g):
        y, vjp = jax.vjp(lambda x, w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling), x, w)
        return y, vjp(g)

    args = jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones((4, 3))
    text = jax.jit(f).lower(*args).as_text()
    compiled = jax.jit(f).lower(*args).compile().as_text().splitlines()
    dots = sorted(
        line.split(" : ")[-1]
        .replace("tensor<", "")
        .replace(">,", ",")
        .replace(">)", ")")
        .removesuffix(">")
        for line in text.splitlines()
        if "stablehlo.dot_general" in line
    )
    assert dots == [
        "(4x3xf8E5M2, 4x8xf8E4M3FN) -> 3x8xf32",
        "(4x3xf8E5M2, 8x3xf8E4M3FN) -> 4x8xf32",
        "(4x8xf8E4M3FN, 8x3xf8E4M3FN) -> 4x3xf32",
    ], dots
    maxima = [
        line for line in compiled if " reduce(" in line and "max" in line.split("to_apply=")[-1]
    ]
    assert len(maxima) == amaxes, maxima
    found = tuple(
        sum(f"= f8{t}[" in line and " convert(" in line for line in compiled)
        for t in ("e4m3fn", "e5m2")
    )
    assert found == copies, compiled


# ---------------------------------------------------------------- outliers

OUTLIER_ROW, OUTLIER_COL = 3, 5


@jax.jit
def _products(x, w, g):
    """`{scaling: (y, dx, dw)}` of fp8_dot_general and of float32, for cotangent `g`."""
    out = {}
    for scaling in ("tensor", "rowwise"):
        y, vjp = jax.vjp(lambda x, w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling), x, w)
        out[scaling] = (y, *vjp(g))
    y, vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, DIMS, lax.Precision.HIGHEST), x, w)
    out["float32"] = (y, *vjp(g))
    return out


def test_rowwise_outlier_leaves_the_other_rows_forward_and_backward():
    rng = np.random.default_rng(0)
    x, w, g = _normal(rng, (64, 32)), _normal(rng, (32, 48)), _normal(rng, (64, 48))
    other_rows = np.arange(64) != OUTLIER_ROW  # of the output and of dx
    other_w_rows = np.arange(32) != OUTLIER_COL  # of dw: the outlier's input feature

    def errors(x):
        out = _products(x, w, g)
        ref_y, ref_dx, ref_dw = out.pop("float32")
        return {
            s: (
                _rel(y[other_rows], ref_y[other_rows]),
                _rel(dx[other_rows], ref_dx[other_rows]),
                _rel(dw[other_w_rows], ref_dw[other_w_rows]),
            )
            for s, (y, dx, dw) in out.items()
        }

    clean = errors(x)
    outlier = errors(x.at[OUTLIER_ROW, OUTLIER_COL].set(1e6))
    for before, after in zip(clean["rowwise"], outlier["rowwise"]):
        assert before < 0.07 and after <= 1.2 * before, (clean, outlier)
    # Per tensor the outlier's scale flushes every other row's output and
    # weight gradient to zero (the input gradient does not see x).
    y_err, dx_err, dw_err = outlier["tensor"]
    assert y_err == dw_err == 1.0, outlier
    assert dx_err == clean["tensor"][1]


@pytest.mark.parametrize(
    "lhs_shape,rhs_shape,dims",
    [
        # Batched (a batch of 4, rows of the second axis), and a transposed
        # product whose free lhs axis is its last one.
        ((4, 32, 64), (4, 64, 24), (((2,), (1,)), ((0,), (0,)))),
        ((64, 40), (24, 64), (((0,), (1,)), ((), ()))),
    ],
    ids=["batched", "transposed"],
)
def test_rowwise_scales_along_free_axes_of_any_layout(lhs_shape, rhs_shape, dims):
    # One outlier in one row of lhs's free axis: the other rows of the output
    # are those of the outlier-free product, bit for bit.
    rng = np.random.default_rng(1)
    x, w = _normal(rng, lhs_shape), _normal(rng, rhs_shape)
    index = [0] * len(lhs_shape)
    spoilt = x.at[tuple(index)].set(1e6)

    def f(x):
        return jmp.fp8_dot_general(x, w, dims, scaling="rowwise")

    clean, dirty = np.asarray(f(x)), np.asarray(f(spoilt))
    out_row_axis = len(dims[1][0])  # the output's lhs-free axis comes after the batch axes
    rest = [slice(None)] * clean.ndim
    if dims[1][0]:
        rest[0] = slice(1, None)  # other batch elements
        np.testing.assert_array_equal(dirty[tuple(rest)], clean[tuple(rest)])
        rest[0] = slice(None)
    rest[out_row_axis] = slice(1, None)  # other rows of the outlier's batch element too
    np.testing.assert_array_equal(dirty[tuple(rest)], clean[tuple(rest)])
    assert _rel(clean, lax.dot_general(x, w, dims, lax.Precision.HIGHEST)) < 0.06


# ------------------------------------------------------------ second order


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        h = nn.tanh(nn.Dense(32)(x))
        return nn.Dense(4)(nn.tanh(nn.Dense(32)(h)))


@pytest.fixture(scope="module")
def mlp_hvp():
    """`hvp(policy)`: the Hessian-vector product of the MLP's loss, flattened."""
    model = Mlp()
    rng = np.random.default_rng(2)
    x, y = _normal(rng, (16, 8)), _normal(rng, (16, 4))
    params = model.init(jax.random.key(0), x)
    v = jax.tree.map(lambda p: _normal(rng, p.shape), params)

    def hvp(policy, transform=jmp.with_policy):
        apply = model.apply if policy is None else transform(model.apply, policy)

        def loss(p):
            return jnp.mean((apply(p, x).astype(F32) - y) ** 2)

        out = jax.jit(lambda p, v: jax.jvp(jax.grad(loss), (p,), (v,))[1])(params, v)
        return np.concatenate([np.ravel(a) for a in jax.tree.leaves(out)])

    return hvp


@pytest.mark.parametrize(
    "policy,transform",
    [("mixed_float8", "with_policy"), (ROWWISE, "with_policy"), (ROWWISE, "autocast")],
)
def test_hessian_vector_product_finite_and_near_float32(mlp_hvp, policy, transform):
    # Measured: 0.055 for both scalings and both transforms (mixed_bfloat16: 0.007).
    got, want = mlp_hvp(policy, getattr(jmp, transform)), mlp_hvp(None)
    assert np.isfinite(got).all()
    assert _rel(got, want) < 0.10


@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
def test_hessian_of_fp8_dot_general(scaling):
    rng = np.random.default_rng(3)
    x, w = _normal(rng, (16, 8)), _normal(rng, (8, 4))

    def fp8(w):
        return jmp.fp8_dot_general(x, w, DIMS, scaling=scaling)

    def f32(w):
        return lax.dot_general(x, w, DIMS, lax.Precision.HIGHEST)

    h = jax.hessian(lambda w: jnp.sum(jnp.tanh(fp8(w)) ** 2))(w)
    ref = jax.hessian(lambda w: jnp.sum(jnp.tanh(f32(w)) ** 2))(w)
    assert h.shape == (8, 4, 8, 4) and np.isfinite(h).all()
    assert _rel(h, ref) < 0.25  # measured 0.14: the FP8 primal values, second-order sensitive
    # A quadratic: the tangents are exact products, so is the Hessian.
    h = jax.hessian(lambda w: 0.5 * jnp.sum(fp8(w) ** 2))(w)
    ref = jax.hessian(lambda w: 0.5 * jnp.sum(f32(w) ** 2))(w)
    np.testing.assert_allclose(h, ref, rtol=1e-5, atol=1e-4)


def test_plain_jvp_raises_the_librarys_error():
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    for scaling in ("tensor", "rowwise"):
        with pytest.raises(TypeError, match="Forward-mode differentiation .* FP8 matmuls"):
            jax.jvp(lambda w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling), (w,), (w,))
    model = Mlp()
    params = model.init(jax.random.key(0), x)
    with pytest.raises(TypeError, match="forward over reverse"):
        jax.jvp(lambda p: jmp.with_policy(model.apply, ROWWISE)(p, x), (params,), (params,))


# ----------------------------------------------------- the integrations


class Dense2(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(8, name="head")(nn.Dense(16, name="body")(x))


class NnxDense2(nnx.Module):
    def __init__(self, rngs):
        self.body = nnx.Linear(6, 16, rngs=rngs)
        self.head = nnx.Linear(16, 8, rngs=rngs)

    def __call__(self, x):
        return self.head(self.body(x))


@pytest.fixture(scope="module")
def outlier_batch():
    rng = np.random.default_rng(4)
    x = _normal(rng, (32, 6))
    return x, x.at[0, 2].set(1e6)


def _other_rows_error(apply, reference, outlier_batch):
    _, spoilt = outlier_batch
    return _rel(jax.jit(apply)(spoilt)[1:], reference(spoilt)[1:])


def test_linen_with_policy_rules_and_autocast_apply_rowwise(outlier_batch):
    model = Dense2()
    params = model.init(jax.random.key(0), outlier_batch[0])

    def ref(x):
        return model.apply(params, x)

    def err(apply):
        return _other_rows_error(lambda x: apply(params, x), ref, outlier_batch)

    rowwise = [
        jmp.with_policy(model.apply, ROWWISE),
        jmp.autocast(model.apply, ROWWISE),
        # Rules give both layers row-wise scaling (one left per tensor would
        # flush the other rows of the outlier's activations).
        jmp.with_policy(model.apply, "mixed_float8", rules={"body": ROWWISE, "head": ROWWISE}),
    ]
    for apply in rowwise:
        assert err(apply) < 0.08
    # Per tensor the other rows are flushed (to zero, or nearly: measured
    # 0.83 to 1.0 off).
    for apply in (
        jmp.with_policy(model.apply, "mixed_float8"),
        jmp.autocast(model.apply, "mixed_float8"),
        jmp.with_policy(model.apply, ROWWISE, rules={"head": "mixed_float8"}),
    ):
        assert err(apply) > 0.5


def test_nnx_policy_module_applies_rowwise(outlier_batch):
    model = NnxDense2(nnx.Rngs(0))

    def err(policy, rules=None):
        wrapped = jnnx.PolicyModule(model, policy, rules=rules)
        return _other_rows_error(nnx.jit(lambda x: wrapped(x)), model, outlier_batch)

    assert err(ROWWISE) < 0.08
    assert err("mixed_float8", rules={"body": ROWWISE, "head": ROWWISE}) < 0.08
    assert err("mixed_float8") > 0.5
    assert err(ROWWISE, rules={"head": "mixed_float8"}) > 0.5


# ------------------------------------------------------------ 8 devices


@pytest.mark.parametrize(
    "policy",
    [
        "mixed_float8",
        ROWWISE,
        "mixed_mxfp8",
        "mixed_nvfp4",
        ROWWISE + ",r=f32",
        "mixed_mxfp8,r=f32",
    ],
)
def test_jit_over_8_devices_gives_the_single_device_step(policy):
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    model = Dense2()
    rng = np.random.default_rng(5)
    x, y = _normal(rng, (32, 6)), _normal(rng, (32, 8))
    params = jmp.with_policy(model.init, policy)(jax.random.key(1), x)
    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15))

    def step_of(apply):
        def step(params, opt_state, x, y):
            loss_scale = jmp.get_loss_scale(opt_state)

            def loss_fn(p):
                loss = jnp.mean((apply(p, x) - y) ** 2)
                return loss_scale.scale(loss), loss

            grads, loss = jax.grad(loss_fn, has_aux=True)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        return step

    step = step_of(jmp.with_policy(model.apply, policy))
    single = jax.jit(step)(params, tx.init(params), x, y)
    data = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())
    sharded_params = jax.device_put(params, replicated)
    xs, ys = jax.device_put(x, data), jax.device_put(y, data)
    out = jax.jit(step)(sharded_params, tx.init(sharded_params), xs, ys)
    assert out[0]["params"]["body"]["kernel"].sharding.is_fully_replicated
    # Per tensor, each device scales its own part of the batch (no amax is
    # reduced across devices), so the kernels, updated by the FP8 weight-
    # gradient products, are the single device's up to FP8 rounding. Row-wise,
    # the amaxes over the sharded batch are global. Each device's part of a
    # product is rounded to the reduce dtype before they are summed (measured:
    # 6e-5 of the kernels' norm for each format; none under `r=f32`; XLA:CPU
    # before jaxlib 0.12.1 dropped that rounding for the row-wise products,
    # which it ran in float32). The biases' gradients are bfloat16
    # sums over the batch, which XLA adds up per device first (measured: 0.9%
    # off; 1e-7 under a float32 compute dtype).
    # NVFP4 rounds gradients stochastically, from each value's bits and place
    # in the blocks a device holds: sharded, the noise is other than one
    # device's. Both are held to float32's step (measured: 0.23 and 0.10 of
    # the body's bias, the one leaf the noise moves beyond 2%).
    rounded = policy in ("mixed_float8", ROWWISE, "mixed_mxfp8", "mixed_nvfp4")
    exact = jax.jit(step_of(model.apply))(params, tx.init(params), x, y)
    for a, b, c in zip(*(map(np.asarray, jax.tree.leaves(s)) for s in (out, single, exact))):
        assert a.shape == b.shape
        if policy == "mixed_nvfp4":
            assert _rel(a, c) < 0.3 and _rel(b, c) < 0.3 if np.any(c) else not np.any(a)
        else:
            assert _rel(a, b) < 0.02 if np.any(b) else not np.any(a)
    for layer in ("body", "head"):
        kernels = [s[0]["params"][layer]["kernel"] for s in (out, single)]
        if rounded:  # NVFP4's noise: measured 2.6e-3
            assert _rel(*kernels) < (1e-2 if policy == "mixed_nvfp4" else 1e-3)
        else:
            np.testing.assert_allclose(*kernels, rtol=1e-6, atol=1e-8)
    assert int(out[1].total_notfinite) == 0


@pytest.mark.parametrize("scaling", ["tensor", "rowwise", "mxfp8", "nvfp4"])
def test_inside_shard_map_the_scales_are_each_devices_own(scaling):
    # A replicated weight times a sharded input: JAX marks the weight varying
    # (as for its own products), so the custom VJP's cotangents fit their
    # operands and the weight's gradient is summed over the devices; the
    # amaxes are each device's own: no collective but that sum.
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[:8]), ("data",))
    rng = np.random.default_rng(7)
    x, w = _normal(rng, (64, 32)), _normal(rng, (32, 8))
    x = x * jnp.repeat(2.0 ** jnp.arange(8.0), 8)[:, None]  # Each device's rows their own scale.

    def grads(x, w):
        loss = lambda x, w: jmp.fp8_dot_general(x, w, DIMS, scaling=scaling).sum()  # noqa: E731
        return jax.grad(loss, argnums=(0, 1))(x, w)

    sharded = jax.jit(
        jax.shard_map(grads, mesh=mesh, in_specs=(P("data"), P()), out_specs=(P("data"), P()))
    )
    dx, dw = sharded(x, w)
    each = [jax.jit(grads)(x[8 * i : 8 * i + 8], w) for i in range(8)]
    np.testing.assert_array_equal(dx, jnp.concatenate([d for d, _ in each]))
    np.testing.assert_allclose(dw, sum(d for _, d in each), rtol=1e-6)
    hlo = sharded.lower(x, w).compile().as_text()
    assert hlo.count(" all-reduce(") + hlo.count(" all-reduce-start(") == 1, hlo


# ------------------------------------------------------------ empty operands

POLICIES = {
    "tensor": "mixed_float8",
    "rowwise": ROWWISE,
    "mxfp8": "mixed_mxfp8",
    "nvfp4": "mixed_nvfp4",
}


@pytest.mark.parametrize("scaling", list(POLICIES))
@pytest.mark.parametrize(("x_shape", "w_shape"), [((0, 6), (6, 4)), ((3, 0), (0, 4))])
def test_zero_size_operands_give_what_float32_gives(scaling, x_shape, w_shape):
    # An empty batch (Hugging Face's init on tiny inputs, a short sequence's
    # blocks) or an empty contraction: no amax to take; the scale is 1.
    x, w = jnp.ones(x_shape), jnp.ones(w_shape)

    def f(x, w):
        return jmp.fp8_dot_general(x, w, DIMS, scaling=scaling)

    y, (gx, gw) = jax.jit(jax.value_and_grad(lambda x, w: f(x, w).sum(), argnums=(0, 1)))(x, w)
    assert y.shape == () and float(y) == 0.0
    assert gx.shape == x_shape and gw.shape == w_shape
    assert not np.any(np.asarray(gx)) and not np.any(np.asarray(gw))
    np.testing.assert_array_equal(jax.jit(f)(x, w), x @ w)
    # Flax 0.12.8 checks a kernel's shape by tracing its initialiser, and jax
    # 0.10's lecun_normal divides by a fan-in of 0 (the plain model fails so too).
    model = nn.Dense(4, kernel_init=nn.initializers.zeros)
    params = {"params": {"kernel": w, "bias": jnp.zeros(4)}}
    out = jmp.with_policy(model.apply, POLICIES[scaling])(params, x)
    assert out.shape == (x_shape[0], 4) and out.dtype == jnp.float32


class GlobalBlocks(nn.Module):
    """LongT5's transient-global attention in small: a sequence shorter than
    its block makes no global block, and the products over them are empty."""

    block: int = 4

    @nn.compact
    def __call__(self, x):
        n = x.shape[1] // self.block
        blocks = x[:, : n * self.block].reshape(x.shape[0], n, self.block, x.shape[-1])
        summary = nn.Dense(x.shape[-1], name="global")(blocks.mean(axis=2))
        scores = jnp.einsum("bld,bgd->blg", nn.Dense(x.shape[-1], name="query")(x), summary)
        return x + jnp.einsum("blg,bgd->bld", scores, summary).astype(x.dtype)


@pytest.mark.parametrize("policy", list(POLICIES.values()))
def test_init_and_apply_on_inputs_shorter_than_a_block(policy):
    # Hugging Face initialises on (1, 1) inputs; here no global block exists.
    model, x = GlobalBlocks(), jnp.ones((1, 1, 8))
    variables = jmp.with_policy(model.init, policy)(jax.random.key(0), x)
    out = jax.jit(jmp.with_policy(model.apply, policy))(variables, jnp.ones((2, 3, 8)))
    np.testing.assert_array_equal(out, jnp.ones((2, 3, 8)))


@pytest.mark.parametrize("scaling", ["tensor", "rowwise", "mxfp8", "nvfp4"])
@pytest.mark.parametrize("size", [2e-36, 1e35], ids=["tiny", "huge"])
def test_products_far_from_one_keep_their_value(scaling, size):
    # Tiny: a scale below float32's normal range (flushed to zero on XLA:CPU)
    # read as an all-zero tensor and gave 0. Huge: NVFP4's two tensor scales,
    # one after the other, overflowed before the second brought it back.
    dims = (((1,), (0,)), ((), ()))
    x = jax.random.normal(jax.random.key(0), (4, 32)) * size
    w = jax.random.normal(jax.random.key(1), (32, 3))
    exact = lax.dot_general(x, w, dims, precision="highest")
    y, vjp = jax.vjp(lambda a, b: jmp.fp8_dot_general(a, b, dims, scaling=scaling), x, w)
    g = jax.random.normal(jax.random.key(2), y.shape)
    gx, gw = vjp(g)  # The weight gradient takes the operand's size.
    for got, want in ((y, exact), (gx, g @ w.T), (gw, x.T @ g)):
        # Relative to the whole (NVFP4 rounds single elements coarsely).
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.25
