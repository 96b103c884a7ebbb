"""The FP8 formats, current scaling and quantization to them.

A scale is a float32 power of two at least `amax / fp8_max`, so dividing by it
is exact and the only error is the FP8 rounding.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core.dtypes import F32, at_least_normal, pow2_at_least
from jmp_policy.engine.products.half import dot_product

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
# The largest finite values: what a tensor's amax is scaled to (at most).
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def fp8_scale(
    x: jax.Array,
    fp8_max: float,
    axes: Sequence[int] | None = None,
    mesh_axes: tuple[str, ...] = (),
) -> jax.Array:
    """The scale of `x` for an FP8 format: a float32 power of two, per tensor or per row.

    The smallest power of two `s >= amax(|x|) / fp8_max`, so `x / s` fits the
    format and dividing by it is exact (the only error is the FP8 rounding).
    1 where the values it covers are all zeros, or none (a zero-size `x`). A
    non-finite amax is kept as the scale (never clipped): the product is
    multiplied by it, so an inf or NaN in `x` makes the result non-finite and
    `loss_scaled` skips the step.
    A constant for differentiation.

    Args:
      x: the array.
      fp8_max: the format's largest finite value (`E4M3_MAX`, `E5M2_MAX`).
      axes: the axes the amax is taken over, kept as size 1 (one scale per
        row of the others); None: all of them, and a scalar scale.
      mesh_axes: where `x` is a shard (inside a partitioned or mapped
        function), the mesh axes it is sharded over: the amax is then the
        maximum over the shards (one all-reduce).

    Returns:
      The float32 scale: a scalar, or `x`'s shape with `axes` of size 1.
    """
    x = lax.stop_gradient(x)
    # `initial=0`: the identity of a max of magnitudes, so an empty `x` has scale 1.
    amax = jnp.max(jnp.abs(x.astype(F32)), axis=None if axes is None else tuple(axes),
                   keepdims=axes is not None, initial=0.0)  # fmt: skip
    if mesh_axes:
        amax = lax.pmax(amax, mesh_axes)
    return pow2_at_least(at_least_normal(amax, amax / np.float32(fp8_max)))


def fp8_quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype, fp8_max: float) -> jax.Array:
    """`x / scale` rounded to the FP8 `dtype` (`scale` broadcasts against `x`).

    A finite `x / scale` is within +-fp8_max (the scale covers the amax); the
    clip only guards the float32 rounding at the edge, and keeps NaN (an inf
    operand has an inf scale, so inf / inf is NaN: non-finite stays so).
    """
    scaled = x.astype(F32) / scale
    return lax.convert_element_type(jnp.clip(scaled, -fp8_max, fp8_max), dtype)


@dataclasses.dataclass(frozen=True)
class TensorScaling:
    """An FP8 format with one scale per tensor: an operand's copy is
    `(elements, scale)`. `per_tensor`: a copy serves every product, and a
    sharded operand's copy is made where its shards are (the scale one max
    over them), then gathered in FP8."""

    dtype: np.dtype
    fp8_max: float
    arity = 2  # arrays in a copy
    per_tensor = True

    def copy(self, x: jax.Array, dims: Dims, side: str) -> tuple[jax.Array, ...]:
        del dims, side
        scale = fp8_scale(x, self.fp8_max)
        return fp8_quantize(x, scale, self.dtype, self.fp8_max), scale

    def gathered_copy(
        self, x: jax.Array, dims: Dims, side: str, gather: Any
    ) -> tuple[jax.Array, ...]:
        """The copy of the whole of a sharded operand, from the shard `x`
        (`gather`: `shard_local.Gather`): the shards share the tensor's scale
        and send their elements in FP8."""
        del dims, side
        scale = fp8_scale(x, self.fp8_max, mesh_axes=gather.axes)
        return gather(fp8_quantize(x, scale, self.dtype, self.fp8_max)), scale

    def product(
        self, dims: Dims, precision: Any, results: np.dtype, lhs: Any, rhs: Any, out_shape: Any
    ) -> jax.Array:
        """The product of two copies, scaled back, in `results`."""
        del out_shape
        (ql, sl), (qr, sr) = lhs, rhs
        product = dot_product(dims, precision)(ql, qr, results)
        # One scale after the other: their product could underflow on its own.
        return (product.astype(F32) * sl * sr).astype(results)


E4M3_SCALING = TensorScaling(E4M3, E4M3_MAX)
E5M2_SCALING = TensorScaling(E5M2, E5M2_MAX)
