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
    the operands' ranks and FP8 formats, the results dtype and precision.

    `save`: the product also gives each operand's FP8 copy and its scale, to
    be saved for the backward pass. `copies`: which operands come with such
    a copy and scale, which the product takes where it is not partitioned (a
    partitioned product quantizes each device's blocks itself, and the
    program no longer reads the copy).
    """

    dims: Dims
    ndims: tuple[int, int]
    formats: tuple[Format, Format]
    results: np.dtype
    precision: Any = None
    save: bool = False
    copies: tuple[bool, bool] = (False, False)


def free_dims(dims: Dims, ndims: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Each operand's dimensions that `dot_general` neither contracts nor batches."""
    (lc, rc), (lb, rb) = dims
    return (
        [d for d in range(ndims[0]) if d not in (*lc, *lb)],
        [d for d in range(ndims[1]) if d not in (*rc, *rb)],
    )


def _quantized(x: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    scale = fp8_scale(x, fmt[1])
    return fp8_quantize(x, scale, *fmt), scale


def _compute(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> Any:
    """The product of the arrays one device holds (all of them, unpartitioned)."""
    given = iter(copies)
    (ql, sl), (qr, sr) = (
        (next(given), next(given)) if copied else _quantized(x, fmt)
        for x, fmt, copied in zip((lhs, rhs), spec.formats, spec.copies)
    )
    product = dot_product(spec.dims, spec.precision)(ql, qr, spec.results)
    # One scale after the other: their product could underflow on its own.
    out = (product.astype(F32) * sl * sr).astype(spec.results)
    return (out, ql, sl, qr, sr) if spec.save else out


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
    operands = [
        lhs,
        rhs,
        *(f for f, c in ((lhs, spec.copies[0]), (rhs, spec.copies[1])) if c for f in (f, [])),
    ]
    results = [out, *([lhs, [], rhs, []] if spec.save else [])]
    return " -> ".join(", ".join(" ".join(f) for f in side) for side in (operands, results))


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
    local = dataclasses.replace(spec, save=False, copies=(False, False))

    def lower(lhs: jax.Array, rhs: jax.Array, *given: jax.Array) -> Any:
        del given  # Each device quantizes its own blocks, not the copies.
        result = _compute(local, lhs, rhs)
        if summed:
            result = lax.psum(result, summed)
        if not spec.save:
            return result
        # The copies to be saved, for a backward pass that is not partitioned
        # (the program drops them otherwise): scaled per tensor.
        saved: list[jax.Array] = []
        for x, fmt, entries in ((lhs, spec.formats[0], lhs_spec), (rhs, spec.formats[1], rhs_spec)):
            axes = tuple(a for e in entries for a in _axes(e))
            scale = fp8_scale(x, fmt[1])
            scale = lax.pmax(scale, axes) if axes else scale
            saved += [fp8_quantize(x, scale, *fmt), scale]
        return (result, *saved)

    lhs_spec, rhs_spec = lhs, rhs
    lhs_sharding, rhs_sharding = NamedSharding(mesh, P(*lhs)), NamedSharding(mesh, P(*rhs))
    replicated = NamedSharding(mesh, P())
    copied = [(s, replicated) for s, c in zip((lhs_sharding, rhs_sharding), spec.copies) if c]
    args = (lhs_sharding, rhs_sharding, *(s for pair in copied for s in pair))
    results: Any = NamedSharding(mesh, out)
    if spec.save:
        results = (results, lhs_sharding, replicated, rhs_sharding, replicated)
    return mesh, lower, results, args


@functools.cache
def _product(spec: Spec) -> Callable:
    partitioned = custom_partitioning(_compute, static_argnums=(0,))
    partitioned.def_partition(partition=_partition, sharding_rule=_sharding_rule)

    # `custom_partitioning` has no batching rule: under `vmap`, the product as written.
    @jax.custom_batching.custom_vmap
    def product(*operands):
        return partitioned(spec, *operands)

    @product.def_vmap
    def _vmapped(axis_size, in_batched, *operands):
        in_axes = [0 if b else None for b in in_batched]
        compute = functools.partial(_compute, spec)
        out = jax.vmap(compute, in_axes, axis_size=axis_size)(*operands)
        return out, jax.tree.map(lambda _: True, out)

    return product


def scaled_product(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> Any:
    """The per-tensor FP8 product `spec` describes, in `spec.results`; each
    device's blocks scaled on their own where `jit` partitions it. With
    `spec.save`, also the FP8 copies of lhs and rhs and their scales;
    `copies`: those `spec.copies` names, each a copy and its scale."""
    return _product(spec)(lhs, rhs, *copies)


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
