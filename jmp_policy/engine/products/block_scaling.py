"""Block-scaled matrix products: MXFP8 and NVFP4, in both passes.

A block format gives each block of consecutive elements along the
contraction its own scale, so one outlier only coarsens its block:

* MXFP8 (OCP Microscaling Formats v1.0): e4m3 elements, one power-of-two
  scale (float8_e8m0fnu) per 32. The scale is rounded up (the smallest power
  of two with `amax / scale <= 448`), and the gradients are e4m3 too: the
  recipe of Mishra et al., "Recipes for Pre-training LLMs with MXFP8" (2025),
  arXiv:2506.08027, and of Transformer Engine's MXFP8BlockScaling.
* NVFP4: e2m1 elements (at most 6), one float8_e4m3fn scale per 16 and one
  float32 scale per tensor (`amax / (6 * 448)`), after NVIDIA, "Pretraining
  Large Language Models with NVFP4" (2025), arXiv:2509.25149: weights and
  activations rounded to nearest, gradients rounded stochastically, and a
  16-point random Hadamard transform on both operands of the product that
  contracts the rows (the weight gradient of `x @ w`; it leaves the product
  unchanged). Not followed: the paper's 16 x 16 blocks for weights (a
  `dot_general` does not say which operand is the weight).

Each product is `jax.nn.scaled_matmul` on operands laid out as
`(batch, rows, contraction)`, the contraction padded with zeros to whole
blocks. On NVIDIA Blackwell it lowers to cuDNN's block-scaled GEMM; on other
GPUs XLA expands it; on CPU it is emulated here (the elements and scales
converted to float32 and multiplied, as jax 0.12 does and jax 0.10 cannot):
the numbers are the format's, the speed is not. The backward products
quantize the operands again along the dimension each contracts, as the
formats require. (`jax.nn.scaled_dot_general`, around `scaled_matmul`, does
not serve: it asserts whole blocks, takes NVFP4's tensor scale as a fixed
argument, leaves NVFP4's backward products unquantized and rounds nothing
stochastically.)

What the forward pass saves is `residuals`' choice: the quantized copies
the backward products take, or the operands, quantized again in the backward
pass inside a `jax.custom_jvp` whose tangent is the plain product (as in
`fp8`), for forward-over-reverse differentiation.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32, at_least_normal, cast, pow2_at_least, widest
from jmp_policy.engine.products import cpu_form
from jmp_policy.engine.products.half import decided, dot_product, shared_factory
from jmp_policy.engine.residuals import to_be_saved_quantized

E4M3 = np.dtype(jnp.float8_e4m3fn)
E2M1 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)


@dataclasses.dataclass(frozen=True)
class BlockFormat:
    """A block-scaled format: its elements, block size and scales."""

    name: str
    block: int
    element: np.dtype
    element_max: float
    scale: np.dtype
    tensor_scale: bool  # a float32 scale per tensor above the block scales


MXFP8 = BlockFormat("mxfp8", 32, E4M3, 448.0, E8M0, tensor_scale=False)
NVFP4 = BlockFormat("nvfp4", 16, E2M1, 6.0, E4M3, tensor_scale=True)
FORMATS = {f.name: f for f in (MXFP8, NVFP4)}


class Blocks(NamedTuple):
    """An operand `(batch, rows, contraction)` in a block format."""

    data: jax.Array  # (B, R, K padded to whole blocks), the format's elements
    scales: jax.Array  # (B, R, blocks), the format's scale dtype
    tensor_scale: jax.Array  # float32 scalar (1 where the format has none)


# ------------------------------------------------------------ quantizing


def _to_e8m0(scale: jax.Array) -> jax.Array:
    """A float32 power of two as float8_e8m0fnu (its exponent byte; NaN for inf, NaN)."""
    exponent = lax.shift_right_logical(lax.bitcast_convert_type(scale, np.uint32), np.uint32(23))
    return lax.bitcast_convert_type((exponent & 0xFF).astype(np.uint8), E8M0)


def _hash_uniform(x: jax.Array) -> jax.Array:
    """A uniform [0, 1) float32 per element, from its bits and position (murmur3's
    finaliser): stateless noise for stochastic rounding, new wherever the data is."""
    bits = lax.bitcast_convert_type(x, np.uint32)
    index = jnp.zeros(x.shape, np.uint32)
    for axis in range(x.ndim):
        stride = math.prod(x.shape[axis + 1 :])
        index = index + lax.broadcasted_iota(np.uint32, x.shape, axis) * np.uint32(stride)
    h = bits ^ (index * np.uint32(0x9E3779B9))
    for shift, factor in ((16, 0x85EBCA6B), (13, 0xC2B2AE35)):
        h = (h ^ lax.shift_right_logical(h, np.uint32(shift))) * np.uint32(factor)
    h = h ^ lax.shift_right_logical(h, np.uint32(16))
    return lax.shift_right_logical(h, np.uint32(8)).astype(F32) * np.float32(2.0**-24)


def _round_e2m1_stochastically(v: jax.Array) -> jax.Array:
    """`v` (float32 within +-6) on the e2m1 grid, rounded up with probability
    equal to its distance from the value below: unbiased."""
    a = jnp.abs(v)
    step = jnp.where(a < 2, np.float32(0.5), jnp.where(a < 4, np.float32(1), np.float32(2)))
    low = jnp.floor(a / step) * step
    up = _hash_uniform(v) * step < a - low
    return jnp.sign(v) * jnp.minimum(low + jnp.where(up, step, 0), np.float32(6))


def _hadamard_16() -> np.ndarray:
    """A 16 x 16 orthogonal matrix: random signs times the normalised Hadamard matrix."""
    h = np.ones((1, 1))
    for _ in range(4):
        h = np.block([[h, h], [h, -h]])
    signs = np.random.default_rng(0).choice([-1.0, 1.0], 16)
    return (signs[:, None] * h / 4).astype(np.float32)


_RHT = _hadamard_16()
# The name scope of the transform: a program's debug locations show its products.
HADAMARD_SCOPE = "jmp_policy_hadamard"


def _pad_to_blocks(x: jax.Array, block: int) -> jax.Array:
    k = x.shape[-1]
    pad = -k % block
    return x if pad == 0 else jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad)])


def quantize_blocks(
    x: jax.Array, fmt: BlockFormat, *, stochastic: bool = False, hadamard: bool = False
) -> Blocks:
    """`x` (batch, rows, contraction) in `fmt`, along its last axis.

    The contraction is padded with zeros to whole blocks. `hadamard`: the
    16-point random Hadamard transform is applied to each block of 16 first.
    `stochastic`: the elements are rounded stochastically (NVFP4 only).
    Non-finite values make the scales non-finite, so the product is too.
    """
    x = _pad_to_blocks(lax.stop_gradient(x).astype(F32), max(fmt.block, 16 * hadamard))
    if hadamard:
        with jax.named_scope(HADAMARD_SCOPE):
            x = jnp.matmul(x.reshape(*x.shape[:-1], -1, 16), _RHT, precision="highest")
        x = x.reshape(*x.shape[:-2], -1)
    blocks = x.reshape(*x.shape[:-1], -1, fmt.block)
    amax = jnp.max(jnp.abs(blocks), axis=-1, keepdims=True)
    if fmt.tensor_scale:
        largest = jnp.max(amax, initial=0.0)
        tensor_scale = at_least_normal(largest, largest / np.float32(fmt.element_max * 448))
        tensor_scale = jnp.where(tensor_scale == 0, np.float32(1), tensor_scale)
        scales = jnp.minimum(amax / np.float32(fmt.element_max) / tensor_scale, 448).astype(E4M3)
        step = scales.astype(F32) * tensor_scale
        # A block whose scale is 0 (all zeros, or flushed below e4m3's range) is 0.
        scaled = jnp.where(step == 0, 0, blocks / jnp.where(step == 0, 1, step))
    else:
        tensor_scale = jnp.ones((), F32)
        step = pow2_at_least(at_least_normal(amax, amax / np.float32(fmt.element_max)))
        scales, scaled = _to_e8m0(step), blocks / step
    scaled = jnp.clip(scaled, -fmt.element_max, fmt.element_max)
    if stochastic:
        scaled = _round_e2m1_stochastically(scaled)
    data = scaled.astype(fmt.element).reshape(x.shape)
    # XLA may fold `float32 -> element -> float32` into nothing where it
    # expands the product (CPU, GPUs without block-scaled GEMMs): kept.
    data, scales = lax.optimization_barrier((data, scales[..., 0]))
    return Blocks(data, scales, tensor_scale)


def block_matmul(a: Blocks, b: Blocks, results: np.dtype = F32) -> jax.Array:
    """`a @ b.T` per batch, `(B, M, K) x (B, N, K) -> (B, M, N)`, float32.

    The block-scaled product gives its results in `results` (what a sharded
    program sums), the tensor scales are applied after, in float32.
    """
    out = lax.platform_dependent(
        a.data, b.data, a.scales, b.scales,
        cpu=functools.partial(_emulated_matmul, results=results),
        default=functools.partial(_scaled_matmul, results=results),
    )  # fmt: skip
    return _times_tensor_scales(out.astype(F32), a.tensor_scale, b.tensor_scale)


def _times_tensor_scales(out: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    """`out * a * b`: by the scales' product where it is a normal float32 number,
    else one after the other, so that neither an underflowing product nor an
    overflowing `out * a` loses a result in float32's range."""
    both = a * b
    fits = (both >= np.float32(np.finfo(np.float32).tiny)) & jnp.isfinite(both)
    return jnp.where(fits, out * both, out * a * b)


def _scaled_matmul(a, b, a_scales, b_scales, *, results):
    out = jax.nn.scaled_matmul(a, b, a_scales, b_scales, preferred_element_type=results)
    # Inside `shard_map` its result lacks its operands' varying axes (jax 0.12).
    return ji.varying_alike(out, a, b)[0]


def _emulated_matmul(a, b, a_scales, b_scales, *, results):
    """`jax.nn.scaled_matmul`'s arithmetic in float32: what JAX's own CPU form does
    (jax 0.12), and what jax 0.10 has none of."""

    def dequantized(x, scales):
        blocks = x.astype(F32).reshape(*scales.shape, -1) * scales.astype(F32)[..., None]
        return blocks.reshape(x.shape)

    a, b = dequantized(a, a_scales), dequantized(b, b_scales)
    return lax.dot_general(a, b, _BATCHED, lax.Precision.HIGHEST, preferred_element_type=results)


# ------------------------------------------------------------ layouts


class _Layout:
    """A `dot_general`'s operands as `(B, M, K)` and `(B, N, K)`, its result as `(B, M, N)`."""

    def __init__(self, dims: Any, lhs_shape: tuple[int, ...], rhs_shape: tuple[int, ...]):
        (lc, rc), (lb, rb) = dims
        lf = [d for d in range(len(lhs_shape)) if d not in (*lc, *lb)]
        rf = [d for d in range(len(rhs_shape)) if d not in (*rc, *rb)]
        self.lhs_perm, self.rhs_perm = (*lb, *lf, *lc), (*rb, *rf, *rc)
        self.lhs_shape, self.rhs_shape = lhs_shape, rhs_shape

        def size(shape, axes):
            return math.prod(shape[a] for a in axes)

        self.b, self.m, self.k = size(lhs_shape, lb), size(lhs_shape, lf), size(lhs_shape, lc)
        self.n = size(rhs_shape, rf)
        self.out_shape = tuple(lhs_shape[a] for a in (*lb, *lf)) + tuple(rhs_shape[a] for a in rf)

    def lhs(self, x: jax.Array) -> jax.Array:
        return lax.transpose(x, self.lhs_perm).reshape(self.b, self.m, self.k)

    def rhs(self, x: jax.Array) -> jax.Array:
        return lax.transpose(x, self.rhs_perm).reshape(self.b, self.n, self.k)

    def out(self, x: jax.Array) -> jax.Array:
        return x.reshape(self.b, self.m, self.n)

    def back(self, x3: jax.Array, side: str) -> jax.Array:
        """`(B, M, K)` (`side="lhs"`) or `(B, N, K)` back in the operand's own layout."""
        perm, shape = (
            (self.lhs_perm, self.lhs_shape) if side == "lhs" else (self.rhs_perm, self.rhs_shape)
        )
        x = x3.reshape([shape[a] for a in perm])
        return lax.transpose(x, tuple(np.argsort(perm)))


def _t(x: jax.Array) -> jax.Array:
    return jnp.swapaxes(x, 1, 2)


_BATCHED = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)


def _plain(a: jax.Array, b: jax.Array) -> jax.Array:
    """`a @ b.T` per batch in their widest dtype, float32 accumulation."""
    c = widest([a.dtype, b.dtype])
    return dot_product(_BATCHED)(cast(a, c), cast(b, c), F32)


Quantizer = Callable[[jax.Array], Blocks]


def _straight_through(
    a: jax.Array, b: jax.Array, qa: Quantizer, qb: Quantizer, results: np.dtype
) -> jax.Array:
    """`block_matmul(qa(a), qb(b), results)`, whose tangent is the plain product
    of the tangents (the rounding counted as the identity, as in `fp8`)."""

    @jax.custom_jvp
    def f(a, b):
        return block_matmul(qa(a), qb(b), results)

    @f.defjvp
    def f_jvp(primals, tangents):
        (a, b), (da, db) = primals, tangents
        return f(a, b), _plain(da, b) + _plain(a, db)

    return f(a, b)


# ------------------------------------------------------------ the product


def block_scaled_product(
    lhs: jax.Array,
    rhs: jax.Array,
    dims: Any,
    out_dtype: np.dtype,
    fmt: str,
    residuals: str,
    out_sharding: Any = None,
    results_dtype: Any = F32,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dims)` in the block format `fmt`, both passes,
    saving `residuals` (`"quantized"` or `"operands"`) for the backward pass;
    each block-scaled product gives its results in `results_dtype`."""
    f = _shared_block_product(
        dims, np.dtype(out_dtype), fmt, residuals, np.dtype(results_dtype),
        # A trace made under the other setting of the CPU form is not reused.
        cpu_form=cpu_form.in_use(),
    )  # fmt: skip
    out = f(lhs, rhs)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


@shared_factory
def _shared_block_product(
    dims: Any, out_dtype: np.dtype, fmt: str, residuals: str, results: np.dtype, *, cpu_form: bool
) -> Callable:
    """One signature's product: an inlined `jax.jit`, traced once per shape."""
    del cpu_form  # Only a key: the tangent products read the setting as they trace.
    return ji.inlined_jit(
        functools.partial(
            _block_product, dims=dims, out_dtype=out_dtype, fmt=FORMATS[fmt],
            residuals=residuals, results=results,
        )
    )  # fmt: skip


def _block_product(lhs, rhs, *, dims, out_dtype, fmt, residuals, results):
    layout = _Layout(dims, lhs.shape, rhs.shape)
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype
    if 0 in (layout.b, layout.m, layout.n, layout.k):
        # Nothing to scale: the (empty, or all-zero) product itself.
        return cast(lax.dot_general(lhs, rhs, dims, preferred_element_type=F32), out_dtype)
    nvfp4 = fmt is NVFP4
    quantize = functools.partial(quantize_blocks, fmt=fmt)
    # Gradients: stochastic rounding under NVFP4. The product contracting the
    # rows (d rhs): the Hadamard transform on both operands under NVFP4.
    grad = functools.partial(quantize, stochastic=nvfp4)
    grad_rows = functools.partial(quantize, stochastic=nvfp4, hadamard=nvfp4)
    rows = functools.partial(quantize, hadamard=nvfp4)

    @jax.custom_vjp
    def f(lhs, rhs):
        return fwd(lhs, rhs)[0]

    def fwd(lhs, rhs):
        a, b = layout.lhs(lhs), layout.rhs(rhs)
        out = _straight_through(a, b, quantize, quantize, results)
        out = cast(out.reshape(layout.out_shape), out_dtype)
        if residuals == "operands":
            return out, (a, b)
        # The operands as the backward products take them: b along N, a along M.
        a, b = to_be_saved_quantized((a, b))
        return out, (quantize(_t(b)), rows(_t(a)))

    def bwd(res, g):
        g = layout.out(g)
        if residuals == "operands":
            a, b = res
            d_a = _straight_through(g, _t(b), grad, quantize, results)
            d_b = _straight_through(_t(g), _t(a), grad_rows, rows, results)
        else:
            b_t, a_t = res
            d_a = block_matmul(grad(g), b_t, results)
            d_b = block_matmul(grad_rows(_t(g)), a_t, results)
        return (
            cast(layout.back(d_a, "lhs"), lhs_dtype),
            cast(layout.back(d_b, "rhs"), rhs_dtype),
        )

    f.defvjp(fwd, decided(ji.inlined_jit(bwd)))
    return f(lhs, rhs)
