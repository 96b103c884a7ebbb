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

The products are `shard_local`'s (`BlockScaling` is the quantizer): under
`jit` over a mesh each device forms the blocks of the part of an operand it
holds, along the contraction, so no block straddles devices and no weight is
gathered in a block layout of its own. What the forward pass saves is
`residuals`' choice, as there: the quantized copies the backward products
take (and the operands, for a partitioned backward pass), or the operands,
quantized again in the backward pass, for forward-over-reverse
differentiation.
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
from jmp_policy.core.dtypes import F32, at_least_normal, cast, pow2_at_least
from jmp_policy.engine.products import cpu_form, shard_local
from jmp_policy.engine.products.half import shared_factory

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
# Its signs as the bits of one number: the traced matrix holds no array
# constant (a `custom_partitioning`'s function may not).
_RHT_SIGNS = sum(1 << i for i, row in enumerate(_RHT) if row[0] < 0)


def _traced_hadamard_16() -> jax.Array:
    """`_RHT`, computed in the program from indices."""
    i = lax.broadcasted_iota(np.uint32, (16, 16), 0)
    j = lax.broadcasted_iota(np.uint32, (16, 16), 1)
    odd = lax.population_count(i & j) & np.uint32(1)
    negative = odd ^ (lax.shift_right_logical(np.uint32(_RHT_SIGNS), i) & np.uint32(1))
    return jnp.where(negative == 1, np.float32(-0.25), np.float32(0.25))


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
            rht = _traced_hadamard_16()
            x = jnp.matmul(x.reshape(*x.shape[:-1], -1, 16), rht, precision="highest")
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


_BATCHED = (((2,), (2,)), ((0,), (0,)))  # (B, M, K) x (B, N, K) -> (B, M, N)


def _emulated_matmul(a, b, a_scales, b_scales, *, results):
    """`jax.nn.scaled_matmul`'s arithmetic in float32: what JAX's own CPU form does
    (jax 0.12), and what jax 0.10 has none of."""

    def dequantized(x, scales):
        blocks = x.astype(F32).reshape(*scales.shape, -1) * scales.astype(F32)[..., None]
        return blocks.reshape(x.shape)

    a, b = dequantized(a, a_scales), dequantized(b, b_scales)
    return lax.dot_general(a, b, _BATCHED, lax.Precision.HIGHEST, preferred_element_type=results)


# ------------------------------------------------------------ the product


def _as_rows(x: jax.Array, dims: Any, side: str) -> jax.Array:
    """`side`'s operand of a `dot_general` laid out as `(batch, rows, contraction)`."""
    (lc, rc), (lb, rb) = dims
    contracting, batch = (lc, lb) if side == "lhs" else (rc, rb)
    free = [d for d in range(x.ndim) if d not in (*contracting, *batch)]
    sizes = [math.prod(x.shape[a] for a in axes) for axes in (batch, free, contracting)]
    return lax.transpose(x, (*batch, *free, *contracting)).reshape(sizes)


@dataclasses.dataclass(frozen=True)
class BlockScaling:
    """A block format as a quantizer of `shard_local`'s products: an operand's
    copy is its `Blocks` along the product's contraction."""

    fmt: BlockFormat
    stochastic: bool = False
    hadamard: bool = False
    arity = 3  # arrays in a copy
    per_tensor = False  # a copy's blocks run along one product's contraction

    def copy(self, x: jax.Array, dims: Any, side: str) -> tuple[jax.Array, ...]:
        rows = _as_rows(x, dims, side)
        return tuple(
            quantize_blocks(rows, self.fmt, stochastic=self.stochastic, hadamard=self.hadamard)
        )

    def gathered_copy(
        self, x: jax.Array, dims: Any, side: str, gather: Any
    ) -> tuple[jax.Array, ...]:
        """The copy of the whole of a sharded operand, from the shard `x`:
        gathered (`shard_local.Gather`), then quantized (a block may straddle
        shards)."""
        return self.copy(gather(x), dims, side)

    def product(
        self, dims: Any, precision: Any, results: np.dtype, lhs: Any, rhs: Any, out_shape: Any
    ) -> jax.Array:
        """The product of two copies, scaled back, in `results`."""
        del dims, precision
        return block_matmul(Blocks(*lhs), Blocks(*rhs), results).reshape(out_shape).astype(results)


def _recipe(fmt: BlockFormat) -> shard_local.Recipe:
    """Gradients: stochastic rounding under NVFP4. The product contracting the
    rows (`d rhs`): the Hadamard transform on both operands under NVFP4."""
    nvfp4 = fmt is NVFP4
    plain = BlockScaling(fmt)
    return shard_local.Recipe(
        forward=(plain, plain),
        d_lhs=(BlockScaling(fmt, stochastic=nvfp4), plain),
        d_rhs=(
            BlockScaling(fmt, stochastic=nvfp4, hadamard=nvfp4),
            BlockScaling(fmt, hadamard=nvfp4),
        ),
    )


RECIPES = {name: _recipe(fmt) for name, fmt in FORMATS.items()}


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
    each block-scaled product gives its results in `results_dtype`, each
    device's blocks its own where `jit` partitions it (`shard_local`)."""
    if 0 in lhs.shape or 0 in rhs.shape:
        # Nothing to scale: the (empty, or all-zero) product itself.
        return cast(lax.dot_general(lhs, rhs, dims, preferred_element_type=F32), out_dtype)
    f = _shared_block_product(
        dims, np.dtype(out_dtype), fmt, residuals, np.dtype(results_dtype), out_sharding,
        # A trace made under the other setting of the CPU form is not reused.
        cpu_form=cpu_form.in_use(),
    )  # fmt: skip
    return f(lhs, rhs)


@shared_factory
def _shared_block_product(
    dims: Any,
    out_dtype: np.dtype,
    fmt: str,
    residuals: str,
    results: np.dtype,
    out_sharding: Any,
    *,
    cpu_form: bool,
) -> Callable:
    """One signature's product: an inlined `jax.jit`, traced once per shape."""
    del cpu_form  # Only a key: the tangent products read the setting as they trace.
    return ji.inlined_jit(
        functools.partial(
            shard_local.product, dims=dims, out_dtype=out_dtype, recipe=RECIPES[fmt],
            precision=None, residuals=residuals, results=results, out_sharding=out_sharding,
        )
    )  # fmt: skip
