"""Per-tensor FP8 products whose scales are each shard's own: no all-reduce for an amax.

Under `jit` over a mesh, a per-tensor scale written as a maximum over the whole
tensor is a global maximum: one blocking all-reduce per product, each waiting
on the product before it. PyTorch's FP8 training (torchao, under DDP and
FSDP) scales the data each rank holds by that rank's own amax instead. This
module does the same for XLA's SPMD partitioner: each product (quantize both
operands, FP8 `dot_general`, multiply by the scales) is a
`jax.experimental.custom_partitioning` whose partitioned form quantizes the
block a device holds by that block's amax, multiplies, applies the scales to
its partial result, and only then sums the partial results over the mesh axes
the contraction is sharded on (in the results dtype, as a bf16 product's sum
is). So the scales never meet a collective, and a sharded FP8 program sends
what its bf16 twin sends. Where nothing is partitioned (one device,
`shard_map`, `pmap`, `vmap`) the product is the per-tensor product as written.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_policy.core.dtypes import F32
from jmp_policy.engine.products.fp8_format import Dims, fp8_quantize, fp8_scale
from jmp_policy.engine.products.half import dot_product

Format = tuple[np.dtype, float]  # An FP8 dtype and its largest finite value.


@dataclasses.dataclass(frozen=True)
class Spec:
    """One product's static description: `dot_general`'s dimension numbers,
    the operands' ranks and FP8 formats, the results dtype and precision."""

    dims: Dims
    ndims: tuple[int, int]
    formats: tuple[Format, Format]
    results: np.dtype
    precision: Any = None


def free_dims(dims: Dims, ndims: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Each operand's dimensions that `dot_general` neither contracts nor batches."""
    (lc, rc), (lb, rb) = dims
    return (
        [d for d in range(ndims[0]) if d not in (*lc, *lb)],
        [d for d in range(ndims[1]) if d not in (*rc, *rb)],
    )


def _compute(spec: Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """The product of the arrays one device holds (all of them, unpartitioned)."""
    scales = [fp8_scale(x, fmt[1]) for x, fmt in zip((lhs, rhs), spec.formats)]
    ql, qr = (fp8_quantize(x, s, *fmt) for x, s, fmt in zip((lhs, rhs), scales, spec.formats))
    product = dot_product(spec.dims, spec.precision)(ql, qr, spec.results)
    # One scale after the other: their product could underflow on its own.
    return (product.astype(F32) * scales[0] * scales[1]).astype(spec.results)


def _factors(spec: Spec) -> tuple[list[str], list[str], list[str]]:
    """Shardy factor names of lhs, rhs and the result: a `dot_general`'s einsum."""
    (lc, rc), (lb, rb) = spec.dims
    lhs = [f"l{d}" for d in range(spec.ndims[0])]
    rhs = [f"r{d}" for d in range(spec.ndims[1])]
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        rhs[j] = lhs[i]
    lf, rf = free_dims(spec.dims, spec.ndims)
    return lhs, rhs, [lhs[d] for d in lb] + [lhs[d] for d in lf] + [rhs[d] for d in rf]


def _sharding_rule(spec: Spec, mesh: Any, operand_types: Any, result_types: Any) -> str:
    del mesh, operand_types, result_types
    lhs, rhs, out = _factors(spec)
    return f"{' '.join(lhs)}, {' '.join(rhs)} -> {' '.join(out)}"


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _partition(spec: Spec, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    """The partitioned product: the shardings it takes and gives, and what
    each device runs (`_compute` on its blocks, then the partial results
    summed over the mesh axes that shard the contraction)."""
    del result_shape
    (lc, rc), (lb, rb) = spec.dims
    lhs, rhs = (
        list(a.sharding.spec) + [None] * (ndim - len(a.sharding.spec))
        for a, ndim in zip(arg_shapes, spec.ndims)
    )
    for i, j in zip((*lc, *lb), (*rc, *rb)):  # rhs follows lhs where they meet
        rhs[j] = lhs[i]
    taken = {a for entry in lhs for a in _axes(entry)}
    lf, rf = free_dims(spec.dims, spec.ndims)
    for d in rf:  # a mesh axis shards one factor: rhs's free dimensions give way
        if taken & set(_axes(rhs[d])):
            rhs[d] = None
    summed = tuple(a for i in lc for a in _axes(lhs[i]))
    out = P(*[lhs[d] for d in lb], *[lhs[d] for d in lf], *[rhs[d] for d in rf])

    def lower(lhs: jax.Array, rhs: jax.Array) -> jax.Array:
        result = _compute(spec, lhs, rhs)
        return lax.psum(result, summed) if summed else result

    shardings = (NamedSharding(mesh, P(*lhs)), NamedSharding(mesh, P(*rhs)))
    return mesh, lower, NamedSharding(mesh, out), shardings


@functools.cache
def _product(spec: Spec) -> Callable:
    partitioned = custom_partitioning(_compute, static_argnums=(0,))
    partitioned.def_partition(partition=_partition, sharding_rule=_sharding_rule)

    # `custom_partitioning` has no batching rule: under `vmap`, the product as written.
    @jax.custom_batching.custom_vmap
    def product(lhs, rhs):
        return partitioned(spec, lhs, rhs)

    @product.def_vmap
    def _vmapped(axis_size, in_batched, lhs, rhs):
        in_axes = [0 if b else None for b in in_batched]
        out = jax.vmap(functools.partial(_compute, spec), in_axes, axis_size=axis_size)(lhs, rhs)
        return out, True

    return product


def scaled_product(spec: Spec, lhs: jax.Array, rhs: jax.Array) -> jax.Array:
    """The per-tensor FP8 product `spec` describes, in `spec.results`; each
    device's blocks scaled on their own where `jit` partitions it."""
    return _product(spec)(lhs, rhs)


def transposed_dims(dims: Dims, ndims: tuple[int, int], side: str) -> tuple[Dims, tuple[int, ...]]:
    """The `dot_general` of `(output gradient, other operand)` that gives
    `d side`, and the permutation that lays its result out as `side` (the
    dimension numbers JAX's own transpose rule uses)."""
    (lc, rc), (lb, rb) = dims
    if side == "lhs":
        x_contract, y_contract, x_batch, y_batch, x_ndim, y_ndim = lc, rc, lb, rb, *ndims
    else:
        x_contract, y_contract, x_batch, y_batch, x_ndim, y_ndim = rc, lc, rb, lb, *ndims[::-1]
    x_kept = [d for d in range(x_ndim) if d not in (*x_contract, *x_batch)]
    y_kept = [d for d in range(y_ndim) if d not in (*y_contract, *y_batch)]
    nb = len(x_batch)
    # The output's dimensions: batch, lhs's free, rhs's free.
    first = nb if side == "rhs" else nb + len(x_kept)
    ans_y = tuple(range(first, first + len(y_kept)))
    t_dims = ((ans_y, tuple(y_kept)), (tuple(range(nb)), tuple(y_batch)))
    x_contract_by_y = [x_contract[k] for k in np.argsort(y_contract)]
    order = tuple(int(i) for i in np.argsort([*x_batch, *x_kept, *x_contract_by_y]))
    return t_dims, order
