"""Op-level mixed precision: `autocast`, a transform over the traced program.

`autocast(fn, policy)` traces `fn` to a jaxpr and runs it again equation by
equation, choosing each operation's precision the way `torch.autocast` does:

* `HALF_PRIMITIVES` (matmuls and convolutions) take `policy.compute_dtype`
  operands and accumulate in float32 (`preferred_element_type=float32`), in the
  forward *and* the backward pass (see `half_dot_general`), unless the author
  asked for `precision=HIGHEST` (`asks_full_precision`): those run as written.
  Their result keeps the dtype the traced program gave it, so a float32 program stays float32
  between matmuls. Where the policy has a `matmul_dtype`, every `dot_general`
  takes that instead: half operands (`half_dot_general`) or FP8
  (`fp8_dot_general`); convolutions stay in the compute dtype.
* `FLOAT32_PRIMITIVES` (exp, log, pow, sqrt, sums, products, ...) run in
  float32 (or wider); so do the softmax, logsumexp, norm, variance and loss
  patterns built from them. Their result stays float32.
* `PROMOTE_PRIMITIVES` (elementwise arithmetic, comparisons, reshapes, max
  reductions, ...) run in the widest floating dtype of their inputs.
* Anything else runs as written: its floating inputs are cast back to the
  dtypes the traced program had, so it always type-checks. Writes into a
  buffer (`dynamic_update_slice`, scatters, `.at[].set`) are among them: the
  buffer and the values written keep the dtype the program gave them, so a
  decode cache of any dtype stays in it.

Integers, booleans and PRNG keys are never touched, and explicit casts in the
program are kept (so `jnp.mean` of a bf16 array, which sums in float32 and
casts back, still returns bf16). Nested programs are rewritten too: `jit` and
`checkpoint` as if inlined; `custom_jvp` functions (`jax.nn.relu`,
`jax.nn.softmax`, ...) and their JVP rules, on inputs of the dtypes the rule
was written for; a user's `custom_vjp` forward and backward rule (the
products jmp_policy itself makes are left as decided); `scan`, `while_loop`
and `cond` with the input and output dtypes of the original, so loop
carries and branches stay type-correct; `shard_map` (and so `jax.pmap`)
bodies inside a new `shard_map` over the same mesh and specs, their inputs
and results in the original dtypes.

Matmuls and convolutions run through `jmp_policy.core.matmul`, whose custom VJP
keeps the backward products half x half with float32 accumulation too.

References: PyTorch's `torch.autocast` (its float32 and "promote to widest
input" op lists); Micikevicius et al., "Mixed Precision Training" (ICLR 2018);
JAX's "Writing custom Jaxpr interpreters" tutorial.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import os
import re
import sys
import types
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.fp8 import E4M3 as _E4M3
from jmp_policy.core.fp8 import fp8_product
from jmp_policy.core.matmul import F32 as _F32
from jmp_policy.core.matmul import (
    accumulating_dot,
    accumulating_product,
    asks_full_precision,
    cast,
    clear_shared_products,
    is_float,
    product_of,
    widest,
)
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.core.state import ReturnsState, cast_results

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
        "dynamic_slice", "concatenate", "pad", "gather",
        "split", "tile", "reduce_max", "reduce_min", "argmax", "argmin", "cummax",
        "cummin", "reduce_window_max", "reduce_window_min", "sharding_constraint",
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Rules:
    compute_dtype: np.dtype
    half: frozenset[str]
    float32: frozenset[str]
    promote: frozenset[str]
    # "vjp": products through the custom VJP; "plain": lax products with
    # float32 accumulation (inside JVP rules, whose tangent products JAX must
    # transpose itself).
    products: str = "vjp"
    # The policy's matmul dtype: every dot_general takes its product (None:
    # the compute dtype, as above).
    matmul_dtype: np.dtype | None = None
    # Under an FP8 matmul dtype: "tensor" or "rowwise" scaling.
    fp8_scaling: str = "tensor"
    # Whether `matmul_scope` markers in a product's name stack choose its
    # matmul dtype (`matmul_dtype` where there is none); a product whose
    # scope says None runs as written.
    scoped: bool = False

    @property
    def only_products(self) -> bool:
        """Only products are rewritten (`matmuls_in`); every other op runs as written."""
        return not (self.float32 or self.promote)


def _as_original(eqn, invals):
    """Casts floating inputs back to the dtypes the traced program had."""
    return [
        cast(x, v.aval.dtype) if is_float(x) and x.dtype != v.aval.dtype else x
        for x, v in zip(invals, eqn.invars)
    ]


def is_complex(x: Any) -> bool:
    return hasattr(x, "dtype") and np.issubdtype(x.dtype, np.complexfloating)


def _outputs_as(outs, dtypes):
    return [cast(o, d) if is_float(o) else o for o, d in zip(outs, dtypes)]


def _eval(jaxpr: ji.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: _Rules) -> list[Any]:
    return ji.eval_jaxpr(jaxpr, consts, args, functools.partial(_apply, rules=rules))


def _rewrite_closed(closed, rules, in_dtypes, out_dtypes=None):
    """The autocast version of a closed jaxpr, for inputs of `in_dtypes`.

    With `out_dtypes`, the outputs are cast to them (loop carries and
    branches must keep their types); otherwise they are what autocast makes.
    """

    @_in_scope
    def fn(*args):
        outs = _eval(closed.jaxpr, closed.consts, args, rules)
        return outs if out_dtypes is None else _outputs_as(outs, out_dtypes)

    specs = [
        jax.ShapeDtypeStruct(a.shape, d, weak_type=a.weak_type)
        for a, d in zip(closed.in_avals, in_dtypes)
    ]
    return jax.make_jaxpr(fn)(*specs)


def _call_rule(eqn, invals, rules):
    # jit and closed_call: rewritten as if inlined, for the inputs they get.
    name, program = ji.call_program(eqn)
    closed = _rewrite_closed(program, rules, [x.dtype for x in invals])
    return ji.bind(eqn, invals, ji.replaced_params(eqn, **{name: closed}))


def _control_flow_rule(eqn, invals, rules):
    def rewrite(closed):
        in_dtypes, out_dtypes = ([a.dtype for a in x] for x in (closed.in_avals, closed.out_avals))
        return _rewrite_closed(closed, rules, in_dtypes, out_dtypes)

    programs = {
        name: tuple(map(rewrite, value)) if isinstance(value, tuple) else rewrite(value)
        for name, value in ji.control_flow_programs(eqn).items()
    }
    return ji.bind(eqn, _as_original(eqn, invals), ji.replaced_params(eqn, **programs))


def _remat_rule(eqn, invals, rules):
    jaxpr = ji.remat_body(eqn)

    @_in_scope
    def body(*args):
        return _eval(jaxpr, (), args, rules)

    return jax.checkpoint(body, **ji.remat_options(eqn))(*invals)


def _custom_jvp_rule(eqn, invals, rules):
    # Inputs take the dtypes the JVP rule was written for; outputs are free.
    args = _as_original(eqn, invals)
    call = ji.custom_jvp_primal(eqn)
    if not all(is_float(a) for a in (*call.in_avals, *call.out_avals)):
        return ji.bind(eqn, args)  # Ints would need float0 tangents: run as written.

    @_in_scope
    def primal(*xs):
        return _eval(call.jaxpr, call.consts, xs, rules)

    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *args)]
    f = jax.custom_jvp(primal)

    @f.defjvp
    def f_jvp(primals, tangents):
        # The original rule, traced and autocast, so that e.g. softmax's
        # exp and sum also run in float32 under `jax.grad`.
        def jvp(primals, tangents):
            return jax.jvp(lambda *xs: ji.bind(eqn, xs), primals, tangents)

        jvp_rules = dataclasses.replace(rules, products="plain")
        out, out_dot = _trace_and_eval(jvp, (tuple(primals), tuple(tangents)), jvp_rules)
        return _outputs_as(out, out_dtypes), _outputs_as(out_dot, out_dtypes)

    return f(*args)


# jmp_policy's own products (half and FP8) are `custom_vjp`s already decided.
_OWN_PRODUCTS = frozenset(
    os.path.abspath(str(sys.modules[f.__module__].__file__))
    for f in (accumulating_dot, fp8_product)
)


def _custom_vjp_rule(eqn, invals, rules):
    # A user's `custom_vjp`: its forward rewritten; its backward the user's
    # rule, rewritten too, from the inputs as residuals (it recomputes the
    # forward, as `jax.checkpoint` would).
    args = _as_original(eqn, invals)
    program = ji.custom_vjp_primal(eqn)
    file = ji.custom_vjp_file(eqn)
    if (
        (file is not None and os.path.abspath(file) in _OWN_PRODUCTS)
        or not all(is_float(a) for a in (*program.in_avals, *program.out_avals))
        or not _contains(program.jaxpr, rules.half)
    ):
        return ji.bind(eqn, args)  # Decided, integer-valued, or nothing to rewrite.
    out_dtypes = [o.dtype for o in program.out_avals]

    @_in_scope
    def primal(*xs):
        return _outputs_as(_eval(program.jaxpr, program.consts, xs, rules), out_dtypes)

    def original_vjp(xs, cts):
        return jax.vjp(lambda *a: ji.bind(eqn, a), *xs)[1](list(cts))

    f = jax.custom_vjp(primal)
    f.defvjp(
        lambda *xs: (primal(*xs), xs),
        lambda xs, cts: tuple(_trace_and_eval(original_vjp, (xs, tuple(cts)), rules)),
    )
    return f(*args)


def _shard_map_rule(eqn, invals, rules):
    # The per-device program is rewritten inside a new `shard_map` over the
    # same mesh and specs; its inputs and results keep their dtypes.
    jaxpr = ji.shard_map_body(eqn)
    out_dtypes = [ji.shaped(v).dtype for v in jaxpr.outvars]

    @_in_scope
    def body(*args):
        return tuple(_outputs_as(_eval(jaxpr, (), args, rules), out_dtypes))

    return list(jax.shard_map(body, **ji.shard_map_options(eqn))(*_as_original(eqn, invals)))


_HIGHER_ORDER = {p: _control_flow_rule for p in ji.CONTROL_FLOW_JAXPR_PARAMS}
_HIGHER_ORDER.update({p: _call_rule for p in ji.CALL_JAXPR_PARAM})
_HIGHER_ORDER[ji.remat_p] = _remat_rule
_HIGHER_ORDER[ji.custom_jvp_call_p] = _custom_jvp_rule
_HIGHER_ORDER[ji.custom_vjp_call_p] = _custom_vjp_rule


# `matmul_scope` markers: a module (or any code) whose products take another
# matmul dtype than the code around it, read back from the name stack.
_SCOPE = "jmp_policy_matmul_"
_SCOPE_NAME = re.compile(_SCOPE + r"(\w+)")
# The name stack outside the program being traced: JAX traces nested programs
# (loop bodies, checkpointed and custom_jvp functions) with an empty one.
_OUTER_STACK: contextvars.ContextVar[str] = contextvars.ContextVar("outer_stack", default="")


def _name_stack() -> str:
    return f"{_OUTER_STACK.get()}/{ji.current_name_stack()}"


def _in_scope(fn: Callable) -> Callable:
    """`fn`, traced later, seeing the name stack of where it was made as its outer one."""
    outer = _name_stack()

    @functools.wraps(fn)
    def inner(*args):
        token = _OUTER_STACK.set(outer)
        try:
            return fn(*args)
        finally:
            _OUTER_STACK.reset(token)

    return inner


def matmul_scope(
    matmul_dtype: Any, fp8_scaling: str = "tensor"
) -> contextlib.AbstractContextManager:
    """Marks the products traced inside it for `matmuls_in(..., scoped=True)`.

    They take `matmul_dtype` (None: as written; FP8 with `fp8_scaling`)
    whatever the code around them takes.
    """
    name = "none" if matmul_dtype is None else np.dtype(matmul_dtype).name
    return jax.named_scope(f"{_SCOPE}{name}_{fp8_scaling}")


def _scoped_matmul_dtype(rules: _Rules) -> tuple[np.dtype | None, str]:
    """The innermost scope's `(matmul dtype, FP8 scaling)`, else the rules' own."""
    names = _SCOPE_NAME.findall(_name_stack())
    if not names:
        return rules.matmul_dtype, rules.fp8_scaling
    dtype, _, scaling = names[-1].rpartition("_")
    return (None if dtype == "none" else np.dtype(dtype)), scaling


def _matmul_dtype_product(eqn, invals, rules):
    """A dot_general under the policy's matmul dtype, or None where that does not apply."""
    if rules.scoped:
        m, scaling = _scoped_matmul_dtype(rules)
    else:
        m, scaling = rules.matmul_dtype, rules.fp8_scaling
    if m is None or eqn.primitive is not ji.dot_general_p:
        return None  # Convolutions run in the compute dtype, also under FP8.
    lhs, rhs = invals
    product, out_dtype = product_of(eqn), eqn.outvars[0].aval.dtype
    if rules.products == "vjp":
        if m == _E4M3:
            p = ji.dot_params(eqn)
            return fp8_product(lhs, rhs, p.dimension_numbers, out_dtype, scaling,
                               p.precision, p.out_sharding)  # fmt: skip
        return _accumulating(eqn, product, lhs, rhs, m, out_dtype)
    if m == _E4M3:
        # Inside a JVP rule JAX transposes the products itself, which an
        # unscaled FP8 cast cannot survive: the compute dtype there.
        return None
    return cast(product(cast(lhs, m), cast(rhs, m), _F32), out_dtype)


def _product_rule(eqn, invals, rules):
    out = _matmul_dtype_product(eqn, invals, rules)
    if out is not None:
        return out
    if rules.scoped:
        return ji.bind(eqn, _as_original(eqn, invals))  # No matmul dtype here.
    lhs, rhs = invals
    c, out_dtype = rules.compute_dtype, eqn.outvars[0].aval.dtype
    if out_dtype == c:
        # The program asked for a half result: JAX's own backward is half too.
        return ji.bind(eqn, [cast(lhs, c), cast(rhs, c)])
    product = product_of(eqn)
    if rules.products == "plain" or c.itemsize >= _F32.itemsize:
        return cast(product(cast(lhs, c), cast(rhs, c), _F32), out_dtype)
    return _accumulating(eqn, product, lhs, rhs, c, out_dtype)


def _accumulating(eqn, product, lhs, rhs, compute_dtype, out_dtype):
    """`accumulating_product`; a dot through `accumulating_dot`, traced once per signature."""
    if eqn.primitive is ji.dot_general_p:
        p = ji.dot_params(eqn)
        return accumulating_dot(lhs, rhs, p.dimension_numbers, p.precision,
                                p.out_sharding, compute_dtype, out_dtype)  # fmt: skip
    return accumulating_product(product, lhs, rhs, compute_dtype, out_dtype)


# Whether a program (or one nested in it) has an equation of the given primitives.
_CONTAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _contains(jaxpr: ji.Jaxpr, names: frozenset[str]) -> bool:
    """Whether `jaxpr` may run one of `names` (a `custom_jvp` may, in its rule)."""
    names = names | {"custom_jvp_call"}
    known = _CONTAINS.setdefault(jaxpr, {})
    if names not in known:
        known[names] = any(
            e.primitive.name in names or any(_contains(j, names) for j in ji.sub_jaxprs(e))
            for e in jaxpr.eqns
        )
    return known[names]


def _apply(eqn, invals, rules):
    prim, name = eqn.primitive, eqn.primitive.name
    nested = prim in _HIGHER_ORDER or ji.is_shard_map(eqn)
    if (
        nested
        and rules.only_products
        and prim is not ji.custom_jvp_call_p
        and not any(_contains(j, rules.half) for j in ji.sub_jaxprs(eqn))
    ):
        # Under `matmuls_in`, a call or loop with no product in it runs as
        # traced: rewriting would change nothing, and JAX's caches (keyed on
        # the nested program) then serve every layer. A custom_jvp's rule may
        # hold products its primal program does not show: it is rewritten.
        return ji.bind(eqn, _as_original(eqn, invals))
    if prim in _HIGHER_ORDER:
        return _HIGHER_ORDER[prim](eqn, invals, rules)
    if ji.is_shard_map(eqn):
        return _shard_map_rule(eqn, invals, rules)
    if prim is ji.convert_element_type_p:
        x, new_dtype = invals[0], ji.new_dtype(eqn)
        return x if x.dtype == new_dtype else ji.bind(eqn, invals)
    floats = [i for i, x in enumerate(invals) if is_float(x)]
    if not floats or not (name in rules.half or name in rules.float32 or name in rules.promote):
        return ji.bind(eqn, _as_original(eqn, invals))  # Unknown: run as written.
    if name in rules.half:
        full = asks_full_precision(ji.product_precision(eqn))  # The author's choice wins.
        if len(invals) == 2 and floats and is_float(eqn.outvars[0].aval) and not full:
            if len(floats) == 1 and not is_complex(invals[1 - floats[0]]):
                # An integer or boolean operand (a head mask) joins the other's
                # dtype, as JAX's promotion gives it in a half config.
                other = invals[floats[0]].dtype
                invals = [x if is_float(x) else cast(x, other) for x in invals]
            return _product_rule(eqn, invals, rules)
        return ji.bind(eqn, _as_original(eqn, invals))
    strong = [invals[i].dtype for i in floats if not eqn.invars[i].aval.weak_type]
    target = widest(strong or [invals[i].dtype for i in floats])
    if name in rules.float32:
        target = _F32 if target.itemsize < _F32.itemsize else target
    args = [cast(x, target) if i in floats else x for i, x in enumerate(invals)]
    return ji.bind(eqn, args)


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

    # Only array results go through the traced program; the others (an
    # Equinox module's activation function, a Python scalar) are constants of
    # the trace and come back as they were returned.
    out_leaves: list[Any] = []
    out_tree: list[Any] = []

    def traced_fn(*values):
        results, tree = jax.tree.flatten(flat_fn(*values))
        # The arrays are tracers of this trace: only their places are kept.
        out_leaves[:] = [_TRACED if isinstance(x, arrays) else x for x in results]
        out_tree[:] = [tree]
        return [x for x in results if isinstance(x, arrays)]

    values = [leaves[i] for i in dynamic]
    closed = jax.make_jaxpr(traced_fn)(*values)
    outs = iter(_eval(closed.jaxpr, closed.consts, values, rules))
    full = [next(outs) if x is _TRACED else x for x in out_leaves]
    return jax.tree.unflatten(out_tree[0], full)


_TRACED = object()  # The place of an array result in `_trace_and_eval`.


def _known_primitive_names() -> frozenset[str]:
    return ji.primitive_names() | HALF_PRIMITIVES | FLOAT32_PRIMITIVES | PROMOTE_PRIMITIVES


# Handlers for arguments holding state that `fn` updates in place (Flax NNX
# modules): `handler(run, fn, args, kwargs)` returns `fn`'s result, running a
# pure function of that state through `run(pure_fn, args, kwargs)` and writing
# the new state back, or `NotImplemented` if the call holds no such state.
# The core knows no framework: the package registers the Flax NNX handler.
StateHandler = Callable[[Callable, Callable, tuple, dict], Any]
_STATE_HANDLERS: list[StateHandler] = []


def register_state_handler(handler: StateHandler) -> None:
    """Lets `autocast` thread a framework's mutable state through the traced program."""
    if handler not in _STATE_HANDLERS:
        _STATE_HANDLERS.append(handler)


def _primitive_names(ops: Iterable[Any], arg: str) -> frozenset[str]:
    if isinstance(ops, str):
        ops = [ops]
    try:
        ops = list(ops)
    except TypeError:
        raise TypeError(
            f"autocast({arg}=...) takes an iterable of primitive names or primitives, got {ops!r}."
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


def matmuls_in(
    fn: Callable,
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    *,
    scoped: bool = False,
    shared: bool = False,
) -> Callable:
    """`fn` with every `dot_general` taking `matmul_dtype`'s product; all else as written.

    For code with no `dot_general` hook (`jnp.einsum` and `@` in model code,
    attention): half operands with float32 accumulation, or FP8
    (`fp8_dot_general`, with `fp8_scaling`), forward and backward. Each
    product keeps the result dtype of the traced program. With `scoped`, a
    product traced inside `matmul_scope(d)` takes `d` instead (None: as
    written), the innermost scope winning; `matmul_dtype` may then be None.
    Array arguments are traced, anything else is static. With `shared` (not
    with `scoped`), for a pure `fn` called often with the same shapes (the
    attention of every layer): calls whose other arguments are plain values
    (numbers, strings, dtypes, enums, None) share one traced rewrite per
    signature, an inlined `jax.jit`; their results must be arrays. Only
    where `fn` reads nothing that can change (no array, variable or module
    in its closure, defaults or globals; a bound method never): otherwise
    each call is rewritten on its own, so no value goes stale.
    """
    rules = _Rules(
        compute_dtype=_F32,
        half=frozenset({"dot_general"}),
        float32=frozenset(),
        promote=frozenset(),
        matmul_dtype=None if matmul_dtype is None else np.dtype(matmul_dtype),
        fp8_scaling=fp8_scaling,
        scoped=scoped,
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if shared and not scoped:
            out = _shared_rewrite(fn, rules, args, kwargs)
            if out is not NotImplemented:
                return out
        return _trace_and_eval(lambda a, k: fn(*a, **k), (args, kwargs), rules)

    return wrapped


# `matmuls_in(shared=True)`: per function (held weakly), per signature, the
# inlined `jax.jit` of its rewrite.
_SHARED_REWRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


# Packages whose functions read no array or module that can change.
_LIBRARIES = frozenset({"builtins", "jax", "jaxlib", "flax", "numpy", "optax", "math"})


def _from_library(fn: Any) -> bool:
    return (getattr(fn, "__module__", None) or "").split(".")[0] in _LIBRARIES


def _names_read(code: types.CodeType) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):  # A lambda or comprehension inside.
            names |= _names_read(const)
    return names


def _reads_nothing_that_changes(fn: Any, seen: set[int] | None = None) -> bool:
    """Whether one trace of `fn` serves every call with the same signature.

    True only if all `fn` closes over, binds, defaults to and reads as a
    global is a plain value, a Python module, a class, or a function of the
    same kind (JAX's, Flax's and the standard library's own count as such);
    an array, a module's variable or a bound method would be baked into the
    trace and go stale when it changes.
    """
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return True
    seen.add(id(fn))
    if isinstance(fn, functools.partial):
        bound = (fn.func, *fn.args, *fn.keywords.values())
        return all(_is_unchanging(v, seen) for v in bound)
    if _from_library(fn):
        return True
    if not isinstance(fn, types.FunctionType):
        return False  # A bound method, a callable object: it holds state.
    try:
        values = [cell.cell_contents for cell in fn.__closure__ or ()]
    except ValueError:  # A cell not filled yet.
        return False
    values += [*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()]
    values += [fn.__globals__[n] for n in _names_read(fn.__code__) if n in fn.__globals__]
    return all(_is_unchanging(v, seen) for v in values)


def _is_unchanging(value: Any, seen: set[int]) -> bool:
    if ji.is_plain(value) or isinstance(value, (types.ModuleType, type)):
        return True
    return callable(value) and _reads_nothing_that_changes(value, seen)


def _shared_rewrite(fn: Callable, rules: _Rules, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` rewritten through its shared trace; NotImplemented if none can be."""
    if not _reads_nothing_that_changes(fn):
        return NotImplemented  # Its trace would keep what it reads now: rewritten per call.
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    static = tuple((type(x), x) for x, a in zip(leaves, is_array) if not a)
    if not all(ji.is_plain(x) for _, x in static):
        return NotImplemented  # A module or a function: not kept alive in a cache.
    try:
        per_signature = _SHARED_REWRITES.setdefault(fn, {})
    except TypeError:  # No weak reference to `fn`.
        return NotImplemented
    key = (rules, treedef, is_array, static)
    if key not in per_signature:
        ref = weakref.ref(fn)
        values = [None if a else x for x, a in zip(leaves, is_array)]  # Plain values only.

        def rewritten(*arrays):
            it = iter(arrays)
            full = [next(it) if a else v for v, a in zip(values, is_array)]
            f = ref()
            assert f is not None  # The caller holds `fn` while this runs.
            return _trace_and_eval(
                lambda a, k: f(*a, **k), jax.tree.unflatten(treedef, full), rules
            )

        per_signature[key] = ji.inlined_jit(rewritten)
    return per_signature[key](*[x for x, a in zip(leaves, is_array) if a])


def clear_shared_traces() -> None:
    """Forgets the traces `matmuls_in(shared=True)` and the half products share."""
    _SHARED_REWRITES.clear()
    clear_shared_products()


def autocast(
    fn: Callable,
    policy: Policy | str,
    *,
    half_primitives: Iterable[Any] = HALF_PRIMITIVES,
    float32_primitives: Iterable[Any] = FLOAT32_PRIMITIVES,
    promote_primitives: Iterable[Any] = PROMOTE_PRIMITIVES,
    returns_state: ReturnsState = None,
) -> Callable:
    """Runs `fn` with matmuls in half precision and sensitive ops in float32.

    A transform over the traced program of any JAX function (plain `jnp`, Flax
    linen or NNX, Equinox), in the spirit of `torch.autocast`: see the module
    docstring for the rules. Arrays keep the dtypes they are given (storage is
    `Policy.cast_to_param`'s job); only the operations are rewritten, and the
    floating results are cast to `policy.output_dtype`, except state: a
    container in the result with the structure and shapes of one among the
    arguments (an Equinox `State`, a carry, a cache, a module) comes back in
    that argument's dtypes, by the rule linen's `with_policy` and
    `jmp_policy.nnx` use too (`jmp_policy.core.state`). Non-array results (an
    Equinox module's activation) come back as returned. `param_dtype` is not
    used. Array arguments are traced, anything else is static. Each call traces
    `fn` again, so call it under `jax.jit`.

    Composes with `jax.jit`, `jax.grad`, `jax.vmap`, `lax.scan` and
    `jax.checkpoint` on either side; the bodies of `jax.shard_map` and
    `jax.pmap` (which JAX 0.10 runs as a `shard_map`) are rewritten too. Autocast of
    an autocast function: the inner one decides for the operations inside it.
    Flax NNX modules that update their state (BatchNorm statistics, `Rngs`)
    work as `fn` (`autocast(model, policy)(x)`), as a bound method, or as
    arguments (`autocast(step, policy)(model, x)`), eagerly and under
    `nnx.jit`: their state is threaded through the traced program and written
    back; a module `fn` merely closes over gets a `TypeError` saying so. Not
    supported: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) through
    the half matmuls, which carry a `jax.custom_vjp`. A user's `custom_vjp`
    is rewritten too: its forward, and its backward rule from the inputs as
    residuals (the rule recomputes the forward, as under `jax.checkpoint`).

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
      returns_state: a pytree prefix of `fn`'s result, `True` for a part
        that is state (kept in the dtypes of the argument it matches, else
        as made: a cache `fn` makes), `False` for a result (the output
        dtype); None (the default) lets the state rule decide.

    Returns:
      The transformed function, with `fn`'s signature.

    Raises:
      TypeError: if `fn` is not callable, or a primitive list holds something
        other than names or primitives.
      ValueError: if a primitive list holds a name that is no JAX primitive's
        (the message lists close matches).

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> from jmp_policy import autocast
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
        matmul_dtype=policy.matmul_dtype,
        fp8_scaling=policy.fp8_scaling,
    )

    def run(g, args, kwargs):
        return _trace_and_eval(lambda a, k: g(*a, **k), (args, kwargs), rules)

    # Not `functools.wraps`: it would copy `fn.__dict__`, and with it the
    # `lower` of a `jax.pmap` or `jax.jit` function, which lowers the
    # original program.
    @functools.wraps(fn, updated=())
    def wrapped(*args, **kwargs):
        for handler in _STATE_HANDLERS:
            outs = handler(run, fn, args, kwargs)
            if outs is not NotImplemented:
                break
        else:
            outs = run(fn, args, kwargs)
        # State returned updated keeps its dtypes; results take the output dtype.
        given = [*args, *kwargs.values()]
        return cast_results(outs, given, policy.cast_to_output, returns_state=returns_state)

    return wrapped
