"""The matmul dtype, the policy's fourth field, and FP8 products (`fp8_dot_general`).

* Policy: `Policy(p, c, o)` and every existing spec are unchanged; `m=`/
  `matmul=` and the `mixed_float8` preset; `str` prints `m` only when set.
* Lowered programs of whole jitted train steps: under `m=bf16` every
  `dot_general` has bfloat16 operands and a float32 result, forward and
  backward; under `mixed_float8` every `dot_general` has e4m3 operands
  forward and an e5m2 output gradient in each backward product, except the
  ones a rule keeps out (counted). For linen `with_policy` (the example
  Transformer, no hand-wired `dot_general`), `autocast` and an NNX model.
* `fp8_dot_general` against float32 `lax.dot_general` on Gaussian operands
  of several shapes and dimension numbers (the bounds are derived at
  `test_fp8_error_within_rounding_bounds`), exact on e4m3/e5m2 numbers.
* An inf or NaN in an activation under `mixed_float8`: `loss_scaled` skips the
  step, nothing non-finite in parameters or optimizer state.
* The example Transformer trained 300 steps under `mixed_float8` ends near
  `mixed_bfloat16`, and under `m=bf16` near float32 (slow).
"""

from __future__ import annotations

import collections
import functools
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax

import jmp_policy as jmp
import jmp_policy.nnx as jnnx
from jmp_policy.app import transformer_lm
from jmp_policy.engine.products.fp8 import E4M3_MAX, E5M2_MAX, fp8_scale

from helpers import hlo_ops, import_benchmark, load_script, lowered_ops

ROOT = Path(__file__).resolve().parent.parent
F32 = np.dtype(np.float32)
BF16 = np.dtype(jnp.bfloat16)
E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
M_BF16 = "p=f32,c=bf16,o=f32,m=bf16"


# ------------------------------------------------------------------- policy


def test_three_argument_policy_and_existing_specs_unchanged():
    p = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
    assert p.matmul_dtype is None
    assert str(p) == "p=full,c=bf16,o=full"
    assert p == jmp.get_policy("mixed_bfloat16") == jmp.Policy(F32, BF16, F32, None)
    assert hash(p) == hash(jmp.get_policy("p=f32,c=bf16,o=f32"))
    for spec in (
        "float32",
        "bf16",
        "half",
        "mixed_bfloat16",
        "mixed_float16",
        "c=f16",
        "p=f32,c=bf16",
    ):
        assert jmp.get_policy(spec).matmul_dtype is None, spec


@pytest.mark.parametrize(
    "spec,matmul",
    [
        ("p=f32,c=bf16,o=f32,m=f8", E4M3),
        ("p=f32,c=bf16,o=f32,matmul=float8", E4M3),
        ("c=bf16, m = float8_e4m3fn", E4M3),
        ("p=f32,c=bf16,o=f32,m=bf16", BF16),
        ("c=f16,matmul=float16", np.dtype(np.float16)),
    ],
)
def test_spec_matmul_key(spec, matmul):
    policy = jmp.get_policy(spec)
    assert policy.matmul_dtype == matmul
    assert jmp.get_policy(str(policy)) == policy  # str round-trips


def test_mixed_float8_preset_and_str():
    policy = jmp.get_policy("mixed_float8")
    assert policy == jmp.Policy(F32, BF16, F32, jnp.float8_e4m3fn)
    assert str(policy) == "p=full,c=bf16,o=full,m=f8"
    assert policy != jmp.get_policy("mixed_bfloat16")
    assert hash(policy) == hash(jmp.Policy(F32, BF16, F32, "f8"))
    assert policy.with_compute_dtype(jnp.float16).matmul_dtype == E4M3


@pytest.mark.parametrize(
    "spec,quoted",
    [("p=f32,m=f32", "'f32'"), ("m=f8e5", "'f8e5'"), ("c=f8", "'f8'")],
)
def test_bad_matmul_spec_is_value_error(spec, quoted):
    with pytest.raises(ValueError) as info:
        jmp.get_policy(spec)
    assert quoted in str(info.value)


@pytest.mark.parametrize("value", [jnp.float32, jnp.float8_e5m2, jnp.int8, "f32"])
def test_bad_matmul_dtype_is_type_error(value):
    with pytest.raises(TypeError, match="matmul_dtype must be None, bfloat16"):
        jmp.Policy(F32, BF16, F32, value)


# ------------------------------------------------------- lowered programs

_DOT = re.compile(r"stablehlo\.dot_general.* : \((.*)\) -> (.*)$")
_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*([a-zA-Z0-9]+)>")


def dot_types(text: str) -> collections.Counter:
    """`{((lhs, rhs), result): count}` over the `dot_general`s of a lowered program."""
    counts = collections.Counter()
    for line in text.splitlines():
        match = _DOT.search(line)
        if match:
            counts[tuple(_ELEMENT.findall(match[1])), _ELEMENT.findall(match[2])[0]] += 1
    return counts


def assert_all_half(counts):
    # Half operands; results in the reduce dtype, by default the compute dtype.
    assert counts and set(counts) == {(("bf16", "bf16"), "bf16")}, counts


def assert_fp8(counts, kept_out=0):
    """Every product FP8 except `kept_out` bf16 ones (a rule); forward e4m3 x e4m3,
    every backward product one e5m2 (the output gradient) and one e4m3 operand;
    results in the reduce dtype (the compute dtype, bf16)."""
    fwd = counts.pop((("f8E4M3FN", "f8E4M3FN"), "bf16"), 0)
    bwd = sum(
        counts.pop(((a, b), "bf16"), 0) for a, b in [("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")]
    )
    others = sum(counts.values())
    assert fwd > 0 and bwd == 2 * fwd, (fwd, bwd, counts)
    assert others == kept_out, counts
    assert all(ops == ("bf16", "bf16") for ops, _ in counts), counts
    return fwd


@pytest.fixture(scope="module")
def lm():
    return load_script("examples/transformer_lm.py", "transformer_lm")


@pytest.fixture(scope="module")
def lm_setup(lm):
    batches, _, vocab_size = lm.make_data(1)
    model = lm.make_model(vocab_size)
    params = lm.init_params(model, "float32")
    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale())
    return model, params, tx, tx.init(params), batches[0]


def lowered_train_step(lm, apply, params, tx, opt_state, batch) -> str:
    """The example's README train step around `apply` (the benchmark's), jitted and lowered."""
    step = import_benchmark("transformer").make_train_step(lm, apply, tx)
    return step.lower(params, opt_state, batch).as_text()


# The example Transformer: 2 blocks x (q, k, v, 2 attention einsums, out, 2 MLP) + head.
LM_FORWARD_DOTS = 17


@pytest.mark.parametrize("transform", ["with_policy", "autocast"])
def test_transformer_m_bf16_every_dot_half_operands_f32_result(lm, lm_setup, transform):
    model, params, tx, opt_state, batch = lm_setup
    apply = getattr(jmp, transform)(model.apply, M_BF16)
    counts = dot_types(lowered_train_step(lm, apply, params, tx, opt_state, batch))
    assert_all_half(counts)
    assert sum(counts.values()) == 3 * LM_FORWARD_DOTS  # forward, d lhs, d rhs


@pytest.mark.parametrize("policy", ["mixed_float8", "mixed_float8_rowwise"])
@pytest.mark.parametrize("transform", ["with_policy", "autocast"])
def test_transformer_mixed_float8_every_dot_fp8(lm, lm_setup, transform, policy):
    model, params, tx, opt_state, batch = lm_setup
    apply = getattr(jmp, transform)(model.apply, policy)
    counts = dot_types(lowered_train_step(lm, apply, params, tx, opt_state, batch))
    assert assert_fp8(counts) == LM_FORWARD_DOTS


def test_transformer_mixed_float8_rule_keeps_head_in_bf16(lm, lm_setup):
    model, params, tx, opt_state, batch = lm_setup
    apply = jmp.with_policy(model.apply, "mixed_float8", rules={"head": "mixed_bfloat16"})
    counts = dot_types(lowered_train_step(lm, apply, params, tx, opt_state, batch))
    # The head: its forward product and its two backward products, in bfloat16.
    assert assert_fp8(counts, kept_out=3) == LM_FORWARD_DOTS - 1


def test_hand_wired_dot_general_follows_the_policy(lm, lm_setup):
    # The benchmark's f32acc model (the package's copy of the example's model,
    # with half_dot_general wired in by hand): the policy's matmul dtype
    # decides, as `dtype` does.
    model, params, tx, opt_state, batch = lm_setup
    wired = transformer_lm.make_model(model.vocab_size, dot_general=jmp.half_dot_general)
    apply = jmp.with_policy(wired.apply, "mixed_float8")
    counts = dot_types(lowered_train_step(lm, apply, params, tx, opt_state, batch))
    assert assert_fp8(counts) == LM_FORWARD_DOTS


class NnxLM(nnx.Module):
    """Embedding, LayerNorm, attention (dropout: Flax's einsum path), MLP, head."""

    def __init__(self, rngs: nnx.Rngs, vocab=32, dim=16, heads=2):
        self.embed = nnx.Embed(vocab, dim, rngs=rngs)
        self.norm = nnx.LayerNorm(dim, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            heads, dim, decode=False, dropout_rate=0.1, deterministic=False, rngs=rngs
        )
        self.mlp = nnx.Linear(dim, 2 * dim, rngs=rngs)
        self.proj = nnx.LinearGeneral(2 * dim, dim, rngs=rngs)
        self.head = nnx.Linear(dim, vocab, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.attn(self.norm(h))
        h = h + self.proj(nnx.gelu(self.mlp(h)))
        return self.head(h)


NNX_TOKENS = jnp.asarray(np.random.default_rng(3).integers(0, 32, (4, 8)), jnp.int32)
# q, k, v, 2 einsums, out, mlp, proj, head
NNX_FORWARD_DOTS = 9


def nnx_dot_types(policy, rules=None) -> collections.Counter:
    model = jnnx.PolicyModule(NnxLM(nnx.Rngs(0, dropout=1)), policy, rules=rules)
    optimizer = nnx.Optimizer(
        model, jmp.loss_scaled(optax.sgd(0.1), jmp.NoOpLossScale()), wrt=nnx.Param
    )

    def step(model, optimizer, tokens):
        def loss_fn(model):
            logits = model(tokens)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens).mean()

        loss, grads = nnx.value_and_grad(loss_fn)(model)
        optimizer.update(model, grads)
        return loss

    return dot_types(nnx.jit(step).lower(model, optimizer, NNX_TOKENS).as_text())


def test_nnx_m_bf16_every_dot_half_operands_f32_result():
    counts = nnx_dot_types(M_BF16)
    assert_all_half(counts)
    assert sum(counts.values()) == 3 * NNX_FORWARD_DOTS


def test_nnx_mixed_float8_every_dot_fp8_and_rule_keeps_head_out():
    assert assert_fp8(nnx_dot_types("mixed_float8")) == NNX_FORWARD_DOTS
    assert assert_fp8(nnx_dot_types("mixed_float8_rowwise")) == NNX_FORWARD_DOTS
    counts = nnx_dot_types("mixed_float8", rules={"head": "mixed_bfloat16"})
    assert assert_fp8(counts, kept_out=3) == NNX_FORWARD_DOTS - 1


def test_linen_conv_under_fp8_runs_in_compute_dtype():
    model = nn.Sequential([nn.Conv(4, (3,)), nn.Dense(2)])
    x = jnp.ones((2, 5, 3))
    variables = model.init(jax.random.key(0), x)
    text = jax.jit(jmp.with_policy(model.apply, "mixed_float8")).lower(variables, x).as_text()
    conv = [line for line in text.splitlines() if "stablehlo.convolution" in line]
    assert len(conv) == 1 and "xbf16>" in conv[0] and "f8" not in conv[0], conv
    assert dot_types(text) == {(("f8E4M3FN", "f8E4M3FN"), "bf16"): 1}  # The reduce dtype.


# ---------------------------------------------------------------- numerics

# (lhs shape, rhs shape, dimension numbers): a matmul, a batched matmul, both
# operands contracted on their first/last axes (a transposed product), and
# attention's 'bqhd,bkhd->bhqk' (two batch axes).
CASES = [
    ((64, 256), (256, 48), (((1,), (0,)), ((), ()))),
    ((4, 32, 128), (4, 128, 24), (((2,), (1,)), ((0,), (0,)))),
    ((512, 40), (24, 512), (((0,), (1,)), ((), ()))),
    ((2, 16, 4, 64), (2, 12, 4, 64), (((3,), (3,)), ((0, 2), (0, 2)))),
]
U_E4M3, U_E5M2 = 2.0**-4, 2.0**-3  # unit roundoff: 3 and 2 mantissa bits
# Half the subnormal spacing (2^-9 for e4m3, 2^-16 for e5m2): the absolute
# rounding error below the normal range.
TINY_E4M3, TINY_E5M2 = 2.0**-10, 2.0**-17


# numpy's generator: jax.random's compile once per shape and dominate the time.
def _normal(rng, shape):
    return jnp.asarray(rng.standard_normal(shape), F32)


def _integers(rng, shape, bound):
    return jnp.asarray(rng.integers(-bound, bound + 1, shape), F32)


def _error_bound(x, u, tiny, fp8_max):
    """Elementwise |round(x) - x| bound for per-tensor scaling: u|x| + scale * tiny."""
    scale = float(fp8_scale(x, fp8_max))
    return u * np.abs(np.asarray(x, np.float64)) + scale * tiny


@functools.partial(jax.jit, static_argnums=(0, 4))
def _fp8_and_reference(dims, x, w, g, scaling="tensor"):
    """`(y, (dx, dw))` of fp8_dot_general and of the float32 product, for cotangent `g`."""
    y, vjp = jax.vjp(lambda x, w: jmp.fp8_dot_general(x, w, dims, scaling=scaling), x, w)
    ref, ref_vjp = jax.vjp(lambda x, w: lax.dot_general(x, w, dims, lax.Precision.HIGHEST), x, w)
    return (y, vjp(g)), (ref, ref_vjp(g))


def _dot64(a, b, dims):
    return np.asarray(
        lax.dot_general(jnp.asarray(a, F32), jnp.asarray(b, F32), dims, lax.Precision.HIGHEST),
        np.float64,
    )


def _product_bound(a, b, da, db, dims):
    """|â b̂ - a b| <= |Δa||b| + |a||Δb| + |Δa||Δb| per output element, plus the
    float32 accumulation of both sides (K terms: K 2^-23 |a||b|, generous)."""
    a, b = np.abs(np.asarray(a, np.float64)), np.abs(np.asarray(b, np.float64))
    k = int(np.prod([a.shape[d] for d in dims[0][0]]))
    return (
        _dot64(da, b, dims)
        + _dot64(a, db, dims)
        + _dot64(da, db, dims)
        + k * 2.0**-23 * _dot64(a, b, dims)
    )


@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
@pytest.mark.parametrize("case", CASES, ids=["matmul", "batched", "transposed", "attention"])
def test_fp8_error_within_rounding_bounds(case, scaling):
    """The error bounds, derived.

    Per element: the scale is a power of two, so x / s is exact and the only
    error is rounding to e4m3, |Δx| <= 2^-4 |x| (3 mantissa bits) in the
    normal range and half the subnormal spacing below it. The products of
    two e4m3 numbers are exact in float32; the scales are powers of two.
    So each output element's error is at most |Δa||b| + |a||Δb| + |Δa||Δb|
    (a rigorous bound, checked elementwise) plus float32 accumulation.

    In norm: with independent zero-mean rounding errors δ, ε (round to nearest
    of continuous values), E||Ŷ - Y||² = Σ x²w²E(δ² + ε²) <= (u_a² + u_b²) Σ x²w²,
    and for independent Gaussian operands E Σ_k x_ik² w_kj² = K = E(Σ_k x_ik
    w_kj)², so ||Ŷ - Y||_F / ||Y||_F <~ sqrt(u_a² + u_b²): sqrt(2) 2^-4 = 0.088
    forward (e4m3 x e4m3) and sqrt(2^-6 + 2^-8) = 0.140 backward (e5m2 x
    e4m3). Measured: about 0.04 and 0.05 (E δ² is about u²/3, not u²).
    Row-wise scales are at most the tensor's, so its bounds hold for them.
    """
    lhs_shape, rhs_shape, dims = case
    rng = np.random.default_rng(0)
    x, w = _normal(rng, lhs_shape), _normal(rng, rhs_shape)
    out_shape = jax.eval_shape(lambda x, w: lax.dot_general(x, w, dims), x, w).shape
    g = _normal(rng, out_shape)
    (y, (gx, gw)), (ref, (rx, rw)) = _fp8_and_reference(dims, x, w, g, scaling)
    assert y.dtype == F32
    dx_, dw_ = (
        _error_bound(x, U_E4M3, TINY_E4M3, E4M3_MAX),
        _error_bound(w, U_E4M3, TINY_E4M3, E4M3_MAX),
    )
    err = np.abs(np.asarray(y, np.float64) - np.asarray(ref, np.float64))
    assert (err <= _product_bound(x, w, dx_, dw_, dims)).all()
    rel = np.linalg.norm(err) / np.linalg.norm(ref)
    assert rel <= np.sqrt(2) * U_E4M3, rel

    dg = _error_bound(g, U_E5M2, TINY_E5M2, E5M2_MAX)
    for got, want, (a, da, b, db, d) in [
        (gx, rx, (g, dg, w, dw_, None)),
        (gw, rw, (x, dx_, g, dg, None)),
    ]:
        assert got.dtype == F32 and got.shape == want.shape
        rel = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(want)
        assert rel <= np.sqrt(U_E4M3**2 + U_E5M2**2), rel
    # Elementwise for the input gradient of the plain matmul: dX = G W^T.
    if dims == (((1,), (0,)), ((), ())):
        t = (((1,), (1,)), ((), ()))
        bound = _product_bound(g, w, dg, dw_, t)
        assert (np.abs(np.asarray(gx, np.float64) - np.asarray(rx, np.float64)) <= bound).all()
        bound = _product_bound(np.asarray(x).T, g, dx_.T, dg, (((1,), (0,)), ((), ())))
        assert (np.abs(np.asarray(gw, np.float64) - np.asarray(rw, np.float64)) <= bound).all()


@pytest.mark.parametrize("scaling", ["tensor", "rowwise"])
@pytest.mark.parametrize("case", CASES, ids=["matmul", "batched", "transposed", "attention"])
def test_fp8_exact_on_fp8_numbers(case, scaling):
    """Integers up to 16 are e4m3 numbers (4 significant bits), up to 8 e5m2
    ones; times any power of two (the scale is one), the products are exact."""
    lhs_shape, rhs_shape, dims = case
    rng = np.random.default_rng(1)
    out_shape = jax.eval_shape(
        lambda x, w: lax.dot_general(x, w, dims), jnp.ones(lhs_shape), jnp.ones(rhs_shape)
    ).shape
    for power in (-7, 9):
        x = _integers(rng, lhs_shape, 16) * 2.0**power
        w = _integers(rng, rhs_shape, 16) * 2.0**-3
        g = _integers(rng, out_shape, 8) * 2.0**-power
        (y, grads), (ref, ref_grads) = _fp8_and_reference(dims, x, w, g, scaling)
        np.testing.assert_array_equal(y, ref)
        for got, want in zip(grads, ref_grads):
            np.testing.assert_array_equal(got, want)


def test_fp8_dot_general_dtypes_and_fallbacks():
    dims = (((1,), (0,)), ((), ()))
    x, w = jnp.ones((2, 3), BF16), jnp.ones((3, 4), BF16)
    assert jmp.fp8_dot_general(x, w, dims).dtype == BF16
    assert jmp.fp8_dot_general(x, w, dims, preferred_element_type=F32).dtype == F32
    assert jax.grad(lambda w: jmp.fp8_dot_general(x, w, dims).astype(F32).sum())(w).dtype == BF16
    # All zeros: scale 1, no NaN from 0 / 0.
    z = jmp.fp8_dot_general(jnp.zeros((2, 3)), jnp.zeros((3, 4)), dims)
    assert (z == 0).all()
    ints = jmp.fp8_dot_general(jnp.ones((2, 3), jnp.int32), jnp.ones((3, 4), jnp.int32), dims)
    assert ints.dtype == jnp.int32 and int(ints[0, 0]) == 3
    # The FP8 operands go into the product directly.
    text = jax.jit(lambda x, w: jmp.fp8_dot_general(x, w, dims)).lower(x, w).as_text()
    assert dot_types(text) == {(("f8E4M3FN", "f8E4M3FN"), "f32"): 1}
    # Drop-ins: the dtype lax gives, float16 with bfloat16 included.
    f16 = jnp.ones((2, 3), jnp.float16)
    for drop_in in (jmp.fp8_dot_general, jmp.half_dot_general):
        for a, b in ((f16, w), (w.T, f16.T)):
            assert drop_in(a, b, dims).dtype == jax.lax.dot_general(a, b, dims).dtype


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
@pytest.mark.parametrize("scaling", ["tensor", "rowwise", "mxfp8", "nvfp4"])
def test_fp8_non_finite_operand_propagates(bad, scaling):
    dims = (((1,), (0,)), ((), ()))
    x = jnp.ones((4, 8)).at[1, 2].set(bad)
    y = jmp.fp8_dot_general(x, jnp.ones((8, 3)), dims, scaling=scaling)
    assert not np.isfinite(np.asarray(y)).all()
    # A non-finite output gradient reaches both cotangents.
    _, vjp = jax.vjp(
        lambda x, w: jmp.fp8_dot_general(x, w, dims, scaling=scaling),
        jnp.ones((4, 8)),
        jnp.ones((8, 3)),
    )
    gx, gw = vjp(jnp.ones((4, 3)).at[0, 0].set(bad))
    assert not np.isfinite(np.asarray(gx)).all() and not np.isfinite(np.asarray(gw)).all()


def test_fp8_scale_is_power_of_two_covering_amax():
    for amax in [1e-30, 0.3, 1.0, 448.0, 449.0, 3e5]:
        s = float(fp8_scale(jnp.array([amax, -0.5 * amax], F32), E4M3_MAX))
        assert s >= amax / E4M3_MAX and s < 2 * amax / E4M3_MAX
        assert np.log2(s) == int(np.log2(s))
    assert float(fp8_scale(jnp.zeros(3), E4M3_MAX)) == 1.0
    assert np.isinf(float(fp8_scale(jnp.array([1.0, np.inf]), E4M3_MAX)))
    assert np.isnan(float(fp8_scale(jnp.array([1.0, np.nan]), E5M2_MAX)))


# ------------------------------------------------------- non-finite steps


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(nn.relu(nn.Dense(16)(x)))


@pytest.mark.parametrize(
    "policy", ["mixed_float8", "mixed_float8_rowwise", "mixed_mxfp8", "mixed_nvfp4"]
)
@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_injected_non_finite_activation_skips_the_step(bad, policy):
    model = Mlp()
    rng = np.random.default_rng(2)
    x, y = _normal(rng, (8, 5)), _normal(rng, (8, 4))
    params = jmp.with_policy(model.init, policy)(jax.random.key(2), x)["params"]
    tx = jmp.loss_scaled(optax.sgd(0.1, momentum=0.9), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(params)
    apply = jmp.with_policy(model.apply, policy)

    @jax.jit
    def step(params, opt_state, x):
        loss_scale = jmp.get_loss_scale(opt_state)

        def loss_fn(p):
            loss = jnp.mean((apply({"params": p}, x) - y) ** 2)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    # The first layer's output (an activation) gets the inf or NaN through its input.
    new_params, new_state, loss = step(params, opt_state, x.at[3, 1].set(bad))
    assert not np.isfinite(float(loss))
    assert int(new_state.total_notfinite) == 1
    for leaf in jax.tree.leaves((new_params, new_state)):
        assert np.isfinite(np.asarray(leaf)).all()
    jax.tree.map(np.testing.assert_array_equal, new_params, params)
    assert float(jmp.get_loss_scale(new_state).loss_scale) == 2.0**14
    # The next, finite, batch is applied.
    newer, state, loss = step(new_params, new_state, x)
    assert np.isfinite(float(loss)) and int(state.total_notfinite) == 1
    assert not np.array_equal(newer["Dense_0"]["kernel"], params["Dense_0"]["kernel"])


def test_with_matmul_dtype():
    policy = jmp.get_policy("mixed_bfloat16").with_matmul_dtype(jnp.float8_e4m3fn)
    assert policy == jmp.get_policy("mixed_float8")
    assert policy.with_matmul_dtype(None) == jmp.get_policy("mixed_bfloat16")
    with pytest.raises(TypeError, match="matmul_dtype"):
        policy.with_matmul_dtype(jnp.float32)


# ------------------------------------------------- the author's explicit precision


class PreciseAngles(nn.Module):
    """RoPE-like angles at `precision=HIGHEST` (an einsum in model code and a
    Dense asking for it), beside an ordinary Dense."""

    @nn.compact
    def __call__(self, pos, x):
        freqs = jnp.linspace(0.0, 1.0, 16, dtype=jnp.float32)
        angles = jnp.einsum("p,f->pf", pos, freqs, precision=lax.Precision.HIGHEST)
        exact = nn.Dense(16, precision=lax.Precision.HIGHEST, name="exact")(jnp.sin(angles))
        return exact + nn.Dense(16, name="plain")(x)


# The author's precision wins under every policy and front end: the exact
# Dense computes in float32 (the plain one in the policy's dtype).
@pytest.mark.parametrize(
    ("front_end", "policy"),
    [
        (front_end, policy)
        for front_end in ("with_policy", "autocast", "nnx")
        for policy in ("mixed_bfloat16", "p=f32,c=f32,o=f32,m=bf16", "mixed_float8")
    ],
)
@jax.numpy_dtype_promotion("standard")  # The exact Dense's float32 meets the plain one's bf16.
def test_a_product_the_author_asks_at_highest_stays_float32(front_end, policy):
    pos, x = jnp.arange(257, dtype=jnp.float32), jnp.ones((257, 8), jnp.float32)
    if front_end == "nnx":
        model = jnnx.PolicyModule(NnxPreciseAngles(nnx.Rngs(0)), policy)
        graphdef, state = nnx.split(model)
        text = jax.jit(lambda s, p, x: nnx.merge(graphdef, s)(p, x)).lower(state, pos, x)
        dots = [op for op in hlo_ops(text.as_text()) if op.name == "dot_general"]
    else:
        params = PreciseAngles().init(jax.random.key(0), pos, x)
        wrap = jmp.with_policy if front_end == "with_policy" else jmp.autocast
        dots = [op for op in lowered_ops(wrap(PreciseAngles().apply, policy), params, pos, x)
                if op.name == "dot_general"]  # fmt: skip
    # The einsum and the exact Dense as written, at HIGHEST; the plain Dense in the policy's.
    kept = [op for op in dots if "HIGHEST" in op.line]
    assert len(kept) == 2 and all(op.operand_types == ("f32", "f32") for op in kept), dots
    assert len(dots) == 3 and next(op for op in dots if op not in kept).operand_types != (
        "f32",
        "f32",
    )


class NnxPreciseAngles(nnx.Module):
    def __init__(self, rngs):
        self.exact = nnx.Linear(16, 16, precision=lax.Precision.HIGHEST, rngs=rngs)
        self.plain = nnx.Linear(8, 16, rngs=rngs)

    def __call__(self, pos, x):
        freqs = jnp.linspace(0.0, 1.0, 16, dtype=jnp.float32)
        angles = jnp.einsum("p,f->pf", pos, freqs, precision=lax.Precision.HIGHEST)
        return self.exact(jnp.sin(angles)) + self.plain(x)


@pytest.mark.parametrize(
    "policy",
    ["mixed_bfloat16", "p=f32,c=f32,o=f32,m=bf16", "p=f32,c=f32,o=f32,m=f8", "mixed_float8"],
)
def test_angles_at_highest_keep_float32_accuracy(policy):
    # sin(256 f) needs the angle to float32 accuracy: in bf16 or FP8 it is off by ~1.
    def angles(pos, freqs):
        return jnp.sin(jnp.einsum("p,f->pf", pos, freqs, precision=lax.Precision.HIGHEST))

    pos, freqs = jnp.arange(257, dtype=jnp.float32), jnp.linspace(0.0, 1.0, 64)
    want = angles(pos, freqs)
    fns = [jmp.autocast(angles, policy)]
    if jmp.get_policy(policy).compute_dtype == jnp.float32:
        # (with_policy casts a plain function's inputs to the compute dtype.)
        fns.append(jmp.with_policy(angles, policy))
    for fn in fns:
        assert float(jnp.max(jnp.abs(jax.jit(fn)(pos, freqs) - want))) == 0.0


@pytest.mark.parametrize(
    "policy, want",
    [
        ("p=f32,c=bf16,o=f32,m=bf16", ("bf16", "bf16")),
        ("mixed_float8", ("f8E4M3FN", "f8E4M3FN")),
    ],
)
@jax.numpy_dtype_promotion("standard")  # int x float, as Hugging Face's models run.
def test_a_product_with_an_integer_operand_takes_the_matmul_dtype(policy, want):
    # Every BERT-family attention: `einsum("...hqk,h->...hqk", weights, head_mask)`.
    class Masked(nn.Module):
        @nn.compact
        def __call__(self, x, head_mask):
            weights = nn.Dense(4)(x).reshape(2, 2, 2, 2)
            return jnp.einsum("bhqk,h->bhqk", weights, head_mask)

    x, mask = jnp.ones((2, 2, 3)), jnp.array([1, 0], jnp.int32)
    variables = Masked().init(jax.random.key(0), x, mask)
    apply = jmp.with_policy(Masked().apply, policy)
    ops = [o for o in lowered_ops(apply, variables, x, mask) if o.name == "dot_general"]
    assert len(ops) == 2 and all(o.operand_types == want for o in ops)
    out = apply(variables, x, mask)
    np.testing.assert_allclose(out, Masked().apply(variables, x, mask), atol=0.1)
    assert float(jnp.abs(out[:, 1]).max()) == 0.0  # The masked head, exactly.
    # Under autocast, also without a matmul dtype: the mask joins bf16.
    ops = lowered_ops(
        autocast_fn := jmp.autocast(Masked().apply, "mixed_bfloat16"), variables, x, mask
    )
    assert [o.operand_types for o in ops if o.name == "dot_general"] == [("bf16", "bf16")] * 2
    assert autocast_fn(variables, x, mask).dtype == jnp.float32
