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
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32, HALF_DTYPES, cast, is_float, widest
from jmp_policy.engine.products import cpu_form

# `product(lhs, rhs, preferred_element_type)`: a bilinear dot or convolution.
Product = Callable[[Any, Any, Any], Any]


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
        if not cpu_form.applies(a, b, pet, out_sharding):
            return dot(a, b, pet)
        cpu = functools.partial(
            cpu_form.dot,
            dims=dims,
            precision=_without_algorithm(precision),
            out_sharding=out_sharding,
        )
        return lax.platform_dependent(a, b, cpu=cpu, default=functools.partial(dot, pet=pet))

    return product


def _without_algorithm(precision: Any) -> Any:
    """`precision` less an algorithm preset: the product's operand and accumulation
    types are already the ones it names (half or FP8 operands, float32 result)."""
    return None if isinstance(precision, (lax.DotAlgorithm, lax.DotAlgorithmPreset)) else precision


def product_of(eqn: ji.JaxprEqn, extra: Sequence[Any] = ()) -> Product:
    """A product equation (`dot_general`, `conv_general_dilated`,
    `ragged_dot_general`) as a `product` function of its two floating
    operands; `extra`: its other operands (a grouped product's group sizes)."""
    if eqn.primitive is ji.dot_general_p:
        p = ji.dot_params(eqn)
        return dot_product(p.dimension_numbers, p.precision, p.out_sharding)

    def product(a, b, pet):
        return ji.bind(eqn, [a, b, *extra], ji.with_result_type(eqn, pet))

    return product


def _accumulate_in_float32(
    eqn: ji.JaxprEqn, invals: list[Any], results_dtype: np.dtype = F32
) -> Any:
    """Runs one equation of a transposed product: products accumulate into
    float32 and give their results in `results_dtype`."""
    if eqn.primitive.name in ji.PRODUCT_NAMES:
        lhs, rhs, *extra = invals
        return product_of(eqn, extra)(lhs, rhs, results_dtype)
    # Layout ops between products (transpose, reshape, rev, pad) take the
    # widest input dtype, so a float32 partial result is never rounded to half.
    floats = [x.dtype for x in invals if is_float(x)]
    if len(set(floats)) > 1:
        target = widest(floats)
        invals = [cast(x, target) if is_float(x) else x for x in invals]
    return ji.bind(eqn, invals)


def accumulating_product(
    product: Product,
    lhs: Any,
    rhs: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
    results_dtype: np.dtype = F32,
) -> jax.Array:
    """`product(lhs, rhs)` on half operands with float32 accumulation, both passes.

    `product(a, b, preferred_element_type)` is bilinear (a dot or a convolution).
    Forward: half x half -> `results_dtype` (float32 accumulation), cast to
    `out_dtype`; the half operands are saved. Backward: the cotangent is cast
    to half, each transposed product is half x half -> `results_dtype`, and
    is cast to its primal's dtype. What a sharded program sums across
    devices is the products' results: `results_dtype` is the dtype of those sums.
    """
    dtypes = (compute_dtype, out_dtype, lhs.dtype, rhs.dtype, np.dtype(results_dtype))
    f = _accumulating(product, *dtypes, shared=False)
    return call_reverse_mode_only(f, lhs, rhs, _JVP_UNSUPPORTED)


def accumulating_dot(
    lhs: Any,
    rhs: Any,
    dimension_numbers: Any,
    precision: Any,
    out_sharding: Any,
    compute_dtype: np.dtype,
    out_dtype: np.dtype,
    results_dtype: np.dtype = F32,
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
        *map(np.dtype, (compute_dtype, out_dtype, lhs.dtype, rhs.dtype, results_dtype)),
        # A trace made under the other setting of the CPU form is not reused.
        cpu_form=cpu_form.in_use(),
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
    results_dtype: np.dtype,
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
        return cast(product(lhs, rhs, results_dtype), out_dtype), (lhs, rhs)

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
        run = functools.partial(_accumulate_in_float32, results_dtype=results_dtype)
        lhs_bar, rhs_bar = ji.eval_jaxpr(closed.jaxpr, closed.consts, args, run)
        return cast(lhs_bar, lhs_dtype), cast(rhs_bar, rhs_dtype)

    bwd: Callable = ji.inlined_jit(backward) if shared else backward
    f.defvjp(fwd, decided(lambda res, g: bwd(*res, g)))
    return f


# The backward rules of the products made here (half, FP8, block-scaled): a
# `custom_vjp` holding one has its dtypes decided, and the interpreter leaves
# it as it is. Held weakly: a rule goes with its product.
_DECIDED: weakref.WeakSet[Callable] = weakref.WeakSet()


def decided(bwd: Callable) -> Callable:
    """`bwd`, marked as the backward rule of a product made here."""
    _DECIDED.add(bwd)
    return bwd


def made_here(bwd: Callable | None) -> bool:
    """Whether `bwd` is the backward rule of a product made here."""
    return bwd is not None and bwd in _DECIDED


def call_reverse_mode_only(f: Callable, lhs: Any, rhs: Any, message: str) -> Any:
    """`f(lhs, rhs)` for a `jax.custom_vjp` `f`; under forward mode, a `TypeError(message)`."""
    lhs, rhs = ji.varying_alike(lhs, rhs)
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


def _checked_dtype(op: Callable, lhs: Any, rhs: Any, name: str) -> np.dtype:
    """`op`'s result dtype, its own shape checks run on the operands' shapes
    before the custom VJP: the drop-ins give what `lax` gives.

    Inside the custom VJP a mismatch surfaces as a reshape error of the
    backward products; `lax` names the dimensions that do not fit.
    """
    try:
        return jax.eval_shape(
            op,
            jax.ShapeDtypeStruct(np.shape(lhs), lhs.dtype),
            jax.ShapeDtypeStruct(np.shape(rhs), rhs.dtype),
        ).dtype
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


def float_dot_operands(
    lhs: Any, rhs: Any, dims: Any, precision: Any, preferred_element_type: Any, name: str
) -> tuple[jax.Array, jax.Array, np.dtype]:
    """A dot's floating operands as arrays, their shapes checked against `dims`
    (a `TypeError` or `ValueError` naming `name`), and the dot's result dtype."""
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    out_dtype = _checked_dtype(
        lambda a, b: lax.dot_general(a, b, dims, precision, preferred_element_type),
        lhs, rhs, name,
    )  # fmt: skip
    return lhs, rhs, out_dtype


def half_dot_general(
    lhs: jax.typing.ArrayLike,
    rhs: jax.typing.ArrayLike,
    dimension_numbers: lax.DotDimensionNumbers,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    *,
    out_sharding: Any = None,
    compute_dtype: jax.typing.DTypeLike | None = None,
    reduce_dtype: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """`lax.dot_general` on half operands with float32 accumulation in both passes.

    A drop-in for `lax.dot_general` (same arguments and result dtype), e.g. for
    Flax's `nn.Dense(..., dot_general=half_dot_general)` or `nnx.Linear`.
    Floating operands are cast to `compute_dtype` and multiplied with float32
    accumulation; the result takes the dtype `lax.dot_general` gives
    (`preferred_element_type`, else the operands'). The half operands are what is saved for the
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
      reduce_dtype: the dtype the products (forward and backward) give their
        results in before these take their own dtypes: what a sharded
        program sums across devices (a policy's `r=`). None: float32.

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
    results = F32 if reduce_dtype is None else results_dtype_of(reduce_dtype)
    return accumulating_dot(lhs, rhs, dims, precision, out_sharding, compute, out_dtype, results)


def results_dtype_of(reduce_dtype: Any) -> np.dtype:
    """`reduce_dtype` checked: a half dtype or float32 (a `TypeError` naming it)."""
    try:
        dtype = np.dtype(reduce_dtype)
    except TypeError:
        dtype = None
    if dtype not in (*HALF_DTYPES, F32):
        raise TypeError(
            f"reduce_dtype must be jnp.bfloat16, jnp.float16, jnp.float32 or None "
            f"(float32), got {reduce_dtype!r}."
        )
    return dtype


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
    out_dtype = _checked_dtype(
        lambda a, b: product(a, b, preferred_element_type), lhs, rhs,
        "half_conv_general_dilated",
    )  # fmt: skip
    compute = _half_compute_dtype(compute_dtype, lhs, rhs)
    return accumulating_product(product, lhs, rhs, compute, out_dtype)
