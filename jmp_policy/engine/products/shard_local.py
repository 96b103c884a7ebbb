"""Low-precision products whose scales are each shard's own: no all-reduce for an amax.

Under `jit` over a mesh, a per-tensor scale written as a maximum over the whole
tensor is a global maximum: one blocking all-reduce per product, each waiting
on the product before it; and a block format's blocks, laid out over the whole
operand, straddle devices. PyTorch's FP8 training (torchao, under DDP and
FSDP) scales the data each rank holds by that rank's own amax instead. This
module does the same for XLA's SPMD partitioner: each product (quantize both
operands, the low-precision `dot_general`, scale back) is a
`jax.experimental.custom_partitioning` whose partitioned form quantizes the
block a device holds on its own (its amax, its blocks along the contraction),
multiplies, scales its partial result back, and only then sums the partial
results over the mesh axes the contraction is sharded on (in the results
dtype, as a bf16 product's sum is). So no scale meets a collective, and a
sharded program sends what its bf16 twin sends. Each product's shardings
are the cheapest for its operands as they come and its result as it is
wanted (`_factor_axes`); shards a mesh axis does not divide come padded,
the padding masked out. Where nothing is partitioned (one device,
`shard_map`, `pmap`, `vmap`) the product is the one written; on a mesh with
explicit axes (where types hold shardings) it runs with them made auto
(`jax.sharding.auto_axes`), so the partitioner sees every axis, explicit
or auto.

A recipe's quantizers (`fp8_format.TensorScaling`,
`block_scaling.BlockScaling`) say how an operand is quantized for a product
(`copy`) and how two copies multiply (`product`).

What the backward pass takes depends on the same: a product multiplying the
whole of an operand takes its copy made in the forward pass (`saved_copy`:
half the memory of bf16 operands), one multiplying a part quantizes that
part of the operand again (as torchao saves its bf16 inputs). Both are
saved; XLA drops what the compiled program does not read. A copy with one
scale per tensor also serves the forward product, and a sharded operand's
is gathered in FP8 (the scale one max over the shards, as torchao's FSDP
gathers weights), where a bf16 operand would be gathered.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import cast, widest
from jmp_policy.engine.products.fp8_format import Dims
from jmp_policy.engine.products.half import decided, dot_product
from jmp_policy.engine.residuals import to_be_saved_quantized


class Quantizer(Protocol):
    """How an operand is quantized for a product, and how two copies multiply.
    `per_tensor`: a copy serves every product, and `gathered_copy` sends a
    sharded operand's copy in its low-precision format (`gather` makes a
    shard whole)."""

    arity: int  # arrays in a copy
    per_tensor: bool

    def copy(self, x: jax.Array, dims: Dims, side: str) -> tuple[jax.Array, ...]: ...

    def gathered_copy(
        self, x: jax.Array, dims: Dims, side: str, gather: Gather
    ) -> tuple[jax.Array, ...]: ...

    def product(
        self, dims: Dims, precision: Any, results: np.dtype, lhs: Any, rhs: Any, out_shape: Any
    ) -> jax.Array: ...


class Recipe(NamedTuple):
    """The quantizers of (lhs, rhs) in the forward product and of (output
    gradient, other operand) in the products giving `d lhs` and `d rhs`."""

    forward: tuple[Quantizer, Quantizer]
    d_lhs: tuple[Quantizer, Quantizer]
    d_rhs: tuple[Quantizer, Quantizer]


@dataclasses.dataclass(frozen=True)
class Spec:
    """One product's static description: `dot_general`'s dimension numbers,
    the operands' ranks and quantizers, the results dtype and precision.
    `copies`: which operands come with a copy (`saved_copy`'s), which the
    product takes where it is not partitioned."""

    dims: Dims
    ndims: tuple[int, int]
    quantizers: tuple[Quantizer, Quantizer]
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


def _out_shape(dims: Dims, lhs: tuple[int, ...], rhs: tuple[int, ...]) -> tuple[int, ...]:
    lf, rf = free_dims(dims, (len(lhs), len(rhs)))
    return tuple(lhs[d] for d in (*dims[1][0], *lf)) + tuple(rhs[d] for d in rf)


def _compute(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
    """The product of the arrays one device holds (all of them, unpartitioned)."""
    given = iter(copies)
    lhs_copy, rhs_copy = (
        tuple(next(given) for _ in range(q.arity)) if copied else q.copy(x, spec.dims, side)
        for x, q, copied, side in zip((lhs, rhs), spec.quantizers, spec.copies, ("lhs", "rhs"))
    )
    out_shape = _out_shape(spec.dims, lhs.shape, rhs.shape)
    return spec.quantizers[0].product(
        spec.dims, spec.precision, spec.results, lhs_copy, rhs_copy, out_shape
    )


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class Gather:
    """How a shard (one device's block, inside a partitioned function) is made
    whole: each sharded dimension's mesh axes and whole size. A dimension the
    axes do not divide comes in shards padded to one size; the padding is
    cut off."""

    dims: tuple[tuple[int, tuple[str, ...], int], ...]  # (dimension, mesh axes, whole size)

    @property
    def axes(self) -> tuple[str, ...]:
        return tuple(a for _, axes, _ in self.dims for a in axes)

    def __call__(self, x: jax.Array) -> jax.Array:
        for d, axes, size in self.dims:
            x = lax.all_gather(x, axes, axis=d, tiled=True)
            x = lax.slice_in_dim(x, 0, size, axis=d) if x.shape[d] != size else x
        return x


def _sharded_dims(spec: list[Any], shape: tuple[int, ...]) -> tuple:
    """An array's sharded dimensions under `spec`: (dimension, mesh axes, whole size)."""
    return tuple((d, _axes(e), shape[d]) for d, e in enumerate(spec) if e is not None)


def _without_padding(x: jax.Array, mesh: Any, sharded: Any) -> jax.Array:
    """A shard `x` with zeros where it pads a dimension its mesh axes do not
    divide (XLA leaves the padding undefined): an amax or a sum over it is
    the real elements'. `x` itself where every dimension divides."""
    for d, axes, size in sharded:
        block = x.shape[d]
        count = int(np.prod([mesh.shape[a] for a in axes]))
        if block * count == size:
            continue
        start = lax.axis_index(axes) * block
        index = lax.broadcasted_iota(np.int32, x.shape, d) + start
        x = jnp.where(index < size, x, jnp.zeros((), x.dtype))
    return x


def _spec_of(shape: Any) -> list[Any]:
    """The partition spec of an argument of a partitioning callback (or a
    type), one entry a dimension."""
    spec = list(shape.sharding.spec)
    return spec + [None] * (len(shape.shape) - len(spec))


def _names(prefix: str, ndim: int) -> list[str]:
    return [f"{prefix}{d}" for d in range(ndim)]


def _own_factors(types: Any) -> list[str]:
    """Factors of their own for arrays a rule does not relate to the others."""
    return [" ".join(_names(f"u{k}_", len(t.shape))) for k, t in enumerate(types)]


def _product_rule(spec: Spec, mesh: Any, operand_types: Any, result_types: Any) -> str:
    """The Shardy rule of a product: `dot_general`'s einsum (copies apart)."""
    del mesh, result_types
    (lc, rc), (lb, rb) = spec.dims
    lhs, rhs = _names("l", spec.ndims[0]), _names("r", spec.ndims[1])
    for i, j in zip((*lc, *lb), (*rc, *rb)):
        rhs[j] = lhs[i]
    lf, rf = free_dims(spec.dims, spec.ndims)
    out = [lhs[d] for d in lb] + [lhs[d] for d in lf] + [rhs[d] for d in rf]
    operands = [" ".join(lhs), " ".join(rhs), *_own_factors(operand_types[2:])]
    return f"{', '.join(operands)} -> {' '.join(out)}"


# What a layout costs an array against the one it comes in (or is wanted in):
# nothing where it is the same, or sharded on axes the array is replicated
# over (a local slice); a gather where it is replicated where the array is
# sharded; a move (all-to-all, which XLA's partitioner does by gathering the
# whole array) where it puts an axis the array has elsewhere.
_SAME, _GATHER, _MOVE = 0, 1, 2


def _cost(given: list[Any], dim: int, entry: Any) -> int:
    axes, held = set(_axes(entry)), set(_axes(given[dim]))
    if axes == held:
        return _SAME
    elsewhere = {a for d, e in enumerate(given) if d != dim for a in _axes(e)}
    return _MOVE if axes & elsewhere else (_GATHER if held - axes else _SAME)


# A factor of a product: (lhs dimension, rhs dimension, result position).
Factor = tuple[int | None, int | None, int | None]


def _factor_cost(
    factor: Factor, entry: Any, lhs: list[Any], rhs: list[Any], wanted: list[Any]
) -> int:
    i, j, k = factor
    total = _cost(lhs, i, entry) if i is not None else _SAME
    total += _cost(rhs, j, entry) if j is not None else _SAME
    if k is not None and entry is not None and _axes(entry) != _axes(wanted[k]):
        total += _MOVE if wanted[k] is not None else _GATHER
    return total


def _factor_axes(spec: Spec, lhs: list[Any], rhs: list[Any], wanted: list[Any]) -> list[Any]:
    """Each factor with its mesh axes, `(lhs dimension, rhs dimension, result
    position, entry)`: contraction, batch, then the free dimensions (those
    the result is wanted sharded on first). Greedily the cheapest for the
    operands as they come and the result as it is wanted (moving the result
    costs as much as moving an operand); a mesh axis shards one factor."""
    (lc, rc), (lb, rb) = spec.dims
    lf, rf = free_dims(spec.dims, spec.ndims)
    factors: list[Factor] = [(i, j, None) for i, j in zip(lc, rc)]
    factors += [(i, j, k) for k, (i, j) in enumerate(zip(lb, rb))]
    free: list[Factor] = [(d, None, len(lb) + k) for k, d in enumerate(lf)]
    free += [(None, d, len(lb) + len(lf) + k) for k, d in enumerate(rf)]
    factors += sorted(free, key=lambda f: f[2] is None or wanted[f[2]] is None)
    taken: set[str] = set()
    chosen = []
    for i, j, k in factors:
        # Ties: a sharded result as wanted (what it costs is at most a local
        # slice), lhs's, rhs's, replicated.
        candidates = [wanted[k]] if k is not None and wanted[k] is not None else []
        candidates += [lhs[i]] if i is not None else []
        candidates += [rhs[j]] if j is not None else []
        free_entries = [e for e in (*candidates, None) if not taken & set(_axes(e))]
        entry = min(free_entries, key=lambda e: _factor_cost((i, j, k), e, lhs, rhs, wanted))
        taken |= set(_axes(entry))
        chosen.append((i, j, k, entry))
    return chosen


def _result_spec(chosen: list[Any], ndim: int) -> list[Any]:
    """The result's partition spec, one entry a dimension, from `_factor_axes`."""
    out: list[Any] = [None] * ndim
    for _, _, k, entry in chosen:
        if k is not None:
            out[k] = entry
    return out


def _partition_product(spec: Spec, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    """The partitioned product: the shardings it takes and gives
    (`_factor_axes`), and what each device runs (`_compute` on its blocks,
    then the partial results summed over the mesh axes that shard the
    contraction)."""
    given = (_spec_of(arg_shapes[0]), _spec_of(arg_shapes[1]))
    chosen = _factor_axes(spec, *given, _spec_of(result_shape))
    lhs, rhs = [None] * spec.ndims[0], [None] * spec.ndims[1]
    for i, j, _, entry in chosen:
        if i is not None:
            lhs[i] = entry
        if j is not None:
            rhs[j] = entry
    summed = tuple(a for _, _, k, entry in chosen if k is None for a in _axes(entry))
    out = _result_spec(chosen, len(result_shape.shape))

    # A copy is of the whole operand: read where each device multiplies all of
    # it, if the device holds it all or the copy is gathered in its format
    # (cheaper than the operand); elsewhere each device quantizes its blocks,
    # and XLA drops the copy.
    def reads_copy(side: int, needed: list[Any]) -> bool:
        held = not any(_spec_of(arg_shapes[side]))
        quantizer = spec.quantizers[side]
        return spec.copies[side] and not any(needed) and (held or quantizer.per_tensor)

    reads = (reads_copy(0, lhs), reads_copy(1, rhs))
    local = dataclasses.replace(spec, copies=reads)
    kept = [r for q, c, r in zip(spec.quantizers, spec.copies, reads) if c for _ in range(q.arity)]

    sharded = [_sharded_dims(lhs, arg_shapes[0].shape), _sharded_dims(rhs, arg_shapes[1].shape)]

    def lower(lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
        lhs, rhs = (_without_padding(x, mesh, s) for x, s in zip((lhs, rhs), sharded))
        arrays = (lhs, rhs, *(x for x, keep in zip(copies, kept) if keep))
        result = _compute(local, *arrays)
        return lax.psum(result, summed) if summed else result

    operands = (NamedSharding(mesh, P(*lhs)), NamedSharding(mesh, P(*rhs)))
    replicated = NamedSharding(mesh, P())
    args = (*operands, *(replicated,) * (len(arg_shapes) - 2))  # the copies: whole
    return mesh, lower, NamedSharding(mesh, P(*out)), args


CopyKey = tuple[Any, Dims, str]  # (quantizer, the product's dimension numbers, side)


def _copy(key: CopyKey, x: jax.Array) -> tuple[jax.Array, ...]:
    quantizer, dims, side = key
    return quantizer.copy(x, dims, side)


def _copy_rule(key: CopyKey, mesh: Any, operand_types: Any, result_types: Any) -> str:
    del key, mesh
    names = " ".join(_names("x", len(operand_types[0].shape)))
    return f"{names} -> {', '.join(_own_factors(result_types))}"


def _partition_copy(key: CopyKey, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
    """A partitioned copy: of the whole operand, on every device (the
    quantizer's `gathered_copy`). Read where a product multiplies the whole
    operand; XLA drops it elsewhere."""
    gather = Gather(_sharded_dims(_spec_of(arg_shapes[0]), arg_shapes[0].shape))
    quantizer, dims, side = key

    def lower(x: jax.Array) -> tuple[jax.Array, ...]:
        return quantizer.gathered_copy(_without_padding(x, mesh, gather.dims), dims, side, gather)

    replicated = NamedSharding(mesh, P())
    results = tuple(replicated for _ in jax.tree.leaves(result_shape))
    return mesh, lower, results, (arg_shapes[0].sharding,)


def _partitioned(fn: Callable, static: Any, partition: Callable, rule: Callable) -> Callable:
    """`fn(static, *arrays)` as a `custom_partitioning`, and under `vmap` (which
    it has no rule for) `fn` as written."""
    partitioned = custom_partitioning(fn, static_argnums=(0,))

    def partition_auto(static: Any, mesh: Any, arg_shapes: Any, result_shape: Any) -> Any:
        # Each device's function traced with the mesh's explicit axes made
        # auto, so that its types hold no sharding (XLA would find their
        # annotations in the partitioned program, and refuse it).
        mesh = mesh.update(axis_types=(jax.sharding.AxisType.Auto,) * len(mesh.axis_names))
        mesh, lower, out, args = partition(static, mesh, arg_shapes, result_shape)

        def lower_auto(*arrays: jax.Array) -> Any:
            with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
                return lower(*arrays)

        return mesh, lower_auto, out, args

    partitioned.def_partition(partition=partition_auto, sharding_rule=rule)

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
def _copier(key: CopyKey) -> Callable:
    return _partitioned(_copy, key, _partition_copy, _copy_rule)


def scaled_product(spec: Spec, lhs: jax.Array, rhs: jax.Array, *copies: jax.Array) -> jax.Array:
    """The low-precision product `spec` describes, in `spec.results`; each
    device's blocks scaled on their own where `jit` partitions it. `copies`:
    the copy of each operand `spec.copies` names."""
    arrays = (lhs, rhs, *copies)
    if _per_device():
        return _compute(spec, *arrays)  # Already one device's: nothing to partition.
    if _explicit_mesh(arrays):
        # The result sharded as the operands' types are, where they agree
        # (`_factor_axes`, nothing wanted); `product` lays it out after.
        ndim = len(_out_shape(spec.dims, lhs.shape, rhs.shape))
        types = _spec_of(jax.typeof(lhs)), _spec_of(jax.typeof(rhs))
        out = _result_spec(_factor_axes(spec, types[0], types[1], [None] * ndim), ndim)
        return _with_auto_axes(_product(spec), arrays, P(*out))
    return _product(spec)(*arrays)


def saved_copy(x: jax.Array, quantizer: Quantizer, dims: Dims, side: str) -> tuple[jax.Array, ...]:
    """`x` quantized as the product `dims` takes it on `side`: the copy a
    product multiplying the whole of `x` takes (see `Spec.copies`)."""
    key = (quantizer, dims, side)
    if _per_device():
        return _copy(key, x)
    if _explicit_mesh((x,)):
        return tuple(_with_auto_axes(_copier(key), (x,), (P(),) * quantizer.arity))
    return tuple(_copier(key)(x))


def _laid_out(x: jax.Array, sharding: Any) -> jax.Array:
    """`x` resharded as `sharding` says (a type's on no mesh, an unplaced
    array's: replicated on the context mesh)."""
    if sharding is None:
        return x
    mesh = getattr(sharding, "mesh", None)
    return jax.sharding.reshard(x, sharding.spec if mesh is not None and mesh.empty else sharding)


def _per_device() -> bool:
    """Whether the program being traced is one device's: a `shard_map` body
    (its mesh axes are manual), or code under a mesh of one device. There a
    `custom_partitioning` partitions nothing, and JAX would hold it to one
    mesh across the program, which need not hold (EasyDeL's experts run in a
    `shard_map` over a mesh of their own)."""
    manual = jax.sharding.AxisType.Manual in jax.sharding.get_abstract_mesh().axis_types
    return manual or ji.context_mesh_size() == 1


def _explicit_mesh(arrays: Any) -> bool:
    """Whether the arrays' types or the context are on a mesh with explicit
    axes (where types hold shardings)."""
    meshes = (*(jax.typeof(x).sharding.mesh for x in arrays), jax.sharding.get_abstract_mesh())
    return any(jax.sharding.AxisType.Explicit in m.axis_types for m in meshes)


def _with_auto_axes(partitioned: Callable, arrays: Any, out_specs: Any) -> Any:
    """`partitioned(*arrays)` on a mesh with explicit axes, made auto for it
    (`jax.sharding.auto_axes`): its `custom_partitioning` is given the
    shardings of every axis (types show only the explicit ones), and its
    results laid out as `out_specs` say."""
    return jax.sharding.auto_axes(lambda *a: partitioned(*a), out_sharding=out_specs)(*arrays)


def _straight_through(spec: Spec, a: jax.Array, b: jax.Array) -> jax.Array:
    """`scaled_product(spec, a, b)`, whose tangent is the product in the
    operands' (widest) dtype: the rounding counts as the identity."""

    @jax.custom_jvp
    def f(a, b):
        return scaled_product(spec, a, b)

    @f.defjvp
    def f_jvp(primals, tangents):
        (a, b), (da, db) = primals, tangents
        c = widest([a.dtype, b.dtype])
        bilinear = dot_product(spec.dims, spec.precision)
        tangent = bilinear(cast(da, c), cast(b, c), spec.results) + bilinear(
            cast(a, c), cast(db, c), spec.results
        )
        return f(a, b), tangent.astype(spec.results)

    return f(a, b)


def product(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    dims: Dims,
    out_dtype: np.dtype,
    recipe: Recipe,
    precision: Any,
    residuals: str,
    results: np.dtype,
    out_sharding: Any = None,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dims)` by `recipe`, both passes (a `jax.custom_vjp`),
    every product a `scaled_product`; saving `residuals` for the backward pass
    (`"quantized"`: the copies and the operands, as above; `"operands"`). The
    result laid out as `out_sharding` says, as in `lax.dot_general`."""
    ndims = (lhs.ndim, rhs.ndim)
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype
    shardings = _typed_shardings(lhs, rhs, dims, out_sharding)
    forward = Spec(dims, ndims, recipe.forward, results, precision)
    out_ndim = len(_out_shape(dims, lhs.shape, rhs.shape))
    transposed = {side: transposed_dims(dims, ndims, side) for side in ("lhs", "rhs")}
    quantizers = {"lhs": recipe.d_lhs, "rhs": recipe.d_rhs}

    def backward(side: str, copied: bool = False) -> Spec:
        """`d side`'s product: of the output gradient and the other operand."""
        ranks = (out_ndim, ndims[1] if side == "lhs" else ndims[0])
        return Spec(
            transposed[side][0], ranks, quantizers[side], results, precision, (False, copied)
        )

    def copy_for(side: str, other: jax.Array) -> tuple[jax.Array, ...]:
        """The other operand's copy, as `d side`'s product takes it."""
        return saved_copy(other, quantizers[side][1], transposed[side][0], "rhs")

    shares = recipe.forward == (recipe.d_rhs[1], recipe.d_lhs[1]) and all(
        q.per_tensor for q in recipe.forward
    )
    shared_forward = dataclasses.replace(forward, copies=(shares, shares))

    @jax.custom_vjp
    def f(lhs, rhs):
        return fwd(lhs, rhs)[0]

    def fwd(lhs, rhs):
        if residuals == "operands":
            out = _laid_out(_straight_through(forward, lhs, rhs), shardings[0])
            return cast(out, out_dtype), (lhs, rhs)
        # Saved quantized, the operands have no tangents (differentiating them raises).
        lhs, rhs = to_be_saved_quantized((lhs, rhs))
        copies = (copy_for("lhs", rhs), copy_for("rhs", lhs))
        if shares:  # Copies with one scale per tensor serve this product too.
            out = scaled_product(shared_forward, lhs, rhs, *copies[1], *copies[0])
        else:
            out = scaled_product(forward, lhs, rhs)
            # Made in the forward pass: left free, XLA may fuse a weight's copy with
            # the optimizer's update, which waits on the gradient's all-reduce.
            out, copies = lax.optimization_barrier((out, copies))
        return cast(_laid_out(out, shardings[0]), out_dtype), (lhs, rhs, *copies)

    def bwd(res, g):
        bars = []
        for side, dtype, sharding in zip(("lhs", "rhs"), (lhs_dtype, rhs_dtype), shardings[1:]):
            other = res[1] if side == "lhs" else res[0]
            if residuals == "operands":
                bar = _straight_through(backward(side), g, other)
            else:
                copy = res[2] if side == "lhs" else res[3]
                bar = scaled_product(backward(side, copied=True), g, other, *copy)
            bars.append(cast(_laid_out(lax.transpose(bar, transposed[side][1]), sharding), dtype))
        return tuple(bars)

    # Traced once per signature: every product of it shares this backward.
    f.defvjp(fwd, decided(ji.inlined_jit(bwd)))
    return f(lhs, rhs)


def _typed_shardings(lhs: jax.Array, rhs: jax.Array, dims: Dims, out_sharding: Any) -> tuple:
    """Where types hold shardings (or one is asked for): the result's,
    `lax.dot_general`'s (which raises where it is ambiguous, or refuses
    `out_sharding`), and each operand's, its gradient's. Else Nones."""
    if out_sharding is None and not _explicit_mesh((lhs, rhs)):
        return (None, None, None)
    # Traced, not `jax.eval_shape`: its result has no sharding on a mesh
    # with auto axes too.
    result = jax.make_jaxpr(
        functools.partial(lax.dot_general, dimension_numbers=dims, out_sharding=out_sharding),
    )(lhs, rhs).out_avals[0]  # fmt: skip
    return (result.sharding, jax.typeof(lhs).sharding, jax.typeof(rhs).sharding)


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
