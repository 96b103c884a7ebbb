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

What the backward pass takes depends on the same: a program that is not
partitioned takes FP8 copies saved in the forward pass (`fp8_copy`: half the
memory of the operands), a partitioned one the operands, each device
quantizing its blocks again (as torchao saves its bf16 inputs). Both are
saved; XLA drops what the compiled program does not read.
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

    `copies`: which operands come with an FP8 copy and its scale
    (`fp8_copy`'s), which the product takes where it is not partitioned.
    """

    dims: Dims
    ndims: tuple[int, int]
    formats: tuple[Format, Format]
    results: np.dtype
    precision: Any = None
    copies: tuple[bool, bool] = (False, False)


def free_dims(dims: Dims, ndims: tuple[int, int]) -> tuple[list[int], list[int]]:
    """Each operand's dimensions that `dot_general` neither contracts nor batches."""
    (lc, rc), (lb, rb) = dims
    return (
        [d for d in range(ndims[0]) if d not in (*lc, *lb)],
        [d for d in range(ndims[1]) if d not in (*rc, *rb)],
    )


def _copy(fmt: Format, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    scale = fp8_scale(x, fmt[1])
    return fp8_quantize(x, scale, *fmt), scale


def _compute(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
    """The product of the arrays one device holds (all of them, unpartitioned)."""
    given = iter(copies)
    (ql, sl), (qr, sr) = (
        (next(given), next(given)) if copied else _copy(fmt, x)
        for x, fmt, copied in zip((lhs, rhs), spec.formats, spec.copies)
    )
    product = dot_product(spec.dims, spec.precision)(ql, qr, spec.results)
    # One scale after the other: their product could underflow on its own.
    return (product.astype(F32) * sl * sr).astype(spec.results)


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


def _spec_of(shape: Any) -> list[Any]:
    """The partition spec of an argument of a partitioning callback, one entry a dimension."""
    spec = list(shape.sharding.spec)
    return spec + [None] * (len(shape.shape) - len(spec))


def _names(prefix: str, ndim: int) -> list[str]:
    return [f"{prefix}{d}" for d in range(ndim)]


def _product_rule(spec: Spec, mesh: Any, operand_types: Any, result_types: Any) -> str:
    """The Shardy rule of a product: `dot_general`'s einsum, each copy its operand's
    factors and a scalar scale."""
    del mesh, operand_types, result_types
    (lc, rc), (lb, rb) = spec.dims
    lhs, rhs = _names("l", spec.ndims[0]), _names("r", spec.ndims[1])
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        rhs[j] = lhs[i]
    lf, rf = free_dims(spec.dims, spec.ndims)
    out = [lhs[d] for d in lb] + [lhs[d] for d in lf] + [rhs[d] for d in rf]
    copies = [part for f, c in zip((lhs, rhs), spec.copies) if c for part in (" ".join(f), "")]
    operands = [" ".join(lhs), " ".join(rhs), *copies]
    return f"{', '.join(operands)} -> {' '.join(out)}"


def _partition_product(spec: Spec, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    """The partitioned product: the shardings it takes and gives, and what
    each device runs (`_compute` on its blocks, then the partial results
    summed over the mesh axes that shard the contraction)."""
    del result_shape
    (lc, rc), (lb, rb) = spec.dims
    lhs, rhs = _spec_of(arg_shapes[0]), _spec_of(arg_shapes[1])
    for i, j in zip((*lc, *lb), (*rc, *rb)):  # rhs follows lhs where they meet
        rhs[j] = lhs[i]
    taken = {a for entry in lhs for a in _axes(entry)}
    lf, rf = free_dims(spec.dims, spec.ndims)
    for d in rf:  # a mesh axis shards one factor: rhs's free dimensions give way
        if taken & set(_axes(rhs[d])):
            rhs[d] = None
    summed = tuple(a for i in lc for a in _axes(lhs[i]))
    out = P(*[lhs[d] for d in lb], *[lhs[d] for d in lf], *[rhs[d] for d in rf])
    local = dataclasses.replace(spec, copies=(False, False))

    def lower(lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
        del copies  # Each device quantizes its own blocks instead.
        result = _compute(local, lhs, rhs)
        return lax.psum(result, summed) if summed else result

    shardings = (NamedSharding(mesh, P(*lhs)), NamedSharding(mesh, P(*rhs)))
    replicated = NamedSharding(mesh, P())
    copies = [(s, replicated) for s, c in zip(shardings, spec.copies) if c]
    args = (*shardings, *(s for pair in copies for s in pair))
    return mesh, lower, NamedSharding(mesh, out), args


def _copy_rule(fmt: Format, mesh: Any, operand_types: Any, result_types: Any) -> str:
    del fmt, mesh, result_types
    names = " ".join(_names("x", len(operand_types[0].shape)))
    return f"{names} -> {names}, "


def _partition_copy(fmt: Format, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    """A partitioned copy: scaled per tensor, its amax reduced across devices.
    Only a backward pass that is not partitioned reads it (a program whose
    forward and backward passes are compiled apart); XLA drops it otherwise."""
    del result_shape
    spec = _spec_of(arg_shapes[0])
    axes = tuple(a for entry in spec for a in _axes(entry))

    def lower(x: jax.Array) -> tuple[jax.Array, jax.Array]:
        scale = fp8_scale(x, fmt[1])
        scale = lax.pmax(scale, axes) if axes else scale
        return fp8_quantize(x, scale, *fmt), scale

    sharding = NamedSharding(mesh, P(*spec))
    return mesh, lower, (sharding, NamedSharding(mesh, P())), (sharding,)


def _partitioned(fn: Callable, static: Any, partition: Callable, rule: Callable) -> Callable:
    """`fn(static, *arrays)` as a `custom_partitioning`, and under `vmap` (which
    it has no rule for) `fn` as written."""
    partitioned = custom_partitioning(fn, static_argnums=(0,))
    partitioned.def_partition(partition=partition, sharding_rule=rule)

    @jax.custom_batching.custom_vmap
    def call(*arrays):
        return partitioned(static, *arrays)

    @call.def_vmap
    def _vmapped(axis_size, in_batched, *arrays):
        in_axes = [0 if b else None for b in in_batched]
        out = jax.vmap(functools.partial(fn, static), in_axes, axis_size=axis_size)(*arrays)
        return out, jax.tree.map(lambda _: True, out)

    return call


@functools.cache
def _product(spec: Spec) -> Callable:
    return _partitioned(_compute, spec, _partition_product, _product_rule)


@functools.cache
def _copier(fmt: Format) -> Callable:
    return _partitioned(_copy, fmt, _partition_copy, _copy_rule)


def scaled_product(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
    """The per-tensor FP8 product `spec` describes, in `spec.results`; each
    device's blocks scaled on their own where `jit` partitions it. `copies`:
    the FP8 copy and scale of each operand `spec.copies` names."""
    return _product(spec)(lhs, rhs, *copies)


def fp8_copy(x: jax.Array, fmt: Format) -> tuple[jax.Array, jax.Array]:
    """`x` scaled per tensor to `fmt`, and its scale: what a product that is
    not partitioned takes for `x` (see `Spec.copies`)."""
    return _copier(fmt)(x)


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
