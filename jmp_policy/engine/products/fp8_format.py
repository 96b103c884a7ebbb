"""The FP8 formats, current scaling and quantization to them.

A scale is a float32 power of two at least `amax / fp8_max`, so dividing by it
is exact and the only error is the FP8 rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core.dtypes import F32, at_least_normal, pow2_at_least

E4M3 = np.dtype(jnp.float8_e4m3fn)
E5M2 = np.dtype(jnp.float8_e5m2)
# The largest finite values: what a tensor's amax is scaled to (at most).
E4M3_MAX = float(jnp.finfo(E4M3).max)  # 448
E5M2_MAX = float(jnp.finfo(E5M2).max)  # 57344

Dims = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[tuple[int, ...], tuple[int, ...]]]


def fp8_scale(x: jax.Array, fp8_max: float, axes: Sequence[int] | None = None) -> jax.Array:
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

    Returns:
      The float32 scale: a scalar, or `x`'s shape with `axes` of size 1.
    """
    x = lax.stop_gradient(x)
    # `initial=0`: the identity of a max of magnitudes, so an empty `x` has scale 1.
    amax = jnp.max(jnp.abs(x.astype(F32)), axis=None if axes is None else tuple(axes),
                   keepdims=axes is not None, initial=0.0)  # fmt: skip
    return pow2_at_least(at_least_normal(amax, amax / np.float32(fp8_max)))


def fp8_quantize(x: jax.Array, scale: jax.Array, dtype: np.dtype, fp8_max: float) -> jax.Array:
    """`x / scale` rounded to the FP8 `dtype` (`scale` broadcasts against `x`).

    A finite `x / scale` is within +-fp8_max (the scale covers the amax); the
    clip only guards the float32 rounding at the edge, and keeps NaN (an inf
    operand has an inf scale, so inf / inf is NaN: non-finite stays so).
    """
    scaled = x.astype(F32) / scale
    return lax.convert_element_type(jnp.clip(scaled, -fp8_max, fp8_max), dtype)
