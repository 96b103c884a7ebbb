"""FP8 matrix products with current scaling, per tensor or per row, in both passes.

Each operand of a product is divided by a power-of-two scale, rounded to FP8
(e4m3 forward, e5m2 for the output gradient backward), and the FP8 operands
go into `dot_general` directly with float32 accumulation; the scales multiply
the float32 result. `"tensor"` scaling takes one scale per operand (torchao's
"tensorwise" recipe); `"rowwise"` one per row, along the dimensions the
product does not contract (torchao's "rowwise" recipe; Qwix scales per
channel), so one outlier only coarsens its own row. A scale must be constant
along the contracted dimensions to factor out of the sum, so in the backward
pass, where other dimensions are contracted, row-wise scaling re-scales the
operands along them: the output gradient per row for `d lhs` and per column
for `d rhs`, each saved operand along its forward-contracted dimensions.

The block formats (`"mxfp8"`, `"nvfp4"`) are `block_scaling`'s; `fp8_product`
and `fp8_dot_general` serve all four. Per tensor, as in the block formats,
the products are `shard_local`'s: under `jit` over a mesh each device scales
the blocks it holds by their own amax, and no amax is all-reduced. Row-wise
scaling (and a product given an explicit `out_sharding`) is built here, its
scales taken over the whole operand, as written below.

Three layers of custom rules:

* A `jax.custom_vjp` on the whole product: its backward products are FP8
  too. It saves what `residuals` decides: the e4m3 operands the backward
  products take (per tensor, the forward's own; row-wise, quantized along
  the other axes) and their scales; or, under second-order differentiation,
  the operands in their own dtype (the compute dtype under a policy),
  quantized again in the backward pass: forward-over-reverse needs their
  tangents, which an FP8 residual could only carry in FP8.
* Each FP8 product (the forward one, and each of the two backward ones) is a
  `jax.custom_jvp` whose tangent is the same product in the operands' dtype
  with float32 accumulation, as if the rounding to FP8 were the identity
  (straight-through). So forward-over-reverse (`jax.jvp` of `jax.grad`,
  `jax.hessian`: Hessian-vector products) differentiates the FP8 forward and
  backward passes without casting a tangent to FP8, where it would overflow.
* Plain forward mode (`jax.jvp` of the product itself) meets the custom VJP
  and raises the library's own `TypeError`.

Reference: Micikevicius et al., "FP8 Formats for Deep Learning" (2022),
arXiv:2209.05433; torchao's float8 training recipes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax import lax

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32, cast, is_float, widest
from jmp_policy.core.policy import check_scaling
from jmp_policy.engine.products import cpu_form, shard_local
from jmp_policy.engine.products.block_scaling import FORMATS, block_scaled_product
from jmp_policy.engine.products.fp8_format import (
    E4M3,
    E4M3_MAX,
    E4M3_SCALING,
    E5M2,
    E5M2_MAX,
    E5M2_SCALING,
    Dims,
    fp8_quantize,
    fp8_scale,
)
from jmp_policy.engine.products.half import (
    _accumulate_in_float32,
    call_reverse_mode_only,
    decided,
    dims_key,
    dot_product,
    float_dot_operands,
    results_dtype_of,
    shared_factory,
)
from jmp_policy.engine.residuals import check_residuals, residual_form, to_be_saved_quantized

# Per tensor: e4m3 operands forward, an e5m2 output gradient backward.
PER_TENSOR = shard_local.Recipe(
    forward=(E4M3_SCALING, E4M3_SCALING),
    d_lhs=(E5M2_SCALING, E4M3_SCALING),
    d_rhs=(E5M2_SCALING, E4M3_SCALING),
)

# ------------------------------------------------------------- layouts


class _Layout:
    """Where the axes of a `dot_general`'s operands and result meet.

    The result's axes are the batch axes, then lhs's free (non-contracting,
    non-batch) axes, then rhs's, each in ascending order (as in
    `lax.dot_general`). `maps[src, dst]` sends each axis of `src` that a
    scale of `src` keeps (in that use) to the axis of `dst` holding the same
    index; the scale has size 1 on its other axes.
    """

    def __init__(self, dims: Dims, lhs_ndim: int, rhs_ndim: int):
        (lc, rc), (lb, rb) = dims
        lf = [d for d in range(lhs_ndim) if d not in (*lc, *lb)]
        rf = [d for d in range(rhs_ndim) if d not in (*rc, *rb)]
        nb, nlf = len(lb), len(lf)
        batch = list(range(nb))
        out_lf = [nb + t for t in range(nlf)]
        out_rf = [nb + nlf + t for t in range(len(rf))]
        self.ndim = {"lhs": lhs_ndim, "rhs": rhs_ndim, "out": nb + nlf + len(rf)}
        # The axes each scale is taken over: those its product contracts.
        self.forward_axes = {"lhs": tuple(lc), "rhs": tuple(rc)}
        self.backward_axes = {
            "lhs": tuple(lf),  # d rhs contracts lhs's free axes ...
            "rhs": tuple(rf),  # ... d lhs rhs's,
            "out for d lhs": tuple(out_rf),  # and the output gradient's rhs axes,
            "out for d rhs": tuple(out_lf),  # or its lhs axes.
        }
        self.maps = {
            ("lhs", "out"): dict(zip([*lb, *lf], [*batch, *out_lf])),
            ("rhs", "out"): dict(zip([*rb, *rf], [*batch, *out_rf])),
            ("out", "lhs"): dict(zip([*batch, *out_lf], [*lb, *lf])),
            ("out", "rhs"): dict(zip([*batch, *out_rf], [*rb, *rf])),
            ("rhs", "lhs"): dict(zip([*rb, *rc], [*lb, *lc])),
            ("lhs", "rhs"): dict(zip([*lb, *lc], [*rb, *rc])),
        }

    def place(self, scale: jax.Array, src: str, dst: str) -> jax.Array:
        """A scale of `src` laid out to broadcast against `dst` (a scalar stays one)."""
        if scale.ndim == 0:
            return scale
        axis_map = self.maps[src, dst]
        kept = sorted(axis_map)
        shape = [1] * self.ndim[dst]
        for a in kept:
            shape[axis_map[a]] = scale.shape[a]
        squeezed = scale.reshape([scale.shape[a] for a in kept])
        order = sorted(range(len(kept)), key=lambda k: axis_map[kept[k]])
        return lax.transpose(squeezed, order).reshape(shape)


Bilinear = Callable[[Any, Any], Any]  # `(a, b) -> the float32 product`


def transposed_product(product: Any, lhs: Any, rhs: Any, side: str, results: np.dtype) -> Bilinear:
    """`(g, other) -> d side` of `product(lhs, rhs)` for output gradient `g`.

    JAX's own transpose rule, traced once on float32 stand-ins of the shapes
    (FP8 values cannot be traced through `linear_transpose`), then run on
    operands of any dtype, each product accumulating in float32 and giving
    its result in `results`.
    """
    lhs_spec, rhs_spec = (jax.ShapeDtypeStruct(np.shape(x), F32) for x in (lhs, rhs))
    out = jax.eval_shape(lambda a, b: product(a, b, None), lhs_spec, rhs_spec)
    g_spec = jax.ShapeDtypeStruct(out.shape, F32)
    if side == "lhs":

        def transposed(g, rhs):
            return jax.linear_transpose(lambda x: product(x, rhs, None), lhs_spec)(g)[0]

        closed = jax.make_jaxpr(transposed)(g_spec, rhs_spec)
    else:

        def transposed(g, lhs):
            return jax.linear_transpose(lambda y: product(lhs, y, None), rhs_spec)(g)[0]

        closed = jax.make_jaxpr(transposed)(g_spec, lhs_spec)

    accumulate = functools.partial(_accumulate_in_float32, results_dtype=results)

    def run(g, other):
        return ji.eval_jaxpr(closed.jaxpr, closed.consts, [g, other], accumulate)[0]

    return run


def _scaled_bilinear(
    bilinear: Bilinear,
    qa: jax.Array,
    qb: jax.Array,
    scales: tuple[jax.Array, jax.Array],
    place: tuple[Callable[[Any], Any], Callable[[Any], Any]],
) -> jax.Array:
    """`bilinear(qa, qb)` of FP8 operands with their scales applied, in float32."""
    # One scale after the other: their product could underflow on its own.
    # (Powers of two: exact on a result `bilinear` gave in a narrower dtype.)
    return bilinear(qa, qb).astype(F32) * place[0](scales[0]) * place[1](scales[1])


def _fp8_bilinear(
    bilinear: Bilinear,
    a: jax.Array,
    b: jax.Array,
    scales: tuple[jax.Array, jax.Array],
    formats: tuple[tuple[np.dtype, float], tuple[np.dtype, float]],
    place: tuple[Callable[[Any], Any], Callable[[Any], Any]],
) -> jax.Array:
    """`bilinear(a, b)` on FP8 operands, the scales applied to the float32 result.

    A `jax.custom_jvp`: the tangent is `bilinear(da, b) + bilinear(a, db)` on
    the operands' (widest) dtype with float32 accumulation, never in FP8
    (straight-through: the rounding counts as the identity). The scales are
    constants.
    """

    @jax.custom_jvp
    def f(a, b, sa, sb):
        qa = fp8_quantize(a, sa, formats[0][0], formats[0][1])
        qb = fp8_quantize(b, sb, formats[1][0], formats[1][1])
        return _scaled_bilinear(bilinear, qa, qb, (sa, sb), place)

    @f.defjvp
    def f_jvp(primals, tangents):
        a, b, sa, sb = primals
        da, db, _, _ = tangents
        c = widest([a.dtype, b.dtype])
        tangent = bilinear(cast(da, c), cast(b, c)) + bilinear(cast(a, c), cast(db, c))
        return f(a, b, sa, sb), tangent.astype(F32)

    return f(a, b, *scales)


def fp8_product(
    lhs: jax.Array,
    rhs: jax.Array,
    dims: Dims,
    out_dtype: np.dtype,
    scaling: str = "tensor",
    precision: lax.PrecisionLike = None,
    out_sharding: Any = None,
    residuals: str | None = None,
    results_dtype: Any = F32,
) -> jax.Array:
    """`lax.dot_general(lhs, rhs, dims)` in FP8 (or FP4) with `scaling`, both passes.

    Current scaling (`"tensor"`, `"rowwise"`): each operand is scaled (per
    tensor, or per row along its non-contracting axes) to e4m3; the e4m3
    operands go into the product directly, accumulating in float32; the
    result is multiplied by the scales and cast to `out_dtype`. Backward: the
    output gradient is scaled to e5m2 (per tensor, or per row of the axes
    each backward product keeps) and each transposed product takes it and an
    e4m3 operand (scaled along the axes that product keeps), accumulating in
    float32. The block formats (`"mxfp8"`, `"nvfp4"`): `block_scaling`.
    What is saved for the backward pass: `residuals`' choice (None: as
    `residuals.fp8_residuals` sets it), the operands under second order.
    Every FP8 (or FP4) product gives its results in `results_dtype` (what a
    sharded program sums), the scales applied after, in float32.
    """
    dims = dims_key(dims)
    form = residual_form(residuals, lhs, rhs)
    if scaling in FORMATS:
        return call_reverse_mode_only(
            functools.partial(
                block_scaled_product, dims=dims, out_dtype=out_dtype, fmt=scaling,
                residuals=form, out_sharding=out_sharding, results_dtype=results_dtype,
            ),
            lhs, rhs, _JVP_UNSUPPORTED,
        )  # fmt: skip
    f = _shared_fp8_product(
        dims, np.dtype(out_dtype), check_scaling(scaling), precision, out_sharding, form,
        np.dtype(results_dtype),
        # A trace made under the other setting of the CPU form is not reused.
        cpu_form=cpu_form.in_use(),
    )  # fmt: skip
    return call_reverse_mode_only(f, lhs, rhs, _JVP_UNSUPPORTED)


@shared_factory
def _shared_fp8_product(
    dims: Dims,
    out_dtype: np.dtype,
    scaling: str,
    precision: Any,
    out_sharding: Any,
    residuals: str,
    results: np.dtype,
    *,
    cpu_form: bool,
) -> Callable:
    """`fp8_product`'s function of one signature: an inlined `jax.jit`, so that
    JAX traces, differentiates and transposes it once (see `accumulating_dot`)."""
    del cpu_form  # Only a key: the products read the setting as they trace.
    if scaling == "tensor":
        return ji.inlined_jit(
            functools.partial(
                shard_local.product, dims=dims, out_dtype=out_dtype, recipe=PER_TENSOR,
                precision=precision, residuals=residuals, results=results,
                out_sharding=out_sharding,
            )
        )  # fmt: skip
    return ji.inlined_jit(
        functools.partial(
            _fp8_product, dims=dims, out_dtype=out_dtype, rowwise=scaling == "rowwise",
            product=dot_product(dims, precision, out_sharding), residuals=residuals,
            results=results,
        )
    )  # fmt: skip


_E4M3, _E5M2 = (E4M3, E4M3_MAX), (E5M2, E5M2_MAX)


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How one FP8 product scales its operands: per tensor or per row, on `layout`."""

    layout: _Layout
    rowwise: bool

    def scale(self, x: jax.Array, fmt: tuple, axes: tuple | None) -> jax.Array:
        return fp8_scale(x, fmt[1], axes if self.rowwise else None)

    def placers(self, a: str, b: str, dst: str) -> tuple[Callable, Callable]:
        """How scales of `a` and of `b` broadcast against `dst`."""
        return (
            lambda s: self.layout.place(s, a, dst),
            lambda s: self.layout.place(s, b, dst),
        )

    def backward_scales(self, lhs: jax.Array, rhs: jax.Array) -> tuple[jax.Array, jax.Array]:
        """Each operand's scale for the backward product that keeps its other axes."""
        axes = self.layout.backward_axes
        return self.scale(lhs, _E4M3, axes["lhs"]), self.scale(rhs, _E4M3, axes["rhs"])

    def gradient_scales(self, g: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The output gradient's scales for `d lhs` and for `d rhs`."""
        if not self.rowwise:
            sg = self.scale(g, _E5M2, None)
            return sg, sg
        axes = self.layout.backward_axes
        return self.scale(g, _E5M2, axes["out for d lhs"]), self.scale(
            g, _E5M2, axes["out for d rhs"]
        )


def _fp8_forward(
    recipe: _Recipe, results_of: Callable, lhs: jax.Array, rhs: jax.Array, residuals: str
) -> tuple[jax.Array, tuple]:
    """The forward product, and what its backward pass needs."""
    axes = recipe.layout.forward_axes
    sl, sr = recipe.scale(lhs, _E4M3, axes["lhs"]), recipe.scale(rhs, _E4M3, axes["rhs"])
    forward = recipe.placers("lhs", "rhs", "out")
    if residuals == "operands":
        out = _fp8_bilinear(results_of, lhs, rhs, (sl, sr), (_E4M3, _E4M3), forward)
        if recipe.rowwise:  # The backward products keep other axes: scaled along those.
            sl, sr = recipe.backward_scales(lhs, rhs)
        return out, (lhs, rhs, sl, sr)
    # Saved quantized, the operands have no tangents (differentiating them
    # raises), so the forward product takes the very e4m3 copies it saves:
    # per tensor, a sharded program gathers one FP8 copy for both passes.
    lhs, rhs = to_be_saved_quantized((lhs, rhs))
    ql, qr = fp8_quantize(lhs, sl, *_E4M3), fp8_quantize(rhs, sr, *_E4M3)
    out = _scaled_bilinear(results_of, ql, qr, (sl, sr), forward)
    if recipe.rowwise:
        sl, sr = recipe.backward_scales(lhs, rhs)
        ql, qr = fp8_quantize(lhs, sl, *_E4M3), fp8_quantize(rhs, sr, *_E4M3)
    return out, (ql, qr, sl, sr)


def _fp8_backward(
    recipe: _Recipe, transposed: tuple[Callable, Callable], res: tuple, g: jax.Array, residuals: str
) -> tuple[jax.Array, jax.Array]:
    """`d lhs` and `d rhs` from the output gradient `g` and the forward's residuals."""
    t_lhs, t_rhs = transposed
    sg_lhs, sg_rhs = recipe.gradient_scales(g)
    to_lhs, to_rhs = recipe.placers("out", "rhs", "lhs"), recipe.placers("out", "lhs", "rhs")
    if residuals == "operands":
        lhs, rhs, sl, sr = res
        lhs_bar = _fp8_bilinear(t_lhs, g, rhs, (sg_lhs, sr), (_E5M2, _E4M3), to_lhs)
        rhs_bar = _fp8_bilinear(t_rhs, g, lhs, (sg_rhs, sl), (_E5M2, _E4M3), to_rhs)
        return lhs_bar, rhs_bar
    ql, qr, sl, sr = res
    # Per tensor, both backward products take one e5m2 copy of `g`.
    qg_lhs = fp8_quantize(g, sg_lhs, *_E5M2)
    qg_rhs = fp8_quantize(g, sg_rhs, *_E5M2) if recipe.rowwise else qg_lhs
    lhs_bar = _scaled_bilinear(t_lhs, qg_lhs, qr, (sg_lhs, sr), to_lhs)
    rhs_bar = _scaled_bilinear(t_rhs, qg_rhs, ql, (sg_rhs, sl), to_rhs)
    return lhs_bar, rhs_bar


def _fp8_product(
    lhs: jax.Array,
    rhs: jax.Array,
    *,
    dims: Dims,
    out_dtype: np.dtype,
    rowwise: bool,
    product: Callable,
    residuals: str,
    results: np.dtype,
) -> jax.Array:
    recipe = _Recipe(_Layout(dims, lhs.ndim, rhs.ndim), rowwise)
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype
    transposed = (
        transposed_product(product, lhs, rhs, "lhs", results),
        transposed_product(product, lhs, rhs, "rhs", results),
    )

    @jax.custom_vjp
    def f(lhs, rhs):
        return fwd(lhs, rhs)[0]

    def fwd(lhs, rhs):
        results_of = lambda a, b: product(a, b, results)  # noqa: E731
        out, res = _fp8_forward(recipe, results_of, lhs, rhs, residuals)
        return cast(out, out_dtype), res

    def bwd(res, g):
        lhs_bar, rhs_bar = _fp8_backward(recipe, transposed, res, g, residuals)
        return cast(lhs_bar, lhs_dtype), cast(rhs_bar, rhs_dtype)

    # Traced once per shape signature: every product of it shares this backward.
    f.defvjp(fwd, decided(ji.inlined_jit(bwd)))
    return f(lhs, rhs)


_JVP_UNSUPPORTED = (
    "Forward-mode differentiation (jax.jvp, jax.jacfwd, jax.linearize) of jmp_policy's "
    "FP8 matmuls (fp8_dot_general, and the policies with m=f8, e.g. mixed_float8, "
    "mixed_float8_rowwise) is not supported: their jax.custom_vjp defines reverse mode "
    "only. Use reverse mode (jax.grad, jax.vjp, jax.jacrev); forward over reverse "
    "(jax.jvp of jax.grad, jax.hessian) works, with the tangents in the operands' dtype. "
    "For forward mode itself, use a policy without an FP8 matmul dtype."
)


def fp8_dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    out_sharding: Any = None,
    scaling: str = "tensor",
    residuals: str | None = None,
    reduce_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """`lax.dot_general` in FP8 (or FP4), float32 accumulation, both passes.

    A drop-in for `lax.dot_general` (same arguments and result dtype), e.g. for
    Flax's `nn.Dense(..., dot_general=fp8_dot_general)`; what a policy with an
    FP8 or FP4 matmul dtype (`"mixed_float8"`, `"mixed_float8_rowwise"`,
    `"mixed_mxfp8"`, `"mixed_nvfp4"`) puts in every layer. Stateless: every
    scale is computed from this step's values. A `jax.custom_vjp` makes the
    backward products low-precision too; cotangents come back in the
    operands' own dtypes.

    `scaling="tensor"`: each operand is divided by a power of two
    `s >= amax / 448`, rounded to float8_e4m3fn, and the FP8 operands go into
    `lax.dot_general` directly (`preferred_element_type=float32`, the form
    XLA's GPU compiler runs as an FP8 GEMM on Hopper); the result is
    multiplied by the scales. Backward, the output gradient is scaled to
    float8_e5m2 (max 57344, 2 mantissa bits). `"rowwise"`: one scale per
    row, per index of the dimensions an operand is not contracted over, so an
    outlier in one row (one token, one sample) leaves the other rows alone;
    backward, the output gradient is scaled per row for `d lhs` and per
    column for `d rhs`, and each operand along its forward-contracted
    dimensions, so that every product's scales stay outside its sum (on GPU
    the per-row rescale is an epilogue outside cuBLASLt's FP8 GEMM).
    `"mxfp8"`: e4m3 elements with a power-of-two scale (float8_e8m0fnu) per
    block of 32 along the contraction, gradients too. `"nvfp4"`:
    float4_e2m1fn elements with a float8_e4m3fn scale per block of 16 and a
    float32 scale per tensor; gradients rounded stochastically, and a random
    Hadamard transform before the product contracting the rows. The block
    formats run through `jax.nn.scaled_matmul` (natively on NVIDIA
    Blackwell, emulated on CPU); see the FP8 guide for the recipes followed.

    What the forward pass saves (`residuals`): `"quantized"` (the default,
    or what `fp8_residuals` sets) saves the low-precision copies of the
    operands the backward products take; a product differentiated twice
    (`jax.hessian`, `jax.jvp` of `jax.grad`, seen as it is traced) saves the
    operands themselves and quantizes them again, with tangents carried in
    the operands' dtype; `"operands"` always does. Forward mode of the
    product itself is not supported.

    Errors: e4m3 keeps 3 mantissa bits, a relative rounding error of at most
    2^-4 per operand element; e5m2 2^-3; e2m1 1 bit. Operands whose scaled
    values are e4m3 numbers (e.g. small integers times a power of two)
    multiply exactly. An inf or NaN in an operand or gradient gives a
    non-finite result (the scale carries it), so `loss_scaled` skips the
    step. An empty operand gives what `lax.dot_general` gives; non-floating
    operands fall back to `lax.dot_general`.

    `lhs`, `rhs`, `dimension_numbers`, `precision`, `preferred_element_type`
    and `out_sharding` are as in `lax.dot_general`.

    Args:
      scaling: `"tensor"`, `"rowwise"`, `"mxfp8"` or `"nvfp4"`.
      residuals: `"quantized"`, `"operands"`, or None (as `fp8_residuals` sets).
      reduce_dtype: the dtype the low-precision products give their results
        in, before the scales and the result dtype (what a sharded program
        sums, as in `half_dot_general`). None: float32.

    Returns:
      The product, in the dtype `lax.dot_general` would give.

    Raises:
      ValueError: if `scaling` or `residuals` is not one of those.
      TypeError: if the operands' shapes do not fit `dimension_numbers`
        (naming the dimensions, as `lax.dot_general` does); under
        forward-mode differentiation of the product (`jax.jvp`, `jax.jacfwd`),
        or of quantized residuals (see `fp8_residuals`).

    >>> import jax, jax.numpy as jnp
    >>> from jmp_policy import fp8_dot_general
    >>> x, w = jnp.full((2, 3), 0.5), jnp.full((3, 4), 3.0)
    >>> y = fp8_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, float(y[0, 0])  # 0.5 and 3 are e4m3 numbers: exact
    (dtype('float32'), 4.5)
    >>> g = jax.grad(lambda w: fp8_dot_general(x, w, (((1,), (0,)), ((), ()))).sum())(w)
    >>> g.dtype, float(g[0, 0])
    (dtype('float32'), 1.0)
    >>> x = x.at[0, 0].set(1e6)  # an outlier: row-wise, the other row stays exact
    >>> float(fp8_dot_general(x, w, (((1,), (0,)), ((), ())), scaling="rowwise")[1, 0])
    4.5
    >>> float(fp8_dot_general(x, w, (((1,), (0,)), ((), ())), scaling="mxfp8")[1, 0])
    4.5
    """
    check_scaling(scaling)
    if residuals is not None:
        check_residuals(residuals)
    dims = dims_key(dimension_numbers)
    if not (is_float(lhs) and is_float(rhs)):
        return lax.dot_general(lhs, rhs, dims, precision, preferred_element_type,
                               out_sharding=out_sharding)  # fmt: skip
    lhs, rhs, out_dtype = float_dot_operands(
        lhs, rhs, dims, precision, preferred_element_type, "fp8_dot_general"
    )
    results = F32 if reduce_dtype is None else results_dtype_of(reduce_dtype)
    return fp8_product(
        lhs, rhs, dims, out_dtype, scaling, precision, out_sharding, residuals, results
    )
