"""Matrix products on half operands with float32 accumulation, in both passes.

The known trap: `lax.dot_general(x_half, w_half, preferred_element_type=float32)`
has a float32 result, so JAX's backward pass multiplies the float32 cotangent by
the saved half operand and the weight-gradient matmul runs float32 x float32
(no Tensor Cores). `half_dot_general` and `half_conv_general_dilated` carry a
`jax.custom_vjp` whose backward products take half operands and accumulate in
float32 too. Reference: Micikevicius et al., "Mixed Precision Training" (ICLR
2018), section 3.3.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32, HALF_DTYPES, cast, is_float, widest

# `product(lhs, rhs, preferred_element_type)`: a bilinear dot or convolution.
Product = Callable[[Any, Any, Any], Any]


# XLA:CPU (jaxlib 0.10.2) rejects some bf16 x bf16 -> f32 dots: "UNIMPLEMENTED:
# Unsupported element type for DotThunk::Execute: BF16 x BF16 = F32". Which ones
# depends on the layout, the sizes and what XLA fuses around the dot (e.g.
# [2,2,8,6] x [2,6,2,8] with batch dimensions (0, 1) and (0, 2); [8,6] x [6,8,6]
# contracting 0 with 1), not on the CPU's instructions: they fail with and
# without AVX512-BF16 and under --xla_cpu_max_isa=AVX2 or SSE4_2 alike. One form
# ran in every case tried (tests/test_cpu_layouts.py, the test suite, random
# layouts): both operands transposed to [B, K, M] and [B, K, N]. Dense-like
# dots left as written (XLA:CPU runs them up to 2x faster with bf16
# instructions) failed in context: XLA folds transposes around them into a
# form it rejects. So on the CPU platform every half x half -> f32 dot takes
# the [B, K, .] form (its cost: benchmarks/cpu_dot.py), and loses any
# DotAlgorithmPreset: JAX refuses to lower F16_F16_F32 (asked for by
# jax.nn.dot_product_attention) for CPU, and half operands with float32
# accumulation is what the form computes anyway.
# `lax.platform_dependent` keeps the branch out of GPU and TPU programs, which
# get the dot as written. JMP_POLICY_CPU_BF16_DOT_WORKAROUND=0 turns it off (to
# check a newer jaxlib).
def cpu_bf16_dot_workaround(env: Mapping[str, str] = os.environ) -> bool:
    """Whether half x half -> f32 dots on the CPU platform take the form XLA:CPU runs."""
    return env.get("JMP_POLICY_CPU_BF16_DOT_WORKAROUND", "1") != "0"


_CPU_BF16_DOT_WORKAROUND = cpu_bf16_dot_workaround()


def cpu_form_in_use() -> bool:
    """The setting products traced now take (part of a shared product's signature)."""
    return _CPU_BF16_DOT_WORKAROUND


def dot_product(dimension_numbers: Any, precision: Any = None, out_sharding: Any = None) -> Product:
    """`lax.dot_general` as a `product(lhs, rhs, preferred_element_type)`."""
    dims = dims_key(dimension_numbers)

    def dot(a, b, pet, precision=precision):
        return lax.dot_general(a, b, dims, precision, pet, out_sharding=out_sharding)

    def product(a, b, pet):
        if jnp.issubdtype(a.dtype, jnp.floating) and a.dtype.itemsize == 1:
            # FP8 operands go into the dot as they are: an algorithm preset
            # (F16_F16_F32) would have JAX convert them to its input type.
            return dot(a, b, pet, _without_algorithm(precision))
        half_to_f32 = a.dtype in HALF_DTYPES and pet == F32 and not _explicit(out_sharding)
        if not (half_to_f32 and _CPU_BF16_DOT_WORKAROUND):
            return dot(a, b, pet)
        cpu = functools.partial(
            _cpu_dot, dims=dims, precision=_without_algorithm(precision), out_sharding=out_sharding
        )
        return lax.platform_dependent(a, b, cpu=cpu, default=functools.partial(dot, pet=pet))

    return product


def _explicit(sharding: Any) -> bool:
    """Whether `sharding` is on a mesh with explicit axes: the form's reshapes
    would merge dimensions JAX keeps sharded by type, so the dot runs as written."""
    mesh = getattr(sharding, "mesh", None)
    return jax.sharding.AxisType.Explicit in getattr(mesh, "axis_types", ())


def _without_algorithm(precision: Any) -> Any:
    """`precision` less an algorithm preset: the product's operand and accumulation
    types are already the ones it names (half or FP8 operands, float32 result)."""
    return None if isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset)) else precision


# The name scope of the CPU form: a program's debug locations show where it is.
CPU_FORM_SCOPE = "jmp_policy_cpu_dot"


@jax.named_scope(CPU_FORM_SCOPE)
def _cpu_dot(lhs, rhs, dims, precision, out_sharding):
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


def product_of(eqn: ji.JaxprEqn) -> Product:
    """A `dot_general` or `conv_general_dilated` equation as a `product` function."""
    if eqn.primitive is ji.dot_general_p:
        p = ji.dot_params(eqn)
        return dot_product(p.dimension_numbers, p.precision, p.out_sharding)

    def conv(a, b, pet):
        return ji.bind(eqn, [a, b], ji.conv_with_result_type(eqn, pet))

    return conv


def _accumulate_in_float32(eqn: ji.JaxprEqn, invals: list[Any]) -> Any:
    """Runs one equation of a transposed product: products accumulate into float32."""
    if eqn.primitive in (ji.dot_general_p, ji.conv_general_dilated_p):
        lhs, rhs = invals
        return product_of(eqn)(lhs, rhs, F32)
    # Layout ops between products (transpose, reshape, rev, pad) take the
    # widest input dtype, so a float32 partial result is never rounded to half.
    floats = [x.dtype for x in invals if is_float(x)]
    if len(set(floats)) > 1:
        target = widest(floats)
        invals = [cast(x, target) if is_float(x) else x for x in invals]
    return ji.bind(eqn, invals)


def accumulating_product(
    product: Product, lhs: Any, rhs: Any, compute_dtype: np.dtype, out_dtype: np.dtype
) -> jax.Array:
    """`product(lhs, rhs)` on half operands with float32 accumulation, both passes.

    `product(a, b, preferred_element_type)` is bilinear (a dot or a convolution).
    Forward: half x half -> float32, cast to `out_dtype`; the half operands are
    saved. Backward: the cotangent is cast to half, each transposed product is
    half x half -> float32, and is cast to its primal's dtype.
    """
    f = _accumulating(product, compute_dtype, out_dtype, lhs.dtype, rhs.dtype, shared=False)
    return call_reverse_mode_only(f, lhs, rhs, _JVP_UNSUPPORTED)


def accumulating_dot(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any,
    out_sharding: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
) -> jax.Array:
    """`accumulating_product` of `lax.dot_general`, traced once per signature.

    A deep model makes the same products in every layer. Here each signature
    (dimensions, precision, sharding, dtypes) has one function, whose forward
    and backward are inlined `jax.jit`s: JAX traces them once (its caches key
    on the function and the shapes) and inlines the traced program at every
    call, so the program is the one tracing each product anew would give.
    """
    f = _shared_accumulating_dot(
        dims_key(dimension_numbers), precision, out_sharding,
        *map(np.dtype, (compute_dtype, out_dtype, lhs.dtype, rhs.dtype)),
        # A trace made under the other setting of the CPU form is not reused.
        cpu_form=cpu_form_in_use(),
    )  # fmt: skip
    return call_reverse_mode_only(f, lhs, rhs, _JVP_UNSUPPORTED)


# The caches of the shared product functions (this module's and fp8's).
_SHARED_FACTORIES: list[Any] = []


def shared_factory(factory: Callable) -> Callable:
    """`functools.cache` of a factory of shared product functions, which
    `clear_shared_products` empties."""
    cached = functools.cache(factory)
    _SHARED_FACTORIES.append(cached)
    return cached


def clear_shared_products() -> None:
    """Forgets the shared product functions: the next trace starts cold."""
    for cached in _SHARED_FACTORIES:
        cached.cache_clear()


def dims_key(dims: Any) -> Any:
    """Dimension numbers as nested tuples of ints: hashable, equal when equal."""
    return tuple(dims_key(d) for d in dims) if isinstance(dims, (tuple, list)) else int(dims)


@shared_factory
def _shared_accumulating_dot(
    dims: Any, precision: Any, out_sharding: Any, *dtypes: np.dtype, cpu_form: bool
) -> Callable:
    del cpu_form  # Only a key: `dot_product` reads the setting as it traces.
    product = dot_product(dims, precision, out_sharding)
    return ji.inlined_jit(_accumulating(product, *dtypes, shared=True))


def _accumulating(
    product: Product,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
    lhs_dtype: np.dtype,
    rhs_dtype: np.dtype,
    *,
    shared: bool,
) -> Callable:
    """The custom-VJP function of `accumulating_product` (its backward an
    inlined `jax.jit` where the function is `shared` between calls)."""

    @jax.custom_vjp
    def f(lhs, rhs):
        return fwd(lhs, rhs)[0]

    def fwd(lhs, rhs):
        lhs, rhs = cast(lhs, compute_dtype), cast(rhs, compute_dtype)
        return cast(product(lhs, rhs, F32), out_dtype), (lhs, rhs)

    def backward(lhs, rhs, g):
        g = cast(g, compute_dtype)

        def transposes(a, b, g):
            # JAX's own transpose rules, traced on half values ...
            (a_bar,) = jax.linear_transpose(lambda x: product(x, b, None), a)(g)
            (b_bar,) = jax.linear_transpose(lambda y: product(a, y, None), b)(g)
            return a_bar, b_bar

        closed = jax.make_jaxpr(transposes)(lhs, rhs, g)
        # ... then run with each product accumulating into float32.
        args = [lhs, rhs, g]
        lhs_bar, rhs_bar = ji.eval_jaxpr(closed.jaxpr, closed.consts, args, _accumulate_in_float32)
        return cast(lhs_bar, lhs_dtype), cast(rhs_bar, rhs_dtype)

    bwd: Callable = ji.inlined_jit(backward) if shared else backward
    f.defvjp(fwd, lambda res, g: bwd(*res, g))
    return f


def call_reverse_mode_only(f: Callable, lhs: Any, rhs: Any, message: str) -> Any:
    """`f(lhs, rhs)` for a `jax.custom_vjp` `f`; under forward mode, a `TypeError(message)`."""
    try:
        return f(lhs, rhs)
    except TypeError as e:
        # JAX's own message names neither this library nor a way out.
        if not ji.is_forward_mode_of_custom_vjp(e):
            raise
        raise TypeError(message) from e


_JVP_UNSUPPORTED = (
    "Forward-mode differentiation (jax.jvp, jax.jacfwd) through "
    "jmp_policy's float32-accumulating half matmuls (half_dot_general, "
    "half_conv_general_dilated, and autocast, which uses them) is not supported: "
    "their jax.custom_vjp defines reverse mode only. Use reverse mode (jax.grad, "
    "jax.vjp, jax.jacrev), or for forward mode use plain lax.dot_general / "
    "lax.conv_general_dilated with preferred_element_type=jnp.float32 (or autocast "
    "with half_primitives=()). Forward over reverse (jax.hessian) works."
)


def _check_shapes(op: Callable, lhs: Any, rhs: Any, name: str) -> None:
    """Runs `op`'s own shape checks on the operands' shapes, before the custom VJP.

    Inside the custom VJP a mismatch surfaces as a reshape error of the
    backward products; `lax` names the dimensions that do not fit.
    """
    try:
        jax.eval_shape(
            op,
            jax.ShapeDtypeStruct(np.shape(lhs), lhs.dtype),
            jax.ShapeDtypeStruct(np.shape(rhs), rhs.dtype),
        )
    except (TypeError, ValueError) as e:  # The class lax raises, with its words.
        raise type(e)(
            f"{name}: lhs of shape {tuple(np.shape(lhs))} and rhs of shape "
            f"{tuple(np.shape(rhs))} do not fit: {e}"
        ) from None


def _half_compute_dtype(compute_dtype: Any, lhs: jax.Array, rhs: jax.Array) -> np.dtype:
    """`compute_dtype` checked, or by default the operands' half dtype (else bfloat16)."""
    if compute_dtype is None:
        # float16 operands stay float16: bfloat16 would drop 3 mantissa bits.
        halves = [x.dtype for x in (lhs, rhs) if x.dtype in HALF_DTYPES]
        return np.dtype(halves[0]) if halves else HALF_DTYPES[0]
    try:
        dtype = np.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype not in HALF_DTYPES:
        raise TypeError(
            f"compute_dtype must be jnp.bfloat16, jnp.float16 or None (the operands' "
            f"half dtype, else bfloat16), got {compute_dtype!r}."
        )
    return dtype


def _result_dtype(lhs: jax.Array, rhs: jax.Array, preferred_element_type: Any) -> np.dtype:
    if preferred_element_type is not None:
        return np.dtype(preferred_element_type)
    return widest([lhs.dtype, rhs.dtype])


def float_dot_operands(
    lhs: Any, rhs: Any, dims: Any, precision: Any, preferred_element_type: Any, name: str
) -> tuple[jax.Array, jax.Array, np.dtype]:
    """A dot's floating operands as arrays, their shapes checked against `dims`
    (a `TypeError` or `ValueError` naming `name`), and the dot's result dtype."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_shapes(
        lambda a, b: lax.dot_general(a, b, dims, precision, preferred_element_type),
        lhs, rhs, name,
    )  # fmt: skip
    return lhs, rhs, _result_dtype(lhs, rhs, preferred_element_type)


def half_dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    out_sharding: Any = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """`lax.dot_general` on half operands with float32 accumulation in both passes.

    A drop-in for `lax.dot_general` (same arguments and result dtype), e.g. for
    Flax's `nn.Dense(..., dot_general=half_dot_general)` or `nnx.Linear`.
    Floating operands are cast to `compute_dtype` and multiplied with float32
    accumulation; the result takes `preferred_element_type`, or else the
    operands' (widest) dtype. The half operands are what is saved for the
    backward pass. A `jax.custom_vjp` makes the two backward products
    half x half with float32 accumulation as well, and returns cotangents in the
    operands' own dtypes. Non-floating operands fall back to `lax.dot_general`.
    By default the product runs in the operands' half dtype (float16 under a
    float16 policy, bfloat16 under a bfloat16 one) and in bfloat16 for
    float32 operands; `compute_dtype` fixes it.

    `lhs`, `rhs`, `dimension_numbers`, `precision`, `preferred_element_type`
    and `out_sharding` are as in `lax.dot_general`.

    Args:
      compute_dtype: the dtype the operands are multiplied in: jnp.bfloat16,
        jnp.float16, or None for the operands' half dtype (else bfloat16).

    Returns:
      The product, in the dtype `lax.dot_general` would give.

    Raises:
      TypeError: if `compute_dtype` is not a half dtype or None; if the
        operands' shapes do not fit `dimension_numbers` (naming the dimensions,
        as `lax.dot_general` does); under forward-mode differentiation
        (`jax.jvp`, `jax.jacfwd`), which the custom VJP does not support (with
        `jax.jit` between `jax.jvp` and this call, JAX reports it when it
        compiles, in its own words: "can't apply forward-mode autodiff (jvp)
        to a custom_vjp function").

    >>> import jax, jax.numpy as jnp
    >>> from jmp_policy import half_dot_general
    >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    >>> y = half_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, float(y[0, 0])
    (dtype('float32'), 3.0)
    >>> jax.grad(lambda w: half_dot_general(x, w, (((1,), (0,)), ((), ()))).sum())(w).dtype
    dtype('float32')
    """
    dims = dims_key(dimension_numbers)
    if not (is_float(lhs) and is_float(rhs)):
        return lax.dot_general(lhs, rhs, dims, precision, preferred_element_type,
                               out_sharding=out_sharding)  # fmt: skip
    lhs, rhs, out_dtype = float_dot_operands(
        lhs, rhs, dims, precision, preferred_element_type, "half_dot_general"
    )
    compute = _half_compute_dtype(compute_dtype, lhs, rhs)
    return accumulating_dot(lhs, rhs, dims, precision, out_sharding, compute, out_dtype)


def half_conv_general_dilated(
    lhs: jax.Array,
    rhs: jax.Array,
    window_strides: Sequence[int],
    padding: str | Sequence[tuple[int, int]],
    lhs_dilation: Sequence[int] | None = None,
    rhs_dilation: Sequence[int] | None = None,
    dimension_numbers: lax.ConvGeneralDilatedDimensionNumbers = None,
    feature_group_count: int = 1,
    batch_group_count: int = 1,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    compute_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """`lax.conv_general_dilated` on half operands, float32 accumulation in both passes.

    The convolution counterpart of `half_dot_general`, a drop-in for Flax's
    `nn.Conv(..., conv_general_dilated=half_conv_general_dilated)`.

    `lhs`, `rhs`, `window_strides`, `padding`, `lhs_dilation`, `rhs_dilation`,
    `dimension_numbers`, `feature_group_count`, `batch_group_count`, `precision`
    and `preferred_element_type` are as in `lax.conv_general_dilated`.

    Args:
      compute_dtype: as in `half_dot_general`.

    Returns:
      The convolution, in the dtype `lax.conv_general_dilated` would give.

    >>> import jax.numpy as jnp
    >>> from jmp_policy import half_conv_general_dilated
    >>> y = half_conv_general_dilated(jnp.ones((1, 2, 5)), jnp.ones((3, 2, 2)), (1,), "VALID")
    >>> y.shape, y.dtype
    ((1, 3, 4), dtype('float32'))
    """

    def product(a, b, pet):
        return lax.conv_general_dilated(
            a, b, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, pet,
        )  # fmt: skip

    if not (is_float(lhs) and is_float(rhs)):
        return product(lhs, rhs, preferred_element_type)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_shapes(
        lambda a, b: product(a, b, preferred_element_type), lhs, rhs,
        "half_conv_general_dilated",
    )  # fmt: skip
    out_dtype = _result_dtype(lhs, rhs, preferred_element_type)
    compute = _half_compute_dtype(compute_dtype, lhs, rhs)
    return accumulating_product(product, lhs, rhs, compute, out_dtype)
