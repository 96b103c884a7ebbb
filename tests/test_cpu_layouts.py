"""Half-precision products in every layout a train step produces, run on this CPU.

Before jaxlib 0.12.1, XLA:CPU rejects some bf16 x bf16 -> f32 dots
("UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16
= F32"), depending on the layout and the sizes, on CPUs with and without
AVX512-BF16 alike, and JAX refuses to lower the F16_F16_F32 algorithm that
`jax.nn.dot_product_attention` asks for: under those jaxlibs jmp_policy emits
every half product on the CPU platform in a form XLA:CPU runs
(`jmp_policy/engine/products/cpu_form.py`). Here each policy that makes half
or FP8 products (`autocast` in bf16 and f16, `m=bf16`, `m=f16`,
`mixed_float8`) runs one function holding a product of every layout:
`dot_general` with either operand transposed, batch dimensions leading, in
the middle, last and split, several contracting dimensions, the einsums of
attention, a product with the F16_F16_F32 algorithm, and convolutions
(strided, dilated, grouped); forward and backward (a VJP with a random
cotangent), compared with float32 with a tolerance per dtype.

With the CPU form turned off, the same function fails on a jaxlib before
0.12.1, where the form is on by default
(`test_the_cpu_form_is_on_where_this_jaxlib_needs_it`): that is how the test
is known to catch the bug. From jaxlib 0.12.1 on, XLA:CPU runs every layout
as written, the form is off, and the products here run as written.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jmp_policy as jmp
from jmp_policy.engine.products import cpu_form

from helpers import compiler_options, lowered_ops

F32 = np.float32


def _dot(dims, precision=None, preferred_element_type=None):
    return lambda a, b: lax.dot_general(a, b, dims, precision, preferred_element_type)


def _einsum(spec):
    return lambda a, b: jnp.einsum(spec, a, b)


def _conv(strides, padding, rhs_dilation=(1, 1), groups=1):
    def conv(x, k):
        return lax.conv_general_dilated(
            x, k, strides, padding, rhs_dilation=rhs_dilation,
            dimension_numbers=("NHWC", "HWIO", "NHWC"), feature_group_count=groups,
        )  # fmt: skip

    return conv


# name: (product, lhs shape, rhs shape). Sizes are small but not all equal,
# so a wrong dimension order cannot go unnoticed.
LAYOUTS = {
    "dense [T,K]x[K,N]": (_dot((((1,), (0,)), ((), ()))), (12, 16), (16, 8)),
    "lhs transposed [K,T]x[K,N]": (_dot((((0,), (0,)), ((), ()))), (16, 12), (16, 8)),
    "rhs transposed [T,K]x[N,K]": (_dot((((1,), (1,)), ((), ()))), (12, 16), (8, 16)),
    "both transposed": (_dot((((0,), (1,)), ((), ()))), (16, 12), (8, 16)),
    "two contracting dims": (_dot((((2, 3), (0, 1)), ((), ()))), (2, 6, 4, 8), (4, 8, 16)),
    "contracting dims swapped": (_dot((((1, 2), (2, 0)), ((), ()))), (6, 4, 8), (8, 16, 4)),
    "batch leading": (_dot((((2,), (1,)), ((0,), (0,)))), (3, 12, 16), (3, 16, 8)),
    "batch in the middle": (_dot((((2,), (0,)), ((1,), (1,)))), (12, 3, 16), (16, 3, 8)),
    "batch last": (_dot((((1,), (0,)), ((2,), (2,)))), (12, 16, 3), (16, 8, 3)),
    "two batch dims apart": (_dot((((2,), (3,)), ((0, 1), (0, 2)))), (2, 3, 8, 6), (2, 6, 3, 8)),
    "free dims around contraction": (_dot((((0,), (1,)), ((), ()))), (8, 6), (6, 8, 5)),
    "attention scores": (_einsum("bqhd,bkhd->bhqk"), (2, 6, 3, 8), (2, 5, 3, 8)),
    "attention values": (_einsum("bhqk,bkhd->bqhd"), (2, 3, 6, 5), (2, 5, 3, 8)),
    # As jax.nn.dot_product_attention asks for its scores.
    "F16_F16_F32 algorithm": (
        _dot((((1,), (0,)), ((), ())), lax.DotAlgorithmPreset.F16_F16_F32, F32),
        (12, 16),
        (16, 8),
    ),
    "conv 3x3 same": (_conv((1, 1), "SAME"), (2, 7, 6, 4), (3, 3, 4, 8)),
    "conv strided": (_conv((2, 2), "VALID"), (2, 9, 8, 4), (3, 3, 4, 8)),
    "conv dilated": (_conv((1, 1), "SAME", rhs_dilation=(2, 2)), (2, 7, 6, 4), (3, 3, 4, 8)),
    "conv grouped": (_conv((1, 1), "SAME", groups=2), (2, 7, 6, 4), (3, 3, 2, 8)),
}
# The F16_F16_F32 product takes float16 operands (JAX: the algorithm's input type).
F16_ALGORITHM = "F16_F16_F32 algorithm"

# policy: (compute dtype of the products, relative tolerance of outputs and gradients).
# FP8: e4m3 keeps 3 mantissa bits, e5m2 2 (the output gradient): relative
# errors of up to 2^-4 and 2^-3 per element, ~0.1 in norm (test_matmul_dtype's bounds).
POLICIES = {
    # Products with float32 results (r=f32): what XLA:CPU's CPU form is for.
    "autocast bf16": ("p=f32,c=bf16,o=f32,r=f32", 2e-2),
    "autocast f16": ("p=f32,c=f16,o=f32,r=f32", 3e-3),
    "m=bf16": ("p=f32,c=bf16,o=f32,m=bf16,r=f32", 2e-2),
    "m=f16": ("p=f32,c=f16,o=f32,m=f16,r=f32", 3e-3),
    "mixed_float8": ("mixed_float8,r=f32", 0.15),
}


def _operands():
    keys = iter(jax.random.split(jax.random.key(0), 2 * len(LAYOUTS)))
    ops = {}
    for name, (_, lhs, rhs) in LAYOUTS.items():
        dtype = np.float16 if name == F16_ALGORITHM else F32
        ops[name] = tuple(jax.random.normal(next(keys), s, dtype) for s in (lhs, rhs))
    return ops


OPERANDS = _operands()


def products(operands):
    return {name: LAYOUTS[name][0](*ab) for name, ab in operands.items()}


def float32_products(operands):
    """The same products on float32 operands, the F16_F16_F32 algorithm left out
    (XLA:CPU has none): the reference."""
    out = {}
    for name, (a, b) in operands.items():
        fn = _dot((((1,), (0,)), ((), ()))) if name == F16_ALGORITHM else LAYOUTS[name][0]
        out[name] = fn(a.astype(F32), b.astype(F32))
    return out


# Faster compiles; the HLO passes, where the dots take their final form, are the same.
COMPILER_OPTIONS = compiler_options()


def forward_and_backward(fn):
    """`(outputs, operand gradients)` of `fn` for one fixed random cotangent per output."""

    def run(operands):
        outs, vjp = jax.vjp(fn, operands)
        keys = jax.random.split(jax.random.key(1), len(outs))
        cotangents = {
            n: jax.random.normal(k, o.shape, o.dtype) for k, (n, o) in zip(keys, outs.items())
        }
        (grads,) = vjp(cotangents)
        return outs, grads

    return run


def run_compiled(fn, operands):
    """`fn(operands)`, jitted and compiled with `COMPILER_OPTIONS`."""
    return jax.jit(fn).lower(operands).compile(COMPILER_OPTIONS)(operands)


def _rel_err(got, want):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@pytest.fixture(scope="module")
def reference():
    with jax.default_matmul_precision("highest"):
        return run_compiled(forward_and_backward(float32_products), OPERANDS)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_layout_runs_forward_and_backward_close_to_float32(policy, reference):
    spec, tol = POLICIES[policy]
    outs, grads = run_compiled(forward_and_backward(jmp.autocast(products, spec)), OPERANDS)
    want_outs, want_grads = reference
    for name in LAYOUTS:
        assert _rel_err(outs[name], want_outs[name]) < tol, (name, "forward")
        for i in range(2):
            assert grads[name][i].dtype == OPERANDS[name][i].dtype, name
            assert _rel_err(grads[name][i], want_grads[name][i]) < tol, (name, "backward", i)


def test_every_layout_runs_under_a_mesh(reference):
    # Under a mesh (MaxText's `jax.set_mesh`) JAX's own transposes of a dot
    # give their products the operand's sharding (`out_sharding`): they take
    # the CPU form too, laid out as asked (was: left as written, and a
    # MaxText train step failed in XLA:CPU).
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    with jax.set_mesh(mesh):
        fn = forward_and_backward(jmp.autocast(products, POLICIES["m=bf16"][0]))
        outs, grads = run_compiled(fn, OPERANDS)
    want_outs, want_grads = reference
    tol = POLICIES["m=bf16"][1]
    for name in LAYOUTS:
        assert _rel_err(outs[name], want_outs[name]) < tol, (name, "forward")
        for i in range(2):
            assert _rel_err(grads[name][i], want_grads[name][i]) < tol, (name, "backward", i)


def test_a_product_sharded_on_an_explicit_mesh_runs_as_jax_shards_it():
    # Explicit axes: the form's reshapes would merge a sharded dimension,
    # so the dot runs as written there, and its gradient as JAX shards it.
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.make_mesh((2,), ("data",), axis_types=explicit, devices=jax.devices()[:2])
    x = jax.device_put(jnp.ones((4, 8)), NamedSharding(mesh, P("data", None)))
    w = jax.device_put(jnp.ones((8, 3)), NamedSharding(mesh, P()))
    with jax.set_mesh(mesh):

        def loss(x, w):
            return (jmp.autocast(lambda x, w: x @ w, "mixed_bfloat16")(x, w) ** 2).sum()

        gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
    np.testing.assert_allclose(np.asarray(gw), np.full((8, 3), 64.0))
    assert gx.shape == x.shape


@pytest.mark.parametrize("policy", ["autocast bf16", "m=f16", "mixed_float8"])
def test_every_product_of_the_program_is_a_half_or_fp8_product(policy):
    # The numerics above could also come from float32 products: the CPU
    # program itself shows every contraction on half (or FP8) operands.
    spec = POLICIES[policy][0]
    ops = lowered_ops(forward_and_backward(jmp.autocast(products, spec)), OPERANDS)
    contractions = [op for op in ops if op.name in ("dot_general", "convolution")]
    # Forward and two backward products per layout.
    assert len(contractions) == 3 * len(LAYOUTS)
    narrow = {"bf16", "f16", "f8E4M3FN", "f8E5M2"}
    for op in contractions:
        assert set(op.operand_types) <= narrow, op.line
        assert op.result_types == ("f32",), op.line


def test_the_cpu_form_is_on_where_this_jaxlib_needs_it(monkeypatch):
    # The bug this file guards against, shown on this jaxlib: with the CPU form
    # off, the same bfloat16 products fail to run before jaxlib 0.12.1, where
    # the form is on by default; from 0.12.1 on they run, and it is off.
    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", False)
    fn = forward_and_backward(jmp.autocast(lambda ops: products(ops), POLICIES["m=bf16"][0]))
    try:
        jax.block_until_ready(run_compiled(fn, OPERANDS))
    except Exception as e:  # XLA's runtime error, or JAX's lowering one
        message = str(e)
        assert (
            "Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32" in message
            or "is not supported by dot_general on CPU" in message
        ), message
        assert cpu_form.cpu_bf16_dot_workaround({}), f"jaxlib {jax.__version__} needs the form"
    else:
        assert not cpu_form.cpu_bf16_dot_workaround({}), "the form is not needed here"


def test_the_cpu_form_follows_the_jaxlib_unless_the_environment_says():
    needs, fixed = (0, 12, 0, 1), cpu_form.FIXED_IN
    assert cpu_form.cpu_bf16_dot_workaround({}, needs) is True
    assert cpu_form.cpu_bf16_dot_workaround({}, fixed) is False
    assert cpu_form.cpu_bf16_dot_workaround({}, (0, 13, 0)) is False
    for version in (needs, fixed):
        off = {"JMP_POLICY_CPU_BF16_DOT_WORKAROUND": "0"}
        assert cpu_form.cpu_bf16_dot_workaround(off, version) is False
        on = {"JMP_POLICY_CPU_BF16_DOT_WORKAROUND": "1"}
        assert cpu_form.cpu_bf16_dot_workaround(on, version) is True
    assert cpu_form.jaxlib_version("0.12.0.1") == (0, 12, 0, 1)
    assert cpu_form.jaxlib_version("0.13.0.dev20261201") == (0, 13, 0)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_half_operands_asking_for_a_float32_result_run_on_the_cpu(policy):
    # The layers' dtype fields (`PolicyModule`) make the operands half before
    # the engine sees them; `jax.nn.dot_product_attention` asks for a float32
    # result (F16_F16_F32, which XLA:CPU refuses before jaxlib 0.12.1, where
    # the CPU form runs it).
    from flax import nnx

    import jmp_policy.nnx

    mha = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=False, rngs=nnx.Rngs(0)
    )
    x = jax.random.normal(jax.random.key(0), (2, 3, 8))
    with jax.numpy_dtype_promotion("standard"):  # Flax's attention mixes its dtypes.
        y = jax.jit(lambda m, x: m(x))(jmp_policy.nnx.PolicyModule(mha, policy), x)
        assert y.dtype == F32
        np.testing.assert_allclose(y, mha(x), atol=3e-2)


def test_operands_sharded_by_type_take_the_dot_as_written(monkeypatch):
    # The form's reshapes merge and split dimensions: where an operand's type
    # holds a sharding (a mesh with explicit axes), even without
    # `out_sharding`, JAX refuses them, so the dot runs as written (before:
    # "This reshape is not supported", `m=bf16,r=f32` on an attention
    # projection of a batch sharded by type).
    if len(jax.devices()) < 2:
        pytest.skip("needs 2 devices (XLA_FLAGS=--xla_force_host_platform_device_count=2)")
    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", True)
    explicit = (jax.sharding.AxisType.Explicit,)
    mesh = jax.make_mesh((2,), ("data",), axis_types=explicit, devices=jax.devices()[:2])
    x = jnp.ones((4, 8, 16), jnp.float32)
    w = jnp.ones((16, 2, 8), jnp.float32)  # (features, heads, head_dim)
    assert cpu_form.applies(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), jnp.float32, None)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, jax.sharding.PartitionSpec("data"))
        half = xs.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
        assert not cpu_form.applies(*half, jnp.float32, None)
        policy = "p=f32,c=bf16,o=f32,m=bf16,r=f32"
        project = jax.jit(jmp.autocast(lambda x, w: jnp.einsum("bsf,fhd->bshd", x, w), policy))
        y = project(xs, w)
    assert y.dtype == jnp.float32 and jax.typeof(y).sharding.spec[0] == "data"
    np.testing.assert_array_equal(y, np.full((4, 8, 2, 8), 16.0))
