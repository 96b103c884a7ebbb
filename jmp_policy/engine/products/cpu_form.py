"""The CPU form: half x half -> float32 dots as XLA:CPU runs them.

XLA:CPU before jaxlib 0.12.1 rejects some bf16 x bf16 -> f32 dots:
"UNIMPLEMENTED: Unsupported element type for DotThunk::Execute: BF16 x BF16
= F32". Which ones depends on the layout, the sizes and what XLA fuses around
the dot (e.g. [2,2,8,6] x [2,6,2,8] with batch dimensions (0, 1) and (0, 2);
[8,6] x [6,8,6] contracting 0 with 1), not on the CPU's instructions: they
fail with and without AVX512-BF16 and under --xla_cpu_max_isa=AVX2 or SSE4_2
alike. One form ran in every case tried (tests/test_cpu_layouts.py, the test
suite, random layouts): both operands transposed to [B, K, M] and [B, K, N].
Dense-like dots left as written failed in context: XLA folds transposes
around them into a form it rejects. So on the CPU platform, under those
jaxlibs, every half x half -> f32 dot takes the [B, K, .] form (its cost:
benchmarks/cpu_dot.py), and loses any DotAlgorithmPreset: JAX refuses to
lower F16_F16_F32 (asked for by jax.nn.dot_product_attention) for CPU, and
half operands with float32 accumulation is what the form computes anyway.
jaxlib 0.12.1 runs every one of them as written (the whole test suite, with
the form off), so from it on the dots stay as written.
`lax.platform_dependent` keeps the branch out of GPU and TPU programs, which
get the dot as written. JMP_POLICY_CPU_BF16_DOT_WORKAROUND=1 or 0 turns it
on or off whatever the jaxlib.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

import jax
import jaxlib
import numpy as np
from jax import lax

from jmp_policy.core.dtypes import F32, HALF_DTYPES

# The first jaxlib whose XLA:CPU runs every half x half -> f32 dot as written.
FIXED_IN = (0, 12, 1)


def jaxlib_version(version: str = jaxlib.__version__) -> tuple[int, ...]:
    """`version`'s release numbers: "0.12.0.1" is (0, 12, 0, 1), "0.13.0.dev1" (0, 13, 0)."""
    release = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in release.group().split(".")) if release else ()


def cpu_bf16_dot_workaround(
    env: Mapping[str, str] = os.environ, version: tuple[int, ...] = jaxlib_version()
) -> bool:
    """Whether half x half -> f32 dots on the CPU platform take the form XLA:CPU runs:
    under a jaxlib before `FIXED_IN`, unless the environment says otherwise."""
    setting = env.get("JMP_POLICY_CPU_BF16_DOT_WORKAROUND")
    if setting is None:
        return version < FIXED_IN
    return setting != "0"


_CPU_BF16_DOT_WORKAROUND = cpu_bf16_dot_workaround()


def in_use() -> bool:
    """The setting products traced now take (part of a shared product's signature)."""
    return _CPU_BF16_DOT_WORKAROUND


def applies(lhs: Any, rhs: Any, preferred_element_type: Any, out_sharding: Any) -> bool:
    """Whether a dot of `lhs` and `rhs` into `preferred_element_type` takes
    the form on the CPU platform."""
    half_to_f32 = lhs.dtype in HALF_DTYPES and preferred_element_type == F32
    shardings = (out_sharding, jax.typeof(lhs).sharding, jax.typeof(rhs).sharding)
    return half_to_f32 and _CPU_BF16_DOT_WORKAROUND and not any(map(_explicit, shardings))


def _explicit(sharding: Any) -> bool:
    """Whether `sharding` (the result's, or an operand's type's) is on a mesh
    with explicit axes: the form's reshapes would merge dimensions JAX keeps
    sharded by type, so the dot runs as written."""
    mesh = getattr(sharding, "mesh", None)
    return jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())


# The name scope of the CPU form: a program's debug locations show where it is.
SCOPE = "jmp_policy_cpu_dot"


@jax.named_scope(SCOPE)
def dot(lhs, rhs, dims, precision, out_sharding):
    """The dot as one [B, K, M] x [B, K, N] product: the form XLA:CPU always ran,
    its result laid out as the dot's (`out_sharding`, which JAX's own
    transposes of a dot under a mesh of automatic axes give)."""
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
    rf = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    shape = [lhs.shape[d] for d in (*lb, *lf)] + [rhs.shape[d] for d in rf]
    b, k = _size(lhs, lb), _size(lhs, lc)
    lhs = lax.transpose(lhs, (*lb, *lc, *lf)).reshape(b, k, _size(lhs, lf))
    rhs = lax.transpose(rhs, (*rb, *rc, *rf)).reshape(b, k, _size(rhs, rf))
    out = lax.dot_general(lhs, rhs, (((1,), (1,)), ((0,), (0,))), precision, F32)
    out = out.reshape(shape)
    return out if out_sharding is None else jax.sharding.reshard(out, out_sharding)


def _size(x, dims):
    return int(np.prod([x.shape[d] for d in dims], dtype=int))
