"""Grouped products (a mixture of experts' `ragged_dot`), in both passes.

Half operands with float32 accumulation, or, under any FP8 or FP4 matmul
dtype, FP8 per tensor with current scaling: e4m3 operands forward, an e5m2
output gradient backward, the scales applied to the float32 result. The
block formats (MXFP8, NVFP4) and row-wise scales lay their scales along
dimensions a grouped product splits between experts, so they give way to
per-tensor FP8 here (torchao's grouped FP8 GEMMs are per tensor or per row
too). The group sizes are arguments of the custom VJP, never closed over: a
grouped product inside a `shard_map` is differentiated outside it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32, SCALED_MATMUL_DTYPES, cast
from jmp_policy.engine.products.fp8 import transposed_product
from jmp_policy.engine.products.fp8_format import (
    E4M3_SCALING,
    E5M2_SCALING,
    TensorScaling,
    fp8_quantize,
    fp8_scale,
)
from jmp_policy.engine.products.half import decided, product_of

_NO_FORWARD_MODE = (
    "Forward-mode differentiation (jax.jvp, jax.jacfwd) through jmp_policy's grouped "
    "products (ragged_dot under a policy) is not supported: they carry a "
    "jax.custom_vjp. Use reverse mode (jax.grad, jax.vjp)."
)


def grouped_product(
    eqn: ji.JaxprEqn,
    lhs: jax.Array,
    rhs: jax.Array,
    extra: Sequence[Any],
    operand_dtype: np.dtype,
    out_dtype: np.dtype,
    results: np.dtype,
) -> jax.Array:
    """The `ragged_dot_general` of `eqn` on `lhs`, `rhs` and its other operands
    `extra` (group sizes), its operands in `operand_dtype` (half, or an FP8 or
    FP4 matmul dtype: FP8 per tensor) in both passes, float32 accumulation;
    the result in `results`, then `out_dtype`."""
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype
    scaled = operand_dtype in SCALED_MATMUL_DTYPES

    def copy(x: Any, scaling: TensorScaling) -> tuple[Any, Any]:
        if not scaled:
            return cast(x, operand_dtype), None
        scale = fp8_scale(x, scaling.fp8_max)
        return fp8_quantize(x, scale, scaling.dtype, scaling.fp8_max), scale

    def rescaled(product: Any, *scales: Any) -> Any:
        if not scaled:
            return product
        # One scale after the other: their product could underflow on its own.
        return (product.astype(F32) * scales[0] * scales[1]).astype(results)

    @jax.custom_vjp
    def f(lhs, rhs, *extra):
        return fwd(lhs, rhs, *extra)[0]

    def fwd(lhs, rhs, *extra):
        (ql, sl), (qr, sr) = copy(lhs, E4M3_SCALING), copy(rhs, E4M3_SCALING)
        out = rescaled(product_of(eqn, extra)(ql, qr, F32 if scaled else results), sl, sr)
        return cast(out, out_dtype), (ql, sl, qr, sr, extra)

    def bwd(res, g):
        ql, sl, qr, sr, extra = res
        product = product_of(eqn, extra)
        qg, sg = copy(g, E5M2_SCALING)
        accumulate = F32 if scaled else results
        d_lhs = rescaled(transposed_product(product, ql, qr, "lhs", accumulate)(qg, qr), sg, sr)
        d_rhs = rescaled(transposed_product(product, ql, qr, "rhs", accumulate)(qg, ql), sg, sl)
        return (cast(d_lhs, lhs_dtype), cast(d_rhs, rhs_dtype), *(None for _ in extra))

    f.defvjp(fwd, decided(bwd))
    try:
        return f(lhs, rhs, *extra)
    except TypeError as e:
        if not ji.is_forward_mode_of_custom_vjp(e):
            raise
        raise TypeError(_NO_FORWARD_MODE) from e
