"""The jaxpr interpreter under `autocast` and `matmuls_in`: a traced program run
again equation by equation, each operation's precision chosen by `Rules`.

`trace_and_eval(fn, args, rules)` traces `fn` and evaluates its program with
the rules: products (`dot_general`, convolutions) through `matmul`'s and
`fp8`'s products, the float32 and promote sets as named, anything else as
written (its floating inputs cast back to the dtypes the traced program had).
Nested programs are rewritten for the inputs they get: calls as if inlined,
loops and branches with their original carry and branch types, checkpointed,
`custom_jvp` and `custom_vjp` functions inside a new one of the same kind,
`shard_map` bodies inside a new `shard_map`. `product_scope` marks products
that take another compute or matmul dtype, read back from the name stack.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import weakref
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32 as _F32
from jmp_policy.core.dtypes import SCALED_MATMUL_DTYPES, cast, is_complex, is_float, widest
from jmp_policy.engine import intent
from jmp_policy.engine.data_flow import MOVES_DATA, buffer_sources, declarations, flow_of
from jmp_policy.engine.decision import Products, Rules, matmul_rules
from jmp_policy.engine.products import cpu_form
from jmp_policy.engine.products.fp8 import fp8_product
from jmp_policy.engine.products.grouped import grouped_product
from jmp_policy.engine.products.half import (
    accumulating_dot,
    accumulating_product,
    clear_shared_products,
    made_here,
    product_of,
)
from jmp_policy.engine.products.matmul_dtype import asks_full_precision
from jmp_policy.engine.rerun import run_again_where_refused
from jmp_policy.engine.residuals import residual_form, traced_for
from jmp_policy.engine.stack_room import call_with_room


def _as_original(eqn, invals):
    """Casts floating inputs back to the dtypes the traced program had."""
    return [
        cast(x, v.aval.dtype) if is_float(x) and x.dtype != v.aval.dtype else x
        for x, v in zip(invals, eqn.invars)
    ]


def _outputs_as(outs, dtypes):
    return [cast(o, d) if is_float(o) else o for o, d in zip(outs, dtypes)]


Marks = Sequence[intent.Mark]


def _eval(
    jaxpr: ji.Jaxpr, consts: Sequence[Any], args: Sequence[Any], rules: Rules, marks: Marks
) -> list[Any]:
    """Runs `jaxpr` under `rules`, its inputs of `marks` (`intent`)."""
    known = intent.marks_of(jaxpr, marks, [intent.given_constant(c) for c in consts])
    return ji.eval_jaxpr(jaxpr, consts, args, functools.partial(_apply, rules=rules, marks=known))


def _body_marks(eqn: ji.JaxprEqn, marks: intent.Marks, part: str = "body") -> list[intent.Mark]:
    """The marks of the inputs of the programs nested in `eqn` (`intent.program_inputs`)."""
    inputs = intent.program_inputs(eqn, [marks[v] for v in eqn.invars], marks)
    assert inputs is not None  # Only asked of equations with programs.
    return inputs[part]


def _rewrite_closed(closed, rules, in_dtypes, marks, out_dtypes=None):
    """The autocast version of a closed jaxpr, for inputs of `in_dtypes` and `marks`.

    With `out_dtypes`, the outputs are cast to them (loop carries and
    branches must keep their types); otherwise they are what autocast makes.
    """

    @_in_scope
    def fn(*args):
        outs = _eval(closed.jaxpr, closed.consts, args, rules, marks)
        return outs if out_dtypes is None else _outputs_as(outs, out_dtypes)

    specs = [ji.stand_in(a, d) for a, d in zip(closed.in_avals, in_dtypes)]
    if closed.consts:
        return jax.make_jaxpr(fn)(*specs)  # Arrays a key does not compare.
    signature = (
        tuple((s.shape, s.dtype, s.weak_type, s.sharding) for s in specs),
        None if out_dtypes is None else tuple(out_dtypes),
        intent.key(closed.jaxpr, marks),
    )
    return _shared("program", closed.jaxpr, rules, signature, lambda: jax.make_jaxpr(fn)(*specs))


def _call_rule(eqn, invals, rules, marks):
    # jit and closed_call: rewritten as if inlined, for the inputs they get.
    name, program = ji.call_program(eqn)
    closed = _rewrite_closed(program, rules, [x.dtype for x in invals], _body_marks(eqn, marks))
    return ji.bind(eqn, invals, ji.replaced_params(eqn, **{name: closed}))


# A while loop's condition takes its own constants and the carry.
_CONDITION_PROGRAMS = frozenset({"cond_jaxpr"})


def _control_flow_rule(eqn, invals, rules, marks):
    if eqn.primitive.name == "scan" and not rules.only_products:
        narrowed = _scan_with_narrowed_carry(eqn, invals, rules, marks)
        if narrowed is not None:
            return narrowed

    def rewrite(closed, name):
        in_dtypes, out_dtypes = ([a.dtype for a in x] for x in (closed.in_avals, closed.out_avals))
        part = "cond" if name in _CONDITION_PROGRAMS else "body"
        return _rewrite_closed(closed, rules, in_dtypes, _body_marks(eqn, marks, part), out_dtypes)

    programs = {
        name: tuple(rewrite(v, name) for v in value)
        if isinstance(value, tuple)
        else rewrite(value, name)
        for name, value in ji.control_flow_programs(eqn).items()
    }
    return ji.bind(eqn, _as_original(eqn, invals), ji.replaced_params(eqn, **programs))


def _scan_with_narrowed_carry(eqn, invals, rules, marks):
    """Under `autocast`, a scan whose carry comes in narrowed by the engine (a
    residual stream over scanned layers: `_between_products`), run with that
    carry in its narrow dtype where the body gives it back so, as the model's
    own half config carries it; None where none comes in narrowed. Its
    constants and scanned inputs take the program's dtypes (a recurrence over
    a sequence from a float32 state runs as written); a carry the body
    widens, too."""
    parts = ji.loop_parts(eqn)
    assert parts is not None  # A scan.
    closed = ji.param(eqn, "jaxpr")
    original = [a.dtype for a in closed.in_avals]
    dtypes = [invals[i].dtype if i in parts.carry and _narrowed(eqn, invals, i) else d
              for i, d in enumerate(original)]  # fmt: skip
    if dtypes == original:
        return None
    inner = _body_marks(eqn, marks)
    body = _rewrite_closed(closed, rules, dtypes, inner)
    made = [a.dtype for a in body.out_avals]
    carry_out = made[: len(parts.carry)]
    if carry_out != [dtypes[i] for i in parts.carry]:
        for k, i in enumerate(parts.carry):  # Widened by the body: the program's dtype.
            dtypes[i] = dtypes[i] if carry_out[k] == dtypes[i] else original[i]
        carry_out = [dtypes[i] for i in parts.carry]
        body = _rewrite_closed(closed, rules, dtypes, inner, carry_out + made[len(carry_out) :])
    args = [cast(x, d) if is_float(x) else x for x, d in zip(invals, dtypes)]
    return ji.bind(eqn, args, ji.replaced_params(eqn, jaxpr=body))


def _remat_rule(eqn, invals, rules, marks):
    body = _remat_body(eqn, rules, _body_marks(eqn, marks))
    return jax.checkpoint(body, **ji.remat_options(eqn))(*invals)


# What the rewrite of one program made (a nested program rewritten, a
# checkpointed body), per program key, for one top-level rewrite: a deep
# model's layers are one program many times over, and one rewrite of it lets
# JAX trace and differentiate it once.
_SHARED: contextvars.ContextVar[dict | None] = contextvars.ContextVar("shared", default=None)


def _shared(kind: str, jaxpr: ji.Jaxpr, rules: Rules, signature: Any, make: Callable) -> Any:
    """`make()`, or what it made for an equal program and signature in this rewrite."""
    made = _SHARED.get()
    key = ji.program_key(jaxpr)
    # FP8 products read what to save from the context they are traced in: not shared.
    if made is None or key is None or may_scale(rules):
        return make()
    # The scopes an operation reads: around the program and inside it (a
    # rule's module traced within it, a region kept as written), which its
    # text does not show.
    scopes = (_scopes_of(_name_stack(), rules), _scopes_in(jaxpr, rules))
    full_key = (kind, key, rules, scopes, signature, _IN_REMAT.get())
    if full_key not in made:
        made[full_key] = make()
    return made[full_key]


# Whether the operation being rewritten is inside a checkpointed region.
_IN_REMAT: contextvars.ContextVar[bool] = contextvars.ContextVar("in_remat", default=False)


def _remat_body(eqn, rules, marks):
    jaxpr = ji.remat_body(eqn)

    @_in_scope
    def body(*args):
        token = _IN_REMAT.set(True)
        try:
            return _eval(jaxpr, (), args, rules, marks)
        finally:
            _IN_REMAT.reset(token)

    return _shared("checkpoint", jaxpr, rules, intent.key(jaxpr, marks), lambda: body)


def _scopes_of(stack: str, rules: Rules) -> tuple:
    """What in a name stack chooses how operations run: a region kept as
    written, `product_scope` markers (scoped rules), the whole stack where
    autocast's `rules=` match it."""
    return (
        bool(ji.marks_in(stack, _AS_WRITTEN)),
        tuple(tuple(m.items()) for m in ji.marks_in(stack, _SCOPE)) if rules.scoped else (),
        stack if rules.by_scope else "",
    )


# Per program (held weakly), per what `_scopes_of` reads: its `_scopes_in`.
_SCOPES_IN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _scopes_in(jaxpr: ji.Jaxpr, rules: Rules) -> tuple:
    """`_scopes_of` each equation of `jaxpr`, nested ones too."""
    known = _SCOPES_IN.setdefault(jaxpr, {})
    reads = (rules.scoped, bool(rules.by_scope))
    if reads not in known:
        known[reads] = tuple(
            (
                _scopes_of(ji.name_stack(eqn), rules),
                tuple(_scopes_in(sub, rules) for sub in ji.sub_jaxprs(eqn)),
            )
            for eqn in jaxpr.eqns
        )
    return known[reads]


def _custom_jvp_rule(eqn, invals, rules, marks):
    # The function and its JVP rule run on the inputs as they come (the
    # values the engine narrowed too), each traced as the program wrote it.
    call = ji.custom_jvp_primal(eqn)
    if not all(is_float(a) for a in (*call.in_avals, *call.out_avals)):
        # Ints would need float0 tangents: run as written.
        return ji.bind(eqn, _as_original(eqn, invals))
    inner = _body_marks(eqn, marks)
    args = _as_original(eqn, invals) if rules.only_products else invals

    @_in_scope
    def primal(*xs):
        return _eval(call.jaxpr, call.consts, xs, rules, inner)

    out_dtypes = [o.dtype for o in jax.eval_shape(primal, *args)]
    f = jax.custom_jvp(primal)

    @f.defjvp
    def f_jvp(primals, tangents):
        # The original rule, rewritten, so that e.g. softmax's exp and sum
        # also run as the rules say under `jax.grad`.
        def jvp(primals, tangents):
            return jax.jvp(lambda *xs: ji.bind(eqn, xs), primals, tangents)

        written = [ji.stand_in(a, a.dtype) for a in call.in_avals]
        program = jax.make_jaxpr(jvp)(written, written)
        given = [*primals, *tangents]
        jvp_marks = [*inner, *(intent.given(x.dtype) for x in tangents)]
        jvp_rules = dataclasses.replace(rules, products="plain")
        outs = _eval(program.jaxpr, program.consts, given, jvp_rules, jvp_marks)
        out, out_dot = outs[: len(out_dtypes)], outs[len(out_dtypes) :]
        return _outputs_as(out, out_dtypes), _outputs_as(out_dot, out_dtypes)

    return f(*args)


def _custom_vjp_rule(eqn, invals, rules, marks):
    # A user's `custom_vjp`: its forward rewritten; its backward the user's
    # rule, rewritten too, from the inputs as residuals (it recomputes the
    # forward, as `jax.checkpoint` would).
    program = ji.custom_vjp_primal(eqn)
    if made_here(ji.custom_vjp_bwd(eqn)):
        return ji.bind(eqn, _as_original(eqn, invals))  # Decided.
    floats = [i for i, a in enumerate(program.in_avals) if is_float(a)]
    if _products_in(program.jaxpr, rules.half) == (0, False):
        return _run_as_written(eqn, invals, floats, rules)  # Nothing to rewrite.
    written = [o.dtype for o in program.out_avals]
    inner = _body_marks(eqn, marks)
    # Under autocast's rules its results are what the engine makes of the
    # inputs as they come (a kernel typed as traced, rounded back).
    args = _as_original(eqn, invals) if rules.only_products else invals

    @_in_scope
    def primal(*xs):
        outs = _eval(program.jaxpr, program.consts, xs, rules, inner)
        return _outputs_as(outs, written) if rules.only_products else outs

    def original_vjp(xs, cts):
        xs = _as_original(eqn, xs)

        def of_floats(*values):  # Integer inputs (group sizes, indices) held.
            return ji.bind(eqn, [*map(dict(zip(floats, values)).get, range(len(xs)), xs)])

        return jax.vjp(of_floats, *(xs[i] for i in floats))[1](_outputs_as(cts, written))

    def bwd(xs, cts):
        # Each cotangent in its primal's dtype, whatever the rule computes in.
        grads = dict(zip(floats, trace_and_eval(original_vjp, (xs, tuple(cts)), rules)))
        return tuple(cast(grads[i], x.dtype) if i in grads else None for i, x in enumerate(xs))

    f = jax.custom_vjp(primal)
    f.defvjp(lambda *xs: (primal(*xs), xs), bwd)
    return f(*args)


def _shard_map_rule(eqn, invals, rules, marks):
    # The per-device program is rewritten inside a new `shard_map` over the
    # same mesh and specs; its inputs and results keep their dtypes, except
    # under `autocast`, where the activations pass through as the engine
    # makes them (a mixture of experts' per-device products).
    jaxpr = ji.shard_map_body(eqn)
    out_dtypes = [ji.shaped(v).dtype for v in jaxpr.outvars]
    inner = _body_marks(eqn, marks)
    as_made = not rules.only_products

    @_in_scope
    def body(*args):
        outs = _eval(jaxpr, (), args, rules, inner)
        return tuple(outs if as_made else _outputs_as(outs, out_dtypes))

    args = invals if as_made else _as_original(eqn, invals)
    return list(jax.shard_map(body, **ji.shard_map_options(eqn))(*args))


_HIGHER_ORDER = {p: _control_flow_rule for p in ji.CONTROL_FLOW_JAXPR_PARAMS}
_HIGHER_ORDER.update({p: _call_rule for p in ji.CALL_JAXPR_PARAM})
_HIGHER_ORDER[ji.remat_p] = _remat_rule
_HIGHER_ORDER[ji.custom_jvp_call_p] = _custom_jvp_rule
_HIGHER_ORDER[ji.custom_vjp_call_p] = _custom_vjp_rule


# `product_scope` markers: a module (or any code) whose products take another
# compute or matmul dtype than the code around it, read back from the name stack.
_SCOPE = "jmp_policy_products"
# `as_written`: a region the policy leaves as the program wrote it.
_AS_WRITTEN = "jmp_policy_as_written"
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


def product_scope(
    compute_dtype: Any, matmul_dtype: Any, fp8_scaling: str = "tensor", reduce_dtype: Any = None
) -> contextlib.AbstractContextManager:
    """Marks the products traced inside it for `matmuls_in(..., scoped=True)`.

    They take `compute_dtype` operands where theirs are wider, or
    `matmul_dtype`'s product (None: none; FP8 or FP4 with `fp8_scaling`),
    and give results in `reduce_dtype` (None: `compute_dtype`), whatever the
    code around them takes.
    """
    m = "none" if matmul_dtype is None else np.dtype(matmul_dtype).name
    c = np.dtype(compute_dtype).name
    r = c if reduce_dtype is None else np.dtype(reduce_dtype).name
    return ji.marked_scope(_SCOPE, c=c, m=m, s=fp8_scaling, r=r)


def as_written() -> contextlib.AbstractContextManager:
    """Keeps the code inside it as the program wrote it, under every front end.

    A context manager and a decorator, in the spirit of PyTorch's
    `torch.autocast(enabled=False)`: the operations traced inside it run in
    the dtypes the program gives them, whatever policy is around it
    (`autocast`, `with_policy`, `jmp_policy.nnx`). For code whose float32
    the program cannot show (a float32 model's `.astype(jnp.float32)` is a
    no-op); what it does show (tables made from positions, a widening before
    a product, `precision=HIGHEST`) is kept without it. A Flax layer called
    inside keeps the dtype fields its front end set: name it in `rules=`
    to keep it in float32.

    >>> import jax.numpy as jnp, jmp_policy as jmp
    >>> def angles(pos, inv):
    ...     return pos @ inv
    >>> pos, inv = jnp.array([[8001.0]]), jnp.array([[1.0]])
    >>> jmp.autocast(angles, "mixed_bfloat16")(pos, inv)  # 8001 is no bfloat16
    Array([[8000.]], dtype=float32)
    >>> jmp.autocast(jmp.as_written()(angles), "mixed_bfloat16")(pos, inv)
    Array([[8001.]], dtype=float32)
    """
    return ji.marked_scope(_AS_WRITTEN)


def _products_here(rules: Rules) -> Products:
    """What decides a product: its innermost scope's under scoped rules, else the rules'."""
    marks = ji.marks_in(_name_stack(), _SCOPE) if rules.scoped else ()
    if not marks:
        return rules.default_products
    c, m, s, r = (marks[-1][k] for k in "cmsr")
    return Products(np.dtype(c), None if m == "none" else np.dtype(m), s, np.dtype(r))


def _results_dtype(eqn, reduce_dtype):
    """The dtype a rewritten product gives its results in: the reduce dtype
    (float32 for a wider one), except where the program's operands are no
    wider than it and it asked for a wider result."""
    if reduce_dtype.itemsize >= _F32.itemsize:
        return _F32
    out_dtype = np.dtype(eqn.outvars[0].aval.dtype)
    asked = out_dtype.itemsize > reduce_dtype.itemsize and all(
        ji.shaped(v).dtype.itemsize <= reduce_dtype.itemsize for v in eqn.invars[:2]
    )
    return _F32 if asked else reduce_dtype


def _leaves_in(eqn, rules, results):
    """The dtype a rewritten product's result leaves it in: the program's
    where only products are rewritten (`matmuls_in`, the front ends under
    float16); else `results` where the program's operands are wider (their
    float32 is the trace's, not the author's: `_between_products`)."""
    out_dtype = eqn.outvars[0].aval.dtype
    if rules.only_products or not all(
        ji.shaped(v).dtype.itemsize > results.itemsize for v in eqn.invars[:2]
    ):
        return out_dtype
    return results if np.dtype(out_dtype).itemsize > results.itemsize else out_dtype


def _matmul_dtype_product(eqn, invals, rules, m, scaling, r):
    """A product under the matmul dtype `m`, or None where that does not apply."""
    if m is None or eqn.primitive is ji.conv_general_dilated_p:
        return None  # Convolutions run in the compute dtype, also under FP8.
    lhs, rhs, *extra = invals
    results = _results_dtype(eqn, r)
    out_dtype = _leaves_in(eqn, rules, results)
    if rules.products == "vjp":
        if m in SCALED_MATMUL_DTYPES and eqn.primitive is ji.dot_general_p:
            p = ji.dot_params(eqn)
            return fp8_product(lhs, rhs, p.dimension_numbers, out_dtype, scaling,
                               p.precision, p.out_sharding, results_dtype=results)  # fmt: skip
        return _accumulating(eqn, invals, m, out_dtype, results)
    if m in SCALED_MATMUL_DTYPES:
        # Inside a JVP rule JAX transposes the products itself, which an
        # unscaled FP8 cast cannot survive: the compute dtype there.
        return None
    return cast(product_of(eqn, extra)(cast(lhs, m), cast(rhs, m), results), out_dtype)


def _product_rule(eqn, invals, rules):
    c, m, scaling, r = _products_here(rules)
    out = _matmul_dtype_product(eqn, invals, rules, m, scaling, r)
    if out is not None:
        return out
    lhs, rhs, *extra = invals
    results = _results_dtype(eqn, r)
    out_dtype = _leaves_in(eqn, rules, results)
    in_compute = all(x.dtype == c or x.dtype.itemsize < c.itemsize for x in (lhs, rhs))
    if rules.only_products and in_compute and results == out_dtype:
        # Operands in the compute dtype (or narrower) already, results in the
        # reduce dtype: as written, unless half operands ask for a float32
        # result on the CPU platform, which takes the form XLA:CPU runs (`cpu_form`).
        wide = np.dtype(out_dtype).itemsize > c.itemsize
        if not (wide and all(x.dtype == c for x in (lhs, rhs)) and cpu_form.in_use()):
            return ji.bind(eqn, _as_original(eqn, invals))
    if eqn.outvars[0].aval.dtype == c and results == c:
        # The program asked for a half result: JAX's own backward is half too.
        return ji.bind(eqn, [cast(lhs, c), cast(rhs, c), *extra])
    if rules.products == "plain" or c.itemsize >= _F32.itemsize:
        return cast(product_of(eqn, extra)(cast(lhs, c), cast(rhs, c), results), out_dtype)
    return _accumulating(eqn, invals, c, out_dtype, results)


def _accumulating(eqn, invals, compute_dtype, out_dtype, results_dtype):
    """The product of `eqn` on `invals` with `compute_dtype` operands (half,
    or FP8 for a grouped one) in both passes: `accumulating_product`; a dot
    through `accumulating_dot`, traced once per signature; a grouped product
    through `grouped_product`."""
    lhs, rhs, *extra = invals
    if extra:
        return grouped_product(eqn, lhs, rhs, extra, compute_dtype, out_dtype, results_dtype)
    if eqn.primitive is ji.dot_general_p:
        p = ji.dot_params(eqn)
        dims, precision, sharding = p.dimension_numbers, p.precision, p.out_sharding
        return accumulating_dot(
            lhs, rhs, dims, precision, sharding, compute_dtype, out_dtype, results_dtype
        )
    product = product_of(eqn)
    return accumulating_product(product, lhs, rhs, compute_dtype, out_dtype, results_dtype)


# Per program: the widest floating operand (in bytes) of a product in it or in
# one nested in it (0: none), and whether it must be rewritten whatever its
# products are: a `product_scope` marks a part of it, or a `custom_jvp` in it
# may hold products in its rule that its program does not show.
_PRODUCTS_IN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _products_in(jaxpr: ji.Jaxpr, half: frozenset[str]) -> tuple[int, bool]:
    known = _PRODUCTS_IN.setdefault(jaxpr, {})
    if half not in known:
        widest, opaque = 0, False
        for e in jaxpr.eqns:
            nested = list(ji.sub_jaxprs(e))
            if e.primitive.name in half:
                floats = [np.dtype(v.aval.dtype).itemsize for v in e.invars if is_float(v.aval)]  # type: ignore[attr-defined]
                widest = max(widest, *floats, 0)
            if e.primitive is ji.custom_jvp_call_p:
                opaque = True
            elif e.primitive.name in half or nested:
                opaque = opaque or bool(ji.marks_in(ji.name_stack(e), _SCOPE))
            for j in nested:
                w, o = _products_in(j, half)
                widest, opaque = max(widest, w), opaque or o
        known[half] = (widest, opaque)
    return known[half]


def _runs_as_traced(eqn: ji.JaxprEqn, rules: Rules) -> bool:
    """Under `matmuls_in`, whether a call or loop is left as traced: no product
    in it would change (none, or all in the compute dtype already, with no
    matmul dtype), and nothing in it must be rewritten (see `_products_in`).
    JAX's caches, keyed on the nested program, then serve every layer."""
    if not rules.only_products or eqn.primitive is ji.custom_jvp_call_p:
        return False
    found = [_products_in(j, rules.half) for j in ji.sub_jaxprs(eqn)]
    if any(opaque for _, opaque in found):
        return False
    widest = max((w for w, _ in found), default=0)
    if widest == 0:
        return True
    c, m, _, r = _products_here(rules)
    return m is None and widest <= c.itemsize and r == c


def _rules_here(rules: Rules) -> Rules | None:
    """The rules of the operation being rewritten: None in a region kept as
    written (`as_written`, or autocast's `rules=` naming it so), else those
    autocast's `rules=` give its named scope, else `rules`."""
    stack = _name_stack()
    if ji.marks_in(stack, _AS_WRITTEN):
        return None
    return rules.for_scope(stack) if rules.by_scope else rules


def _apply(eqn, invals, rules, marks):
    here = _rules_here(rules)
    if here is None:
        return ji.bind(eqn, _as_original(eqn, invals))
    rules = here
    prim, name = eqn.primitive, eqn.primitive.name
    nested = prim in _HIGHER_ORDER or ji.is_shard_map(eqn)
    if nested and _runs_as_traced(eqn, rules):
        return ji.bind(eqn, _as_original(eqn, invals))
    if prim in _HIGHER_ORDER:
        return _HIGHER_ORDER[prim](eqn, invals, rules, marks)
    if ji.is_shard_map(eqn):
        return _shard_map_rule(eqn, invals, rules, marks)
    if prim is ji.convert_element_type_p:
        x, new_dtype = invals[0], ji.new_dtype(eqn)
        if x.dtype == new_dtype or (_narrowed(eqn, invals, 0) and not rules.only_products
                                    and ji.shaped(eqn.invars[0]).dtype == new_dtype):  # fmt: skip
            # As traced, a no-op: a value the engine narrowed stays so (a
            # widening the program writes from a narrower dtype is the author's).
            return x
        config = rules.config_dtype
        if new_dtype == config and is_float(x) and x.dtype.itemsize < config.itemsize:
            return x  # The config's cast, which its own half config does not widen.
        return ji.bind(eqn, invals)
    if prim in ji.WRITTEN_OPERAND and is_float(invals[0]):
        # A write keeps its buffer's dtype; what is written takes it.
        at = ji.WRITTEN_OPERAND[prim]
        args = _as_original(eqn, invals)
        args[0], args[at] = invals[0], cast(args[at], invals[0].dtype)
        return ji.bind(eqn, args)
    if rules.only_products and name in MOVES_DATA and is_float(invals[0]):
        # Moved, not computed on: a buffer read in its own dtype (a half cache
        # given to a program traced in float32) is written back in it.
        # (`autocast`'s own lists promote these.)
        return ji.bind(eqn, [invals[0], *_as_original(eqn, invals)[1:]])
    if name == "gather" and _looks_up_a_parameter(eqn, invals, rules, marks):
        # An embedding: the activation it gives is in the compute dtype, as
        # the model's own half config looks it up in its half table.
        return ji.bind(eqn, [cast(invals[0], rules.compute_dtype), *invals[1:]])
    floats = [i for i, x in enumerate(invals) if is_float(x)]
    if not floats or not (name in rules.half or name in rules.float32 or name in rules.promote):
        return _run_as_written(eqn, invals, floats, rules)
    if name in rules.half:
        authors = _authors_precision(eqn, rules, marks)
        operands = [i for i in floats if i < 2]
        if operands and is_float(eqn.outvars[0].aval) and not authors:
            if len(operands) == 1 and not is_complex(invals[1 - operands[0]]):
                # An integer or boolean operand (a head mask) joins the other's
                # dtype, as JAX's promotion gives it in a half config.
                other = invals[operands[0]].dtype
                invals = [cast(x, other) if i < 2 and not is_float(x) else x
                          for i, x in enumerate(invals)]  # fmt: skip
            return _product_rule(eqn, invals, rules)
        return ji.bind(eqn, _as_original(eqn, invals))
    strong = [invals[i].dtype for i in floats if not eqn.invars[i].aval.weak_type]
    target = widest(strong or [invals[i].dtype for i in floats])
    if name in rules.float32:
        target = _F32 if target.itemsize < _F32.itemsize else target
    back = _between_products(eqn, invals, floats, rules)

    def run(*xs):
        out = ji.bind(eqn, [cast(x, target) if i in floats else x for i, x in enumerate(xs)])
        return out if back is None else _results_rounded_back(eqn, out, back, rules)

    if back is None or back.itemsize >= target.itemsize:
        return run(*invals)
    # Computed wide, rounded back once; the backward pass keeps the narrow
    # inputs and recomputes it (a fused elementwise op), so no wide copy of
    # an activation is saved that the half config would not save. No
    # barrier: XLA fuses the recomputation into the backward's own kernels.
    # Inside a checkpointed region its policy decides (a checkpoint nested
    # in one would keep its result).
    return run(*invals) if _IN_REMAT.get() else jax.checkpoint(run, prevent_cse=False)(*invals)


def _authors_precision(eqn: ji.JaxprEqn, rules: Rules, marks: intent.Marks) -> bool:
    """Whether a product keeps the precision its author wrote: `precision=HIGHEST`,
    a table, a widening (`intent`), but one to the config's dtype the user named."""
    if asks_full_precision(ji.product_precision(eqn)):
        return True
    config = rules.config_dtype
    by_config = config is not None and config.itemsize > rules.compute_dtype.itemsize
    return intent.keeps_authors_precision(eqn, marks, widened_by_config=by_config)


def _run_as_written(eqn, invals, floats, rules):
    """An operation the rules do not name (a kernel, a collective) runs as the
    program wrote it. Its one floating result, computed from values the
    engine made narrower, is rounded back once, as a float32-set operation's
    (`_between_products`); results that may be its inputs passed through
    (several, or written into an input's buffer) keep the written dtypes."""
    out = ji.bind(eqn, _as_original(eqn, invals))
    results = [v for v in eqn.outvars if is_float(ji.shaped(v))]
    if len(results) != 1 or ji.aliased_outputs(eqn):
        return out
    back = _between_products(eqn, invals, floats, rules)
    return out if back is None else _results_rounded_back(eqn, out, back, rules)


def _results_rounded_back(eqn, out, back, rules):
    # Inside a JVP rule, whose tangents JAX transposes, a plain (linear) cast.
    saturate = rules.products != "plain"
    if not eqn.primitive.multiple_results:
        return _rounded_back(out, back, saturate)
    return [_rounded_back(o, back, saturate) for o in out]


def _rounded_back(x, dtype, saturate=True):
    """A wide result in the narrow `dtype`, saturated to its range (as FP8
    casts saturate): a float32 mask value (`finfo(float32).min`) met by a
    half activation stays a large finite number, as the half config's own
    `finfo(bfloat16).min` is, not an infinity that a fully masked softmax row
    would turn into NaN. NaN stays NaN."""
    if not is_float(x) or x.dtype.itemsize <= np.dtype(dtype).itemsize:
        return x
    return _saturating_cast(x, np.dtype(dtype)) if saturate else cast(x, dtype)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1,))
def _saturating_cast(x, dtype):
    info = jnp.finfo(dtype)
    return cast(
        jax.lax.clamp(np.asarray(info.min, x.dtype), x, np.asarray(info.max, x.dtype)), dtype
    )


@_saturating_cast.defjvp
def _saturating_cast_jvp(dtype, primals, tangents):
    # A cast's derivative (the half config's mask value is finite too): no
    # residual saved, as for a plain cast.
    return _saturating_cast(primals[0], dtype), cast(tangents[0], dtype)


def _looks_up_a_parameter(
    eqn: ji.JaxprEqn, invals: Sequence[Any], rules: Rules, marks: intent.Marks
) -> bool:
    """Under `autocast`, whether a gather reads an argument's own elements
    (a parameter table, not a value the program computed) wider than the
    compute dtype, by integer indices."""
    table, mark = invals[0], marks[eqn.invars[0]]
    return (
        not rules.only_products
        and is_float(table)
        and mark.origin is intent.Origin.DATA
        and mark.buffer
        and table.dtype.itemsize > rules.compute_dtype.itemsize
    )


# Float32-set operations whose results stay float32: sums and products over
# many values (a norm's mean and variance, softmax's denominator, a running
# sum), the statistics the rest of a model divides and subtracts by.
STATISTICS = frozenset({"reduce_sum", "reduce_prod", "cumsum", "cumprod", "cumlogsumexp"})


def _between_products(
    eqn: ji.JaxprEqn, invals: Sequence[Any], floats: Sequence[int], rules: Rules
) -> np.dtype | None:
    """The dtype an operation on values the engine made narrower than the
    program's gives its results in, or None (as the rules compute them).

    A product's rewritten result is in the compute dtype (`_leaves_in`);
    what the model computes from it stays there, as in the model's own half
    config: a bias, a parameter or a float32 statistic it meets joins it
    (computed in the wider dtype, rounded once), and a float32-set operation
    on it (an exponential, GELU's cube) computes in float32 and rounds back
    once, where the half config computes it in half. A sum or product over
    many values (`STATISTICS`) stays float32. So for bfloat16 (and the FP8
    policies, which compute in it); not for float16 (below). Under a front
    end (`Rules.fields_set`) a float32-set operation on what the fields made
    half rounds back too: the own config computes it in half.
    """
    narrowed = [invals[i].dtype for i in floats if _narrowed(eqn, invals, i)]
    if rules.fields_set and eqn.primitive.name in rules.float32:
        # What the fields made half is the own config's half: rounded back to it too.
        narrowed += [invals[i].dtype for i in floats if invals[i].dtype.itemsize < _F32.itemsize]
    if not narrowed or eqn.primitive.name in STATISTICS:
        return None
    back = widest(narrowed)
    # float16 has not float32's range: there a float32 value it meets wins,
    # as JAX promotes and PyTorch AMP keeps it (a normalization's float32
    # statistics, an exponential).
    return back if jnp.finfo(back).maxexp >= jnp.finfo(_F32).maxexp else None


def _narrowed(eqn: ji.JaxprEqn, invals: Sequence[Any], i: int) -> bool:
    """Whether the engine made the equation's input `i` narrower than the program's."""
    x = invals[i]
    return is_float(x) and x.dtype.itemsize < ji.shaped(eqn.invars[i]).dtype.itemsize


def may_scale(rules: Rules) -> bool:
    """Whether products under `rules` may be FP8 or FP4 (a scope may say so):
    only then are the derivatives their values are traced under probed."""
    return rules.scaled_scopes or rules.matmul_dtype in SCALED_MATMUL_DTYPES


def trace_and_eval(fn: Callable, args: Any, rules: Rules | None, *, flow: bool = False) -> Any:
    """Traces `fn(*args)` and runs it again under `rules`; array leaves are traced.

    With `rules` None the program runs as traced. With `flow`, returns
    `(result, Flow)`: which argument each result array is a buffer of.
    """
    leaves, treedef = jax.tree.flatten(args)
    arrays = ji.ARRAYS
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
    declared_dtypes: list[Any] = []

    def traced_fn(*traced):
        given = [x.dtype for x in values]  # Not the widened stand-ins' (`_traced_and_run`).
        declaring: contextlib.AbstractContextManager[Any] = (
            declarations(traced, given) if flow else contextlib.nullcontext()
        )
        with declaring as declared:
            results, tree = jax.tree.flatten(flat_fn(*traced))
        # The arrays are tracers of this trace: only their places are kept.
        out_leaves[:] = [_TRACED if isinstance(x, arrays) else x for x in results]
        out_tree[:] = [tree]
        array_results = [x for x in results if isinstance(x, arrays)]
        declared_dtypes[:] = [declared and declared.kept_dtype(x) for x in array_results]
        return array_results

    values = [leaves[i] for i in dynamic]
    token = _SHARED.set({}) if _SHARED.get() is None else None
    try:
        if token is None:
            results, closed = _traced_and_run(traced_fn, values, rules)
        else:  # A whole model's trace: room for its frames (`stack_room`).
            results, closed = call_with_room(_traced_and_run, traced_fn, values, rules)
    finally:
        if token is not None:
            _SHARED.reset(token)
    outs = iter(results)
    full = [next(outs) if x is _TRACED else x for x in out_leaves]
    out = jax.tree.unflatten(out_tree[0], full)
    if not flow:
        return out
    made = [ji.shaped(v).dtype for v in closed.jaxpr.outvars]
    return out, flow_of(values, buffer_sources(closed.jaxpr), results, declared_dtypes, made)


def _traced_and_run(traced_fn: Callable, values: list, rules: Rules | None) -> tuple[list, Any]:
    """`traced_fn`'s program on `values`, and the results of running it under `rules`."""
    # FP8 products traced on stand-ins (here, and for nested programs as they
    # are rewritten) save what the values' derivatives need.
    scaled = rules is not None and may_scale(rules)
    with traced_for(values) if scaled else contextlib.nullcontext():
        trace = lambda values: jax.make_jaxpr(traced_fn)(*values)  # noqa: E731
        # Run on the values as given, each write of a program traced widened
        # takes its buffer's dtype and each carry the dtype it came in.
        closed = trace(values) if rules is None else traced_widened_where_refused(trace, values)
        if rules is None:
            return ji.eval_jaxpr(closed.jaxpr, closed.consts, values, ji.bind), closed
        marks = [intent.given(x.dtype) for x in values]  # Arguments: NumPy ones too.
        return _eval(closed.jaxpr, closed.consts, values, rules, marks), closed


def flow_recording_runner(rules: Rules | None) -> tuple[Callable, list]:
    """`(run, flows)`: `run(g, args, kwargs)` returns `g(*args, **kwargs)`
    traced and evaluated under `rules`, and appends its `Flow` to `flows`
    (the front ends' call, also through a framework's state handler)."""
    flows: list = []

    def run(g: Callable, args: tuple, kwargs: dict) -> Any:
        out, flow = trace_and_eval(lambda a, k: g(*a, **k), (args, kwargs), rules, flow=True)
        flows.append(flow)
        return out

    return run, flows


T = TypeVar("T")


def traced_widened_where_refused(trace: Callable[[Any], T], values: Any) -> T:
    """`trace(values)`, or where JAX refuses the program as written on half
    values, `trace` of stand-ins for them in float32 (`widened`): what a
    float32 program computes then fits its buffers, and it runs on the
    values as given. Said in a `RuntimeWarning` (`rerun`).

    JAX refuses a write into a buffer of another dtype (a bf16 cache given to
    a float32 program) and a loop whose float32 body changes a bf16 carry
    given to it; every other error is raised as it came.

    Raises:
      The refusal, with a note, where the widened trace fails too.
    """

    def refused(e: Exception) -> bool:
        return ji.is_write_dtype_mismatch(e) or ji.is_loop_carry_type_change(e)

    def says(e: Exception) -> str:
        # JAX's first line only: the same text for every call of the program,
        # which Python's default warning filters show once.
        return (
            f"jmp_policy: the program refuses the half values it is given as written "
            f"({str(e).splitlines()[0]}); it is traced with its floating arguments in "
            "float32 and runs on the values as given: each write takes its buffer's "
            "dtype, each loop carry the dtype it came in."
        )

    return run_again_where_refused(
        lambda: trace(values),
        lambda _: trace(widened(values, abstract=True)),
        refused=refused,
        says=says,
        note="Traced with its floating arguments in float32, it failed too.",
    )


def widened(values: Any, *, abstract: bool) -> Any:
    """`values` with the floating arrays in float32 (or the widest dtype among
    them): stand-ins (`abstract`) or copies. What a float32 program is given."""
    leaves, treedef = jax.tree.flatten(values)
    wide = widest([_F32, *(x.dtype for x in leaves if is_float(x))])

    def widen(x: Any) -> Any:
        if not is_float(x):
            return x
        return ji.stand_in(jax.typeof(x), wide, weak_type=False) if abstract else cast(x, wide)

    return jax.tree.unflatten(treedef, [widen(x) for x in leaves])


_TRACED = object()  # The place of an array result in `trace_and_eval`.


def matmuls_in(
    fn: Callable,
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    *,
    scoped: bool = False,
    shared: bool = False,
    reduce_dtype: Any = None,
) -> Callable:
    """`fn` with every `dot_general` taking `matmul_dtype`'s product; all else as written.

    For code with no `dot_general` hook (`jnp.einsum` and `@` in model code,
    attention): half operands with float32 accumulation, or FP8
    (`fp8_dot_general`, with `fp8_scaling`), forward and backward. Each
    product keeps the result dtype of the traced program. With `scoped`, a
    product traced inside `product_scope(c, m)` takes those instead, the
    innermost scope winning; `matmul_dtype` may then be None.
    Array arguments are traced, anything else is static. With `shared` (not
    with `scoped`), for an `fn` called often with the same shapes (the
    attention of every layer): calls whose other arguments are plain values
    (numbers, strings, dtypes, enums, None) share one traced rewrite per
    signature, an inlined `jax.jit`; their results must be arrays. The caller
    vouches that `fn` reads nothing but its arguments: what it read otherwise
    (an array, a variable, a module's attribute) would stay as first traced.
    jmp_policy shares only Flax's own `dot_product_attention`. Products give
    their results in `reduce_dtype` (see `half_dot_general`; None: float32).
    """
    rules = matmul_rules(
        matmul_dtype, fp8_scaling, scoped=scoped, scaled_scopes=scoped, reduce_dtype=reduce_dtype
    )

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        if shared and not scoped:
            out = _shared_rewrite(fn, rules, args, kwargs)
            if out is not NotImplemented:
                return out
        return trace_and_eval(lambda a, k: fn(*a, **k), (args, kwargs), rules)

    return wrapped


# `matmuls_in(shared=True)`: per function (held weakly), per signature, the
# inlined `jax.jit` of its rewrite.
_SHARED_REWRITES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _shared_rewrite(fn: Callable, rules: Rules, args: tuple, kwargs: dict) -> Any:
    """`fn(*args, **kwargs)` rewritten through its shared trace; NotImplemented if none can be."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    is_array = tuple(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)
    static = tuple((type(x), x) for x, a in zip(leaves, is_array) if not a)
    if not all(ji.is_plain(x) for _, x in static):
        return NotImplemented  # A module or a function: not kept alive in a cache.
    try:
        per_signature = _SHARED_REWRITES.setdefault(fn, {})
    except TypeError:  # No weak reference to `fn`.
        return NotImplemented
    arrays = [x for x, a in zip(leaves, is_array) if a]
    scaled = may_scale(rules)
    with traced_for(arrays) if scaled else contextlib.nullcontext():
        # What FP8 products save (`fp8_residuals`' setting, the operands under
        # second-order differentiation of `arrays`) is read as they trace: a key.
        key = (rules, treedef, is_array, static, residual_form(None) if scaled else None)
        if key not in per_signature:
            ref = weakref.ref(fn)
            values = [None if a else x for x, a in zip(leaves, is_array)]  # Plain values only.

            def rewritten(*arrays):
                it = iter(arrays)
                full = [next(it) if a else v for v, a in zip(values, is_array)]
                f = ref()
                assert f is not None  # The caller holds `fn` while this runs.
                given = jax.tree.unflatten(treedef, full)  # (args, kwargs)
                return trace_and_eval(lambda a, k: f(*a, **k), given, rules)

            per_signature[key] = ji.inlined_jit(rewritten)
        return per_signature[key](*arrays)


def clear_shared_traces() -> None:
    """Forgets the traces `matmuls_in(shared=True)` and the half products share."""
    _SHARED_REWRITES.clear()
    clear_shared_products()
