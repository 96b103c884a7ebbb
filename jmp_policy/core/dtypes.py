"""The dtype facts every module shares: which values are floating, and casts.

One definition of "a floating array" for the whole package: a real floating
jax or numpy array, scalar or tracer (not complex, integer, boolean or a
PRNG key).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax import lax

F32 = np.dtype(np.float32)
HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))
# The matmul dtypes whose products need scales: FP8 (e4m3) and FP4 (e2m1).
SCALED_MATMUL_DTYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float4_e2m1fn))


def is_float(x: Any) -> bool:
    """Whether `x` is a real floating array (jax, numpy or a tracer)."""
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def is_complex(x: Any) -> bool:
    """Whether `x` is, or has, a complex dtype (False for None or a non-dtype)."""
    try:
        return x is not None and np.issubdtype(np.dtype(getattr(x, "dtype", x)), np.complexfloating)
    except TypeError:
        return False


def cast(x: Any, dtype: np.dtype) -> Any:
    """`x` in `dtype`: as is if it already is, a numpy constant stays a constant."""
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)  # A constant: no convert op.
    return lax.convert_element_type(x, dtype)


def widest(dtypes: Iterable[np.dtype]) -> np.dtype:
    """The widest floating dtype; bfloat16 and float16 meet at float32."""
    dtypes = {np.dtype(d) for d in dtypes}
    wide = max(dtypes, key=lambda d: d.itemsize)
    if sum(d.itemsize == wide.itemsize for d in dtypes) > 1:
        return F32 if wide.itemsize < 4 else wide
    return wide


def at_least_normal(amax: Any, v: Any) -> Any:
    """`v` (float32, derived from `amax`), no smaller than float32's smallest normal
    number where `amax > 0`: a subnormal scale, which XLA:CPU flushes to zero,
    would read as an all-zero tensor and round a tiny one to zeros."""
    return jnp.where(amax > 0, jnp.maximum(v, np.float32(np.finfo(np.float32).tiny)), v)


def pow2_at_least(v: Any) -> Any:
    """The smallest power of two >= `v` (a float32 array, >= 0): exact to divide by.
    1 where `v` is 0; `v` itself where it is not finite (inf, NaN), so a scale
    carries a non-finite amax into the product."""
    bits = lax.bitcast_convert_type(v, np.int32)
    # Round the exponent up unless v is already a power of two (mantissa 0).
    pow2 = lax.bitcast_convert_type((bits + 0x7FFFFF) & 0x7F800000, F32)
    return jnp.where(v == 0, np.float32(1), jnp.where(jnp.isfinite(v), pow2, v))
