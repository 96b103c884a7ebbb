"""The product a policy's matmul dtype asks for, and the author's precision that wins.

Above both kinds of product (`matmul`'s half products, `fp8`'s FP8 ones):
`matmul_dot_general` picks one for a matmul dtype, `asks_full_precision`
says which products the author keeps in float32 (`precision=HIGHEST`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
from jax import lax

from jmp_policy.core.dtypes import SCALED_MATMUL_DTYPES
from jmp_policy.engine.products.fp8 import fp8_dot_general
from jmp_policy.engine.products.half import half_dot_general
from jmp_policy.engine.residuals import residual_form

_FULL_PRECISION_ALGORITHMS = frozenset(
    getattr(lax.DotAlgorithmPreset, name) for name in ("F32_F32_F32", "F64_F64_F64")
)


def asks_full_precision(precision: Any) -> bool:
    """Whether the author of a product asked for float32 accuracy: `Precision.HIGHEST`
    (for both operands) or a float32 dot algorithm. A policy leaves such a product as written.

    >>> from jax import lax
    >>> asks_full_precision(lax.Precision.HIGHEST), asks_full_precision("highest")
    (True, True)
    >>> asks_full_precision(None), asks_full_precision((lax.Precision.HIGHEST, None))
    (False, False)
    """
    if isinstance(precision, lax.DotAlgorithmPreset):
        return precision in _FULL_PRECISION_ALGORITHMS
    parts = precision if isinstance(precision, (tuple, list)) else (precision,)
    try:
        return all(p is not None and lax.Precision(p) == lax.Precision.HIGHEST for p in parts)
    except (ValueError, TypeError):  # A DotAlgorithm, or what lax itself would refuse.
        return False


def matmul_dot_general(
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    residuals: str | None = None,
    reduce_dtype: Any = None,
) -> Callable | None:
    """The `dot_general` a policy's `matmul_dtype` asks for (None: the layers' own).

    `fp8_scaling` (`"tensor"`, `"rowwise"`, `"mxfp8"`, `"nvfp4"`) and
    `residuals` (what an FP8 product saves, see `fp8_dot_general`) apply to
    an FP8 or FP4 matmul dtype, `reduce_dtype` (the dtype results are given
    in, see `half_dot_general`; None: float32) to all. A product the layer asks for at full
    precision (`precision=HIGHEST`) runs as `lax.dot_general`. One object per
    arguments, so that modules given it compare equal across calls, and a
    jitted function taking it as a static argument (`jnp.einsum`) traces
    again for other `residuals`.
    """
    if matmul_dtype is None:
        return None
    # Cached on the np.dtype: `jnp.bfloat16` and `np.dtype("bfloat16")` hash apart.
    reduce = None if reduce_dtype is None else np.dtype(reduce_dtype)
    return _dot_general_for(np.dtype(matmul_dtype), fp8_scaling, residuals, reduce)


@functools.cache
def _dot_general_for(
    matmul_dtype: np.dtype, fp8_scaling: str, residuals: str | None, reduce: np.dtype | None
) -> Callable:
    if matmul_dtype in SCALED_MATMUL_DTYPES:
        product = functools.partial(fp8_dot_general, scaling=fp8_scaling, residuals=residuals,
                                    reduce_dtype=reduce)  # fmt: skip
    else:
        product = functools.partial(half_dot_general, compute_dtype=matmul_dtype,
                                    reduce_dtype=reduce)  # fmt: skip

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None,
                    **kwargs):  # fmt: skip
        run = lax.dot_general if asks_full_precision(precision) else product
        return run(lhs, rhs, dimension_numbers, precision, preferred_element_type, **kwargs)

    return dot_general


def traced_dot_general(
    matmul_dtype: Any, fp8_scaling: str = "tensor", reduce_dtype: Any = None
) -> Callable | None:
    """`matmul_dot_general` for what FP8 products save in the trace under way: for a
    function that takes it as a static argument (`jnp.einsum`), whose trace JAX
    reuses for equal arguments whatever derivatives the caller is under."""
    scaled = matmul_dtype is not None and np.dtype(matmul_dtype) in SCALED_MATMUL_DTYPES
    residuals = residual_form(None) if scaled else None
    return matmul_dot_general(matmul_dtype, fp8_scaling, residuals, reduce_dtype)
