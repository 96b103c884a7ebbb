"""Op-level mixed precision: `autocast` and float32-accumulating half matmuls.

`autocast(fn, policy)` traces `fn` to a jaxpr and runs it again equation by
equation, choosing each operation's precision the way `torch.autocast` does:

* `HALF_PRIMITIVES` (matmuls and convolutions) take `policy.compute_dtype`
  operands and accumulate in float32 (`preferred_element_type=float32`), in the
  forward *and* the backward pass (see `half_dot_general`). Their result keeps
  the dtype the traced program gave it, so a float32 program stays float32
  between matmuls.
* `FLOAT32_PRIMITIVES` (exp, log, pow, sqrt, sums, products, ...) run in
  float32 (or wider); so do the softmax, logsumexp, norm, variance and loss
  patterns built from them. Their result stays float32.
* `PROMOTE_PRIMITIVES` (elementwise arithmetic, comparisons, reshapes, max
  reductions, ...) run in the widest floating dtype of their inputs.
* Anything else runs as written: its floating inputs are cast back to the
  dtypes the traced program had, so it always type-checks.

Integers, booleans and PRNG keys are never touched, and explicit casts in the
program are kept (so `jnp.mean` of a bf16 array, which sums in float32 and
casts back, still returns bf16). Nested programs are rewritten too: `jit` and
`checkpoint` as if inlined; `custom_jvp` functions (`jax.nn.relu`,
`jax.nn.softmax`, ...) and their JVP rules, on inputs of the dtypes the rule
was written for; `scan`, `while_loop` and `cond` with the input and output
dtypes of the original, so loop carries and branches stay type-correct.

The known trap this module avoids: `lax.dot_general(x_half, w_half,
preferred_element_type=float32)` has a float32 result, so JAX's backward pass
multiplies the float32 cotangent by the saved half operand and the
weight-gradient matmul runs float32 x float32 (no Tensor Cores).
`half_dot_general` and `half_conv_general_dilated` carry a `jax.custom_vjp`
whose backward products take half operands and accumulate in float32 too.
On CPU, bf16 products are emitted in a form that XLA:CPU computes in float32
from the bf16-rounded operands (same values; its XNNPACK bf16 path fails on
transposed products), chosen by `lax.platform_dependent`: the lowered program
still shows bf16 x bf16 -> float32 products, and other platforms get them as
written.

References: PyTorch's `torch.autocast` (its float32 and "promote to widest
input" op lists); Micikevicius et al., "Mixed Precision Training" (ICLR 2018);
JAX's "Writing custom Jaxpr interpreters" tutorial.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.policy import Policy, get_policy

_prims = jex.core.primitives
_F32 = np.dtype(np.float32)

# Matmuls and convolutions: half operands, float32 accumulation.
HALF_PRIMITIVES: frozenset[str] = frozenset({"dot_general", "conv_general_dilated"})

# Run in float32 (or wider): exponentials and logarithms overflow or lose
# everything in half precision, sums and products accumulate rounding error,
# squares and powers overflow float16. torch.autocast keeps the same in float32.
FLOAT32_PRIMITIVES: frozenset[str] = frozenset(
    {
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
        "sqrt", "rsqrt", "cbrt", "logistic", "erf", "erfc", "erf_inv", "lgamma",
        "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a", "zeta",
        "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "tan", "asin",
        "acos", "asinh", "acosh", "atanh", "sinh", "cosh",
        "reduce_sum", "reduce_prod", "reduce_window_sum", "cumsum", "cumprod",
        "cumlogsumexp",
    }
)  # fmt: skip

# Run in the widest floating dtype of their inputs: exact or well conditioned
# in any precision (max, min, argmax and comparisons are exact; tanh, sin and
# cos are bounded), or only moving data around.
PROMOTE_PRIMITIVES: frozenset[str] = frozenset(
    {
        "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs",
        "sign", "floor", "ceil", "round", "nextafter", "atan2", "sin", "cos",
        "tanh", "atan", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
        "select_n", "clamp", "stop_gradient", "reduce_precision", "copy",
        "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice",
        "dynamic_slice", "dynamic_update_slice", "concatenate", "pad", "gather",
        "split", "tile", "reduce_max", "reduce_min", "argmax", "argmin", "cummax",
        "cummin", "reduce_window_max", "reduce_window_min", "sharding_constraint",
    }
)  # fmt: skip


# --------------------------------------------------------------------------
# Half matmuls with float32 accumulation in both passes.


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def _cast(x: Any, dtype: np.dtype) -> Any:
    if x.dtype == dtype:
        return x
    if isinstance(x, (np.ndarray, np.generic)):
        return np.asarray(x, dtype)  # A constant: no convert op.
    return lax.convert_element_type(x, dtype)


def _widest(dtypes: Iterable[np.dtype]) -> np.dtype:
    # bfloat16 and float16 meet at float32; independent of the promotion mode.
    dtypes = {np.dtype(d) for d in dtypes}
    widest = max(dtypes, key=lambda d: d.itemsize)
    if sum(d.itemsize == widest.itemsize for d in dtypes) > 1:
        return _F32 if widest.itemsize < 4 else widest
    return widest


def _dot_product(dimension_numbers, precision=None, out_sharding=None):
    """`lax.dot_general` as a `product(lhs, rhs, preferred_element_type)`."""
    dims = jax.tree.map(int, dimension_numbers)

    def dot(a, b, pet):
        return lax.dot_general(a, b, dims, precision, pet, out_sharding=out_sharding)

    def product(a, b, pet):
        if a.dtype != jnp.bfloat16 or pet != _F32 or out_sharding is not None:
            return dot(a, b, pet)
        cpu = functools.partial(_cpu_dot, dims=dims, precision=precision)
        return lax.platform_dependent(a, b, cpu=cpu, default=functools.partial(dot, pet=pet))

    return product


def _cpu_dot(lhs, rhs, dims, precision):
    # XLA:CPU hands a row-major bf16 x bf16 -> f32 dot to XNNPACK (on
    # AVX512-BF16 machines), then may fold transposes into it, which XNNPACK
    # rejects and the fallback cannot run ("Unsupported element type for
    # DotThunk"). A [B, K, M] x [B, K, N] dot (column-major lhs) is upcast to
    # float32 instead, as XLA:CPU does with every half dot it keeps for itself.
    (lc, rc), (lb, rb) = dims
    lf = [d for d in range(lhs.ndim) if d not in (*lc, *lb)]
    rf = [d for d in range(rhs.ndim) if d not in (*rc, *rb)]
    shape = [lhs.shape[d] for d in (*lb, *lf)] + [rhs.shape[d] for d in rf]
    b, k = _size(lhs, lb), _size(lhs, lc)
    lhs = lax.transpose(lhs, (*lb, *lc, *lf)).reshape(b, k, _size(lhs, lf))
    rhs = lax.transpose(rhs, (*rb, *rc, *rf)).reshape(b, k, _size(rhs, rf))
    out = lax.dot_general(lhs, rhs, (((1,), (1,)), ((0,), (0,))), precision, _F32)
    return out.reshape(shape)


def _size(x, dims):
    return int(np.prod([x.shape[d] for d in dims], dtype=int))


def _accumulating_product(product, lhs, rhs, compute_dtype, out_dtype):
    """`product(lhs, rhs)` on half operands with float32 accumulation, both passes.

    `product(a, b, preferred_element_type)` is bilinear (a dot or a convolution).
    Forward: half x half -> float32, cast to `out_dtype`; the half operands are
    saved. Backward: the cotangent is cast to half, each transposed product is
    half x half -> float32, and is cast to its primal's dtype.
    """
    lhs_dtype, rhs_dtype = lhs.dtype, rhs.dtype

    @jax.custom_vjp
    def f(lhs, rhs):
        return fwd(lhs, rhs)[0]

    def fwd(lhs, rhs):
        lhs, rhs = _cast(lhs, compute_dtype), _cast(rhs, compute_dtype)
        return _cast(product(lhs, rhs, _F32), out_dtype), (lhs, rhs)

    def bwd(res, g):
        lhs, rhs = res
        g = _cast(g, compute_dtype)

        def transposes(a, b, g):
            # JAX's own transpose rules, traced on half values ...
            (a_bar,) = jax.linear_transpose(lambda x: product(x, b, None), a)(g)
            (b_bar,) = jax.linear_transpose(lambda y: product(a, y, None), b)(g)
            return a_bar, b_bar

        closed = jax.make_jaxpr(transposes)(lhs, rhs, g)
        # ... then run with each product accumulating into float32.
        rules = _Rules(compute_dtype, HALF_PRIMITIVES, frozenset(), PROMOTE_PRIMITIVES, "keep")
        lhs_bar, rhs_bar = _eval_jaxpr(closed.jaxpr, closed.consts, [lhs, rhs, g], rules)
        return _cast(lhs_bar, lhs_dtype), _cast(rhs_bar, rhs_dtype)

    f.defvjp(fwd, bwd)
    try:
        return f(lhs, rhs)
    except TypeError as e:
        # JAX's own message names neither this library nor a way out.
        if "forward-mode" not in str(e) or "custom_vjp" not in str(e):
            raise
        raise TypeError(_JVP_UNSUPPORTED) from e


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


_HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16))


def _half_compute_dtype(compute_dtype, lhs, rhs) -> np.dtype:
    """`compute_dtype` checked, or by default the operands' half dtype (else bfloat16)."""
    if compute_dtype is None:
        # float16 operands stay float16: bfloat16 would drop 3 mantissa bits.
        halves = [x.dtype for x in (lhs, rhs) if x.dtype in _HALF_DTYPES]
        return np.dtype(halves[0]) if halves else _HALF_DTYPES[0]
    try:
        dtype = np.dtype(compute_dtype)
    except TypeError:
        dtype = None
    if dtype not in _HALF_DTYPES:
        raise TypeError(
            f"compute_dtype must be jnp.bfloat16, jnp.float16 or None (the operands' "
            f"half dtype, else bfloat16), got {compute_dtype!r}."
        )
    return dtype


def _result_dtype(lhs, rhs, preferred_element_type) -> np.dtype:
    if preferred_element_type is not None:
        return np.dtype(preferred_element_type)
    return _widest([lhs.dtype, rhs.dtype])


def half_dot_general(
    lhs,
    rhs,
    dimension_numbers,
    precision=None,
    preferred_element_type=None,
    *,
    out_sharding=None,
    compute_dtype=None,
):
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

    Args:
      lhs, rhs, dimension_numbers, precision, preferred_element_type,
        out_sharding: as in `lax.dot_general`.
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
    >>> from jmp_policy.ops import half_dot_general
    >>> x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    >>> y = half_dot_general(x, w, (((1,), (0,)), ((), ())))
    >>> y.dtype, float(y[0, 0])
    (dtype('float32'), 3.0)
    >>> jax.grad(lambda w: half_dot_general(x, w, (((1,), (0,)), ((), ()))).sum())(w).dtype
    dtype('float32')
    """
    dims = jax.tree.map(int, dimension_numbers)
    if not (_is_float(lhs) and _is_float(rhs)):
        return lax.dot_general(lhs, rhs, dims, precision, preferred_element_type,
                               out_sharding=out_sharding)  # fmt: skip
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_shapes(
        lambda a, b: lax.dot_general(a, b, dims, precision, preferred_element_type),
        lhs, rhs, "half_dot_general",
    )  # fmt: skip
    out_dtype = _result_dtype(lhs, rhs, preferred_element_type)
    compute = _half_compute_dtype(compute_dtype, lhs, rhs)

    product = _dot_product(dims, precision, out_sharding)
    return _accumulating_product(product, lhs, rhs, compute, out_dtype)


def half_conv_general_dilated(
    lhs,
    rhs,
    window_strides,
    padding,
    lhs_dilation=None,
    rhs_dilation=None,
    dimension_numbers=None,
    feature_group_count=1,
    batch_group_count=1,
    precision=None,
    preferred_element_type=None,
    *,
    compute_dtype=None,
):
    """`lax.conv_general_dilated` on half operands, float32 accumulation in both passes.

    The convolution counterpart of `half_dot_general`, a drop-in for Flax's
    `nn.Conv(..., conv_general_dilated=half_conv_general_dilated)`.

    Args:
      lhs, rhs, window_strides, padding, lhs_dilation, rhs_dilation,
        dimension_numbers, feature_group_count, batch_group_count, precision,
        preferred_element_type: as in `lax.conv_general_dilated`.
      compute_dtype: as in `half_dot_general`.

    Returns:
      The convolution, in the dtype `lax.conv_general_dilated` would give.

    >>> import jax.numpy as jnp
    >>> from jmp_policy.ops import half_conv_general_dilated
    >>> y = half_conv_general_dilated(jnp.ones((1, 2, 5)), jnp.ones((3, 2, 2)), (1,), "VALID")
    >>> y.shape, y.dtype
    ((1, 3, 4), dtype('float32'))
    """

    def product(a, b, pet):
        return lax.conv_general_dilated(
            a, b, window_strides, padding, lhs_dilation, rhs_dilation, dimension_numbers,
            feature_group_count, batch_group_count, precision, pet,
        )  # fmt: skip

    if not (_is_float(lhs) and _is_float(rhs)):
        return product(lhs, rhs, preferred_element_type)
    lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
    _check_shapes(
        lambda a, b: product(a, b, preferred_element_type), lhs, rhs,
        "half_conv_general_dilated",
    )  # fmt: skip
    out_dtype = _result_dtype(lhs, rhs, preferred_element_type)
    compute = _half_compute_dtype(compute_dtype, lhs, rhs)
    return _accumulating_product(product, lhs, rhs, compute, out_dtype)


# --------------------------------------------------------------------------
# The interpreter.


@dataclasses.dataclass(frozen=True)
class _Rules:
    compute_dtype: np.dtype
    half: frozenset[str]
    float32: frozenset[str]
    promote: frozenset[str]
    # "vjp": products through the custom VJP; "plain": lax products with
    # float32 accumulation (inside JVP rules, whose tangent products JAX must
    # transpose itself); "keep": as "plain", keeping the float32 result.
    products: str = "vjp"


def _bind(eqn, args, params=None):
    params = eqn.params if params is None else params
    return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))


def _as_original(eqn, invals):
    """Casts floating inputs back to the dtypes the traced program had."""
    return [
        _cast(x, v.aval.dtype) if _is_float(x) and x.dtype != v.aval.dtype else x
        for x, v in zip(invals, eqn.invars)
    ]


def _outputs_as(outs, dtypes):
    return [_cast(o, d) if _is_float(o) else o for o, d in zip(outs, dtypes)]


def _rewrite_closed(closed, rules, in_dtypes, out_dtypes=None):
    """The autocast version of a closed jaxpr, for inputs of `in_dtypes`.

    With `out_dtypes`, the outputs are cast to them (loop carries and
    branches must keep their types); otherwise they are what autocast makes.
    """

    def fn(*args):
        outs = _eval_jaxpr(closed.jaxpr, closed.consts, args, rules)
        return outs if out_dtypes is None else _outputs_as(outs, out_dtypes)

    specs = [
        jax.ShapeDtypeStruct(a.shape, d, weak_type=a.weak_type)
        for a, d in zip(closed.in_avals, in_dtypes)
    ]
    return jax.make_jaxpr(fn)(*specs)


def _call_rule(eqn, invals, rules):
    # jit and closed_call: rewritten as if inlined, for the inputs they get.
    name = "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
    closed = _rewrite_closed(eqn.params[name], rules, [x.dtype for x in invals])
    return _bind(eqn, invals, {**eqn.params, name: closed})


# Control flow whose inner jaxprs keep their input and output types.
_CONTROL_FLOW_JAXPRS = {
    _prims.scan_p: ("jaxpr",),
    _prims.while_p: ("cond_jaxpr", "body_jaxpr"),
    _prims.cond_p: ("branches",),
}


def _control_flow_rule(eqn, invals, rules):
    def rewrite(closed):
        in_dtypes, out_dtypes = ([a.dtype for a in x] for x in (closed.in_avals, closed.out_avals))
        return _rewrite_closed(closed, rules, in_dtypes, out_dtypes)

    params = dict(eqn.params)
    for name in _CONTROL_FLOW_JAXPRS[eqn.primitive]:
        value = params[name]
        params[name] = tuple(map(rewrite, value)) if isinstance(value, tuple) else rewrite(value)
    return _bind(eqn, _as_original(eqn, invals), params)


def _remat_rule(eqn, invals, rules):
    jaxpr = eqn.params["jaxpr"]

    def body(*args):
        return _eval_jaxpr(jaxpr, (), args, rules)

    params = eqn.params
    return jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])(*invals)


def _custom_jvp_rule(eqn, invals, rules):
    # Inputs take the dtypes the JVP rule was written for; outputs are free.
    args = _as_original(eqn, invals)
    call = eqn.params["call_jaxpr"]
    if not all(_is_float(a) for a in (*call.in_avals, *call.out_avals)):
        return _bind(eqn, args)  # Ints would need float0 tangents: run as written.

    def primal(*xs):
        return _eval_jaxpr(call.jaxpr, call.consts, xs, rules)

    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *args)]
    f = jax.custom_jvp(primal)

    @f.defjvp
    def f_jvp(primals, tangents):
        # The original rule, traced and autocast, so that e.g. softmax's
        # exp and sum also run in float32 under `jax.grad`.
        def jvp(primals, tangents):
            return jax.jvp(lambda *xs: _bind(eqn, xs), primals, tangents)

        jvp_rules = dataclasses.replace(rules, products="plain")
        out, out_dot = _trace_and_eval(jvp, (tuple(primals), tuple(tangents)), jvp_rules)
        return _outputs_as(out, out_dtypes), _outputs_as(out_dot, out_dtypes)

    return f(*args)


_HIGHER_ORDER = {p: _control_flow_rule for p in _CONTROL_FLOW_JAXPRS}
_HIGHER_ORDER[_prims.jit_p] = _call_rule
_HIGHER_ORDER[_prims.closed_call_p] = _call_rule
_HIGHER_ORDER[_prims.remat_p] = _remat_rule
_HIGHER_ORDER[_prims.custom_jvp_call_p] = _custom_jvp_rule


def _product_rule(eqn, invals, rules):
    lhs, rhs = invals
    c, out_dtype = rules.compute_dtype, eqn.outvars[0].aval.dtype
    if rules.products != "keep" and out_dtype == c:
        # The program asked for a half result: JAX's own backward is half too.
        return _bind(eqn, [_cast(lhs, c), _cast(rhs, c)])

    if eqn.primitive is _prims.dot_general_p:
        p = eqn.params
        product = _dot_product(p["dimension_numbers"], p["precision"], p.get("out_sharding"))
    else:

        def product(a, b, pet):
            return _bind(eqn, [a, b], {**eqn.params, "preferred_element_type": pet})

    if rules.products == "keep":
        return product(_cast(lhs, c), _cast(rhs, c), _F32)
    if rules.products == "plain" or c.itemsize >= _F32.itemsize:
        return _cast(product(_cast(lhs, c), _cast(rhs, c), _F32), out_dtype)
    return _accumulating_product(product, lhs, rhs, c, out_dtype)


def _apply(eqn, invals, rules):
    prim, name = eqn.primitive, eqn.primitive.name
    if prim in _HIGHER_ORDER:
        return _HIGHER_ORDER[prim](eqn, invals, rules)
    if prim is _prims.convert_element_type_p:
        x, new_dtype = invals[0], np.dtype(eqn.params["new_dtype"])
        return x if x.dtype == new_dtype else _bind(eqn, invals)
    floats = [i for i, x in enumerate(invals) if _is_float(x)]
    if not floats or not (name in rules.half or name in rules.float32 or name in rules.promote):
        return _bind(eqn, _as_original(eqn, invals))  # Unknown: run as written.
    if name in rules.half:
        if len(invals) == 2 and len(floats) == 2 and _is_float(eqn.outvars[0].aval):
            return _product_rule(eqn, invals, rules)
        return _bind(eqn, _as_original(eqn, invals))
    strong = [invals[i].dtype for i in floats if not eqn.invars[i].aval.weak_type]
    target = _widest(strong or [invals[i].dtype for i in floats])
    if name in rules.float32:
        target = _F32 if target.itemsize < _F32.itemsize else target
    args = [_cast(x, target) if i in floats else x for i, x in enumerate(invals)]
    return _bind(eqn, args)


def _read(env, v):
    if isinstance(v, jex.core.Literal):
        val = v.val
        same = hasattr(val, "dtype") and val.dtype == v.aval.dtype
        return val if same else np.asarray(val, v.aval.dtype)
    return env[v]


def _eval_jaxpr(jaxpr, consts, args, rules):
    env = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    su = jex.source_info_util
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        # Keep the equation's name stack (e.g. Flax module paths) and context.
        name_stack = su.current_name_stack() + eqn.source_info.name_stack
        with su.user_context(eqn.source_info.traceback, name_stack=name_stack), eqn.ctx.manager:
            outs = _apply(eqn, invals, rules)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jex.core.DropVar):
                env[v] = out
    return [_read(env, v) for v in jaxpr.outvars]


def _trace_and_eval(fn, args, rules):
    """Traces `fn(*args)` and runs it again under `rules`; array leaves are traced."""
    leaves, treedef = jax.tree.flatten(args)
    arrays = (jax.Array, np.ndarray, np.generic)
    dynamic = [i for i, x in enumerate(leaves) if isinstance(x, arrays)]

    def flat_fn(*values):
        full = list(leaves)
        for i, x in zip(dynamic, values):
            full[i] = x
        return fn(*jax.tree.unflatten(treedef, full))

    values = [leaves[i] for i in dynamic]
    closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*values)
    outs = _eval_jaxpr(closed.jaxpr, closed.consts, values, rules)
    return jax.tree.unflatten(jax.tree.structure(out_shape), outs)


def _known_primitive_names() -> frozenset[str]:
    names = {getattr(p, "name", None) for p in vars(_prims).values()}
    names = {n for n in names if isinstance(n, str)}
    return frozenset(names | HALF_PRIMITIVES | FLOAT32_PRIMITIVES | PROMOTE_PRIMITIVES)


def _primitive_names(ops: Iterable[Any], arg: str) -> frozenset[str]:
    if isinstance(ops, str):
        ops = [ops]
    try:
        ops = list(ops)
    except TypeError:
        raise TypeError(
            f"autocast({arg}=...) takes an iterable of primitive names or primitives, "
            f"got {ops!r}."
        ) from None
    names = set()
    known = None
    for op in ops:
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                f"autocast({arg}=...) takes primitive names or primitives "
                f"(e.g. 'exp' or jax.extend.core.primitives.exp_p), got {op!r}."
            )
        if isinstance(op, str):
            # A misspelt name would match no operation and change nothing.
            known = _known_primitive_names() if known is None else known
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), 3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise ValueError(
                    f"autocast({arg}=...): unknown primitive name {name!r}{hint}. Accepted "
                    "are the names of jax.extend.core.primitives (e.g. 'exp', 'tanh', "
                    "'dot_general'); pass a primitive object for one defined elsewhere."
                )
        names.add(name)
    return frozenset(names)


def autocast(
    fn: Callable,
    policy: Policy | str,
    *,
    half_primitives: Iterable[Any] = HALF_PRIMITIVES,
    float32_primitives: Iterable[Any] = FLOAT32_PRIMITIVES,
    promote_primitives: Iterable[Any] = PROMOTE_PRIMITIVES,
) -> Callable:
    """Runs `fn` with matmuls in half precision and sensitive ops in float32.

    A transform over the traced program of any JAX function (plain `jnp`, Flax
    linen or NNX, Equinox), in the spirit of `torch.autocast`: see the module
    docstring for the rules. Arrays keep the dtypes they are given (storage is
    `Policy.cast_to_param`'s job); only the operations are rewritten, and the
    floating results are cast to `policy.output_dtype`. `param_dtype` is not
    used. Array arguments are traced, anything else is static. Each call traces
    `fn` again, so call it under `jax.jit`.

    Composes with `jax.jit`, `jax.grad`, `jax.vmap`, `lax.scan` and
    `jax.checkpoint` on either side. Autocast of an autocast function: the
    inner one decides for the operations inside it. Not supported: forward-mode
    differentiation (`jax.jvp`, `jax.jacfwd`) through the half matmuls, which
    carry a `jax.custom_vjp`; user `custom_vjp` functions and `shard_map`
    bodies run as written.

    Args:
      fn: the function to transform.
      policy: a `Policy` or a spec for `get_policy` (e.g. "mixed_bfloat16").
      half_primitives: names of primitives that run on `compute_dtype`
        operands with float32 accumulation (bilinear ones only).
      float32_primitives: names of primitives that run in float32.
      promote_primitives: names of primitives that run in the widest floating
        dtype of their inputs. Extend a list with e.g.
        `float32_primitives=FLOAT32_PRIMITIVES | {"tanh"}`. A name in several
        lists takes the first of half, float32, promote.

    Returns:
      The transformed function, with `fn`'s signature.

    Raises:
      TypeError: if `fn` is not callable, or a primitive list holds something
        other than names or primitives.
      ValueError: if a primitive list holds a name that is no JAX primitive's
        (the message lists close matches).

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> from jmp_policy.ops import autocast
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = autocast(f, "mixed_bfloat16")
    >>> x, w = jnp.linspace(-1, 1, 6).reshape(2, 3), jnp.ones((3, 4))
    >>> g(x, w).dtype
    dtype('float32')
    >>> bool(jnp.allclose(jax.jit(g)(x, w), f(x, w), atol=1e-2))
    True
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a function as its first argument, got {fn!r}.")
    policy = get_policy(policy)
    rules = _Rules(
        compute_dtype=policy.compute_dtype,
        half=_primitive_names(half_primitives, "half_primitives"),
        float32=_primitive_names(float32_primitives, "float32_primitives"),
        promote=_primitive_names(promote_primitives, "promote_primitives"),
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        outs = _trace_and_eval(lambda a, k: fn(*a, **k), (args, kwargs), rules)
        return policy.cast_to_output(outs)

    return wrapped
