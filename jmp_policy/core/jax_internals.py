"""The one place jmp_policy touches what JAX does not promise to keep.

`autocast`, the backward pass of the float32-accumulating matmuls and
`diagnose` walk jaxprs. `jax.extend` promises no compatibility across JAX
releases, and the equation attributes used here (`eqn.params` keys such as
`"jaxpr"`, `"dimension_numbers"`, `"new_dtype"`, `eqn.ctx`,
`Primitive.get_bind_params`) are not documented API; nor are `jnp.einsum`'s
`_dot_general=`, the texts of four JAX errors, the trace a loop body is
traced in (`DebugInfo.traced_for`). Everything of that kind is in
this module, so that a JAX upgrade breaks here first and is fixed here once.
Each internal has a probe in the test suite (`tests/jax_probes.py`) that fails
with `JaxChanged`, naming the installed JAX, when JAX changes it; a read that
finds an internal gone raises `JaxChanged` too, never a wrong result. Checked
against jax and jaxlib 0.10.2 and 0.12.0.1.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import inspect
import re
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np

CHECKED_AGAINST = "jax 0.10.2 and 0.12.0.1"


class JaxChanged(RuntimeError):
    """A JAX internal that jmp_policy reads is not what it was checked against."""

    def __init__(self, what: str):
        super().__init__(
            f"jmp_policy reads {what}, which jax {jax.__version__} does not provide as "
            f"{CHECKED_AGAINST} do. Use a JAX release this jmp_policy supports (its "
            "pyproject.toml says which), or report this message."
        )


Jaxpr = jex.core.Jaxpr
ClosedJaxpr = jex.core.ClosedJaxpr
JaxprEqn = jex.core.JaxprEqn
Primitive = jex.core.Primitive
primitives = jex.core.primitives


def _primitive(name: str) -> Primitive:
    p = getattr(primitives, name, None)
    if not isinstance(p, Primitive):
        raise JaxChanged(f"jax.extend.core.primitives.{name}")
    return p


# Equations whose parameters hold a program run as if inlined: which parameter.
CALL_JAXPR_PARAM: dict[Primitive, str] = {
    _primitive("jit_p"): "jaxpr",
    _primitive("closed_call_p"): "call_jaxpr",
}
# Control flow: the parameters holding programs whose input and output types are
# fixed by the loop carry or the branch signature.
CONTROL_FLOW_JAXPR_PARAMS: dict[Primitive, tuple[str, ...]] = {
    _primitive("scan_p"): ("jaxpr",),
    _primitive("while_p"): ("cond_jaxpr", "body_jaxpr"),
    _primitive("cond_p"): ("branches",),
}
# `shard_map` (also what `jax.pmap` lowers to since JAX 0.8) is not in
# `jax.extend.core.primitives`: it is matched by name.
SHARD_MAP_NAME = "shard_map"
remat_p: Primitive = _primitive("remat_p")
custom_jvp_call_p: Primitive = _primitive("custom_jvp_call_p")
custom_vjp_call_p: Primitive = _primitive("custom_vjp_call_p")
convert_element_type_p: Primitive = _primitive("convert_element_type_p")
dot_general_p: Primitive = _primitive("dot_general_p")
conv_general_dilated_p: Primitive = _primitive("conv_general_dilated_p")
# Every bilinear product: `ragged_dot_general` (grouped matmuls) is not in
# `jax.extend.core.primitives` and is matched by name, as `shard_map` is.
PRODUCT_NAMES = frozenset({"dot_general", "conv_general_dilated", "ragged_dot_general"})
# Writes into a buffer: the position of the value written among the operands.
WRITTEN_OPERAND: dict[Primitive, int] = {
    _primitive("dynamic_update_slice_p"): 1,
    _primitive("scatter_p"): 2,
}


def param(eqn: JaxprEqn, name: str) -> Any:
    """The equation's parameter `name`; `JaxChanged` if its primitive has none."""
    try:
        return eqn.params[name]
    except KeyError:
        raise JaxChanged(f"the parameter {name!r} of {eqn.primitive.name} equations") from None


def replaced_params(eqn: JaxprEqn, **changes: Any) -> dict[str, Any]:
    """The equation's parameters with `changes`, each of which it must have."""
    for name in changes:
        param(eqn, name)
    return {**eqn.params, **changes}


class DotParams(NamedTuple):
    """What a `dot_general` equation was asked for, beyond its operands."""

    dimension_numbers: Any
    precision: Any
    preferred_element_type: Any
    out_sharding: Any  # None where the JAX release has no such parameter.


def dot_params(eqn: JaxprEqn) -> DotParams:
    """The parameters of a `dot_general` equation."""
    return DotParams(
        param(eqn, "dimension_numbers"),
        param(eqn, "precision"),
        param(eqn, "preferred_element_type"),
        eqn.params.get("out_sharding"),
    )


def product_precision(eqn: JaxprEqn) -> Any:
    """The `precision` a `dot_general` or `conv_general_dilated` equation was asked for."""
    return param(eqn, "precision")


def conv_dimension_numbers(eqn: JaxprEqn) -> Any:
    """The `(lhs_spec, rhs_spec, out_spec)` of a `conv_general_dilated` equation."""
    return param(eqn, "dimension_numbers")


def with_result_type(eqn: JaxprEqn, preferred_element_type: Any) -> dict[str, Any]:
    """A product equation's parameters, accumulating into `preferred_element_type`."""
    return replaced_params(eqn, preferred_element_type=preferred_element_type)


def new_dtype(eqn: JaxprEqn) -> np.dtype:
    """The dtype a `convert_element_type` equation converts to."""
    return np.dtype(param(eqn, "new_dtype"))


def call_program(eqn: JaxprEqn) -> tuple[str, ClosedJaxpr]:
    """`(parameter name, program)` of a `jit` or `closed_call` equation."""
    name = CALL_JAXPR_PARAM[eqn.primitive]
    return name, param(eqn, name)


def control_flow_programs(eqn: JaxprEqn) -> dict[str, Any]:
    """The program parameters of a `scan`, `while` or `cond` equation (a tuple for branches)."""
    return {name: param(eqn, name) for name in CONTROL_FLOW_JAXPR_PARAMS[eqn.primitive]}


def inlined_jit(fn: Callable) -> Callable:
    """`jax.jit(fn)`, whose program is inlined into the calling trace.

    Traced once per signature (JAX's caches), it leaves no `jit` equation
    behind: the caller's program is the one calling `fn` itself gives. JAX
    0.10 says so with `inline=True`; later releases mean "inline at lowering"
    by that, and `jax.Inline.JAX_EARLY` is the old meaning.
    """
    inline = getattr(jax, "Inline", None)
    return jax.jit(fn, inline=True if inline is None else inline.JAX_EARLY)


def varying_alike(*xs: Any) -> tuple[Any, ...]:
    """`xs`, each marked varying over every manual mesh axis one of them varies
    over (inside `shard_map`), as JAX marks the operands of its own binary
    operations. A `jax.custom_vjp`'s cotangents must have their primals'
    types: the cotangent of a replicated weight times a sharded input varies,
    so the weight is marked varying first, and JAX sums its cotangent over
    the devices when it transposes the mark (as for `lax.dot_general`).
    """
    vmas = [varying_axes(jax.typeof(x)) for x in xs]
    union = frozenset().union(*vmas)
    if not union:
        return xs
    # `pcast(..., to="varying")` is JAX 0.12's name for 0.10's `pvary`.
    pcast = getattr(jax.lax, "pcast", None)
    mark = (lambda x, axes: pcast(x, axes, to="varying")) if pcast else jax.lax.pvary  # type: ignore[attr-defined]
    return tuple(
        x if vma == union else mark(x, tuple(sorted(union - vma))) for x, vma in zip(xs, vmas)
    )


def varying_axes(aval: Any) -> frozenset:
    """The manual mesh axes a value varies over: JAX 0.12's
    `manual_axis_type.varying`, 0.10's `vma`; none outside `shard_map`."""
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return frozenset(manual.varying)
    return frozenset(getattr(aval, "vma", ()))


def einsum_with_dot_general(dot_general: Callable) -> Callable:
    """`jnp.einsum` whose products run through `dot_general` (a private argument)."""
    if "_dot_general" not in inspect.signature(jnp.einsum).parameters:
        raise JaxChanged("jnp.einsum's _dot_general= argument")
    return functools.partial(jnp.einsum, _dot_general=dot_general)


def is_forward_mode_of_custom_vjp(error: TypeError) -> bool:
    """Whether `error` is JAX refusing forward-mode differentiation of a `custom_vjp`."""
    text = str(error)
    return "forward-mode" in text and "custom_vjp" in text


def is_loop_carry_type_change(error: Exception) -> bool:
    """Whether `error` is JAX refusing a loop body that changes its carry's type."""
    text = str(error)
    return (
        isinstance(error, TypeError)
        and "carry input and carry output must have equal types" in text
    )


def is_dtype_mismatch(error: Exception) -> bool:
    """Whether `error` is JAX refusing operands of two dtypes (`lax`, or `jnp` under
    strict promotion); not an error of the user's code that mentions dtypes."""
    if type(error).__name__ == "TypePromotionError" and type(error).__module__.startswith("jax"):
        return True
    return isinstance(error, TypeError) and "requires arguments to have the same dtypes" in str(
        error
    )


def is_write_dtype_mismatch(error: Exception) -> bool:
    """Whether `error` is `lax.dynamic_update_slice` or `lax.scatter` refusing to
    write a value of another dtype than the buffer's."""
    text = str(error)
    return isinstance(error, TypeError) and any(
        f"lax.{p.name} requires arguments to have the same dtypes" in text for p in WRITTEN_OPERAND
    )


def primitive_names() -> frozenset[str]:
    """The names of the primitives `jax.extend` exposes (for validating user lists)."""
    return frozenset(p.name for p in vars(primitives).values() if isinstance(p, Primitive))


def bind(eqn: JaxprEqn, args: Sequence[Any], params: dict[str, Any] | None = None) -> Any:
    """Runs the equation's primitive on `args`, with its own or replaced `params`."""
    params = eqn.params if params is None else params
    return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
    """The `jax.checkpoint` arguments that made a `remat` equation."""
    return {"prevent_cse": param(eqn, "prevent_cse"), "policy": param(eqn, "policy")}


def is_shard_map(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `shard_map` (or a `jax.pmap`, which is one)."""
    return eqn.primitive.name == SHARD_MAP_NAME


def shard_map_body(eqn: JaxprEqn) -> Jaxpr:
    """The per-device program of a `shard_map` equation (no constants)."""
    return param(eqn, "jaxpr")


def shard_map_options(eqn: JaxprEqn) -> dict[str, Any]:
    """The `jax.shard_map` arguments that made a `shard_map` equation."""
    return {
        "mesh": param(eqn, "mesh"),
        "in_specs": tuple(param(eqn, "in_specs")),
        "out_specs": tuple(param(eqn, "out_specs")),
        "axis_names": frozenset(param(eqn, "newly_manual_axes")),
        "check_vma": param(eqn, "check_vma"),
    }


def custom_jvp_primal(eqn: JaxprEqn) -> ClosedJaxpr:
    """The primal program of a `custom_jvp_call` equation."""
    return param(eqn, "call_jaxpr")


def custom_vjp_primal(eqn: JaxprEqn) -> ClosedJaxpr:
    """The primal program of a `custom_vjp_call` equation, over all its inputs.

    JAX 0.10 holds it closed, newer JAX open, its constants leading inputs.
    """
    program = param(eqn, "call_jaxpr")
    if isinstance(program, ClosedJaxpr):
        return program
    if not isinstance(program, Jaxpr):
        raise JaxChanged("the call_jaxpr of custom_vjp_call")
    return ClosedJaxpr(program, ())


def custom_vjp_bwd(eqn: JaxprEqn) -> Callable | None:
    """The backward rule a `custom_vjp_call` equation's function was given (`defvjp`)."""
    return getattr(param(eqn, "bwd"), "f", None)


def aliased_outputs(eqn: JaxprEqn) -> dict[int, int]:
    """The results a kernel or foreign call writes into one of its inputs'
    buffers (`pallas_call`'s and `ffi_call`'s `input_output_aliases`):
    result position -> input position."""
    aliases = eqn.params.get("input_output_aliases") or ()
    pairs = aliases.items() if isinstance(aliases, dict) else aliases
    try:
        return {int(out): int(given) for given, out in pairs}
    except (TypeError, ValueError) as e:
        raise JaxChanged(f"the input_output_aliases of {eqn.primitive.name}") from e


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """Every program nested in the equation's parameters."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


Literal = jex.core.Literal
DropVar = jex.core.DropVar
ARRAYS = (jax.Array, np.ndarray, np.generic)


def inlined_body(eqn: JaxprEqn) -> Jaxpr | None:
    """The program a call-like equation runs on its own inputs, one for one:
    `jit`, `closed_call`, `remat`, `custom_jvp_call`, `custom_vjp_call` (its
    primal) and `shard_map`; None for any other equation."""
    if eqn.primitive in CALL_JAXPR_PARAM:
        return call_program(eqn)[1].jaxpr
    if eqn.primitive is remat_p or is_shard_map(eqn):
        return param(eqn, "jaxpr")
    if eqn.primitive is custom_jvp_call_p:
        return custom_jvp_primal(eqn).jaxpr
    if eqn.primitive is custom_vjp_call_p:
        return custom_vjp_primal(eqn).jaxpr
    return None


class LoopParts(NamedTuple):
    """A loop equation's body and the positions, among the equation's inputs,
    of the body's constants, carry and scanned-over inputs; the body's
    outputs are the new carry, then (a scan's) the per-step results."""

    body: Jaxpr
    consts: range
    carry: range
    xs: range


def loop_parts(eqn: JaxprEqn) -> LoopParts | None:
    """The `LoopParts` of a `scan` or `while` equation; None for any other."""
    if eqn.primitive.name == "scan":
        if "ft_in" in eqn.params:  # JAX 0.12: flat trees of (consts, carry, xs).
            # A traced scan's is a tuple of three; a transposed one's a pytree
            # of three, nested: `unpack` gives the three parts of either.
            tree = param(eqn, "ft_in")
            parts = tree.unpack() if hasattr(tree, "unpack") else getattr(tree, "elts", None)
            if parts is None:
                raise JaxChanged("the parts of a scan equation's `ft_in`")
            n, c = (len(list(part.vals)) for part in list(parts)[:2])
        else:
            n, c = param(eqn, "num_consts"), param(eqn, "num_carry")
        end = len(eqn.invars)
        return LoopParts(param(eqn, "jaxpr").jaxpr, range(n), range(n, n + c), range(n + c, end))
    if eqn.primitive.name == "while":
        start = param(eqn, "cond_nconsts")
        n = param(eqn, "body_nconsts")
        end = len(eqn.invars)
        body = param(eqn, "body_jaxpr").jaxpr
        return LoopParts(body, range(start, start + n), range(start + n, end), range(end, end))
    return None


def branches(eqn: JaxprEqn) -> list[Jaxpr] | None:
    """The branches of a `cond` equation (each takes its inputs after the index)."""
    if eqn.primitive.name != "cond":
        return None
    return [b.jaxpr for b in param(eqn, "branches")]


# What `DebugInfo.traced_for` says of a loop body's trace: where its carry is.
_LOOP_BODIES = {"scan": ("scan", 0), "while_body": ("while_loop", 0), "fori_loop": ("fori_loop", 1)}


def primals(x: Any) -> list[Any]:
    """`x`, and the values of the traces below it it carries: a JVP or
    linearize tracer's primal (what `jax.value_and_grad(..., has_aux=True)`
    hands back as the auxiliary result), and that one's, and so on."""
    chain = [x]
    while hasattr(chain[-1], "primal"):  # JVPTracer, LinearizeTracer
        chain.append(chain[-1].primal)
    return chain


# The libraries whose code calls a function it was given as a loop's body.
_LOOP_CALLERS = frozenset({"jax", "flax", "equinox"})


def caller_frame() -> Any:
    """The frame that called the function calling this one: a wrapped
    function's caller, which `called_by_a_library` reads. (CPython's
    `sys._getframe`; the only frame a front end reads.)"""
    return sys._getframe(2)


def called_by_a_library(caller: Any) -> bool:
    """Whether the frame `caller` runs JAX's (or Flax's, Equinox's) own code,
    as where a loop calls the body it traces; a user's body is user code."""
    return caller.f_globals.get("__name__", "").partition(".")[0] in _LOOP_CALLERS


def loop_body_carry(args: Sequence[Any]) -> tuple[str, Any] | None:
    """`(loop kind, carry)` if JAX is tracing a function of `args` as a loop's body.

    That is, the innermost trace is a `lax.scan`, `lax.while_loop` or
    `lax.fori_loop` body's (its debug info says which) and `args`, after
    any leading ones bound beforehand (`functools.partial(f, variables)`),
    are exactly that trace's inputs: the carry is the loop's, whose type
    the body must keep. None otherwise, or where JAX no longer says it
    (then the loop's own type check speaks).
    """
    per_arg = [jax.tree.leaves(a) for a in args]
    leaves = [x for arg in per_arg for x in arg]
    try:
        trace = jex.core.find_top_trace(leaves)
        frame = trace.frame
        kind = _LOOP_BODIES.get(frame.debug_info.traced_for)
        given = [getattr(x, "val", None) if getattr(x, "_trace", None) is trace else None
                 for x in leaves]  # fmt: skip
        invars = list(frame.invars)
    except AttributeError:
        return None
    if kind is None or not invars:
        return None
    bound = len(given) - len(invars)  # Leaves of the leading arguments bound beforehand.
    first = next((i for i in range(len(args) + 1) if sum(map(len, per_arg[:i])) == bound), None)
    if first is None or given[bound:] != invars or any(v is not None for v in given[:bound]):
        return None
    name, position = kind
    return (name, args[first + position]) if first + position < len(args) else None


_PLAIN = (bool, int, float, complex, str, type, np.dtype, enum.Enum, type(None), np.generic)


def is_plain(value: Any) -> bool:
    """A value whose text (and equality) says all it is: a number (NumPy's
    scalars too), string, type, dtype, enum or None, or a tuple of them; not a
    function, array or object."""
    if isinstance(value, tuple):
        return all(is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


_UNKNOWN = object()  # A parameter a key cannot compare.
# Parameters equal exactly when they mean the same: shardings and meshes.
_VALUES = (jax.sharding.Sharding, jax.sharding.Mesh, jax.sharding.AbstractMesh)


def _param_key(value: Any) -> Any:
    """A hashable stand-in for an equation's parameter, equal only for equal
    ones (a nested program by its `program_key`); `_UNKNOWN` if none can be."""
    if isinstance(value, tuple | frozenset):
        keys = tuple(_param_key(v) for v in value)
        return _UNKNOWN if any(k is _UNKNOWN for k in keys) else (type(value), keys)
    if is_plain(value) or isinstance(value, _VALUES):
        return (type(value), value)  # Typed: 1, 1.0 and True are equal values.
    if isinstance(value, Jaxpr | ClosedJaxpr):
        inner = getattr(value, "jaxpr", value)
        if getattr(value, "consts", ()):
            return _UNKNOWN  # Arrays: not compared.
        key = program_key(inner)
        return _UNKNOWN if key is None else key
    if type(value).__name__ == "UnspecifiedValue":  # jit's "no sharding given".
        return type(value)
    return _UNKNOWN


class _NoKey(Exception):
    pass


# Per program, held weakly: its key (None: none), made once.
_PROGRAM_KEYS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def program_key(jaxpr: Jaxpr) -> tuple | None:
    """A key equal for two programs only if they compute the same; None if
    their structure cannot tell.

    The key is the program's structure: its operations, the types of its
    variables and how they connect, its scalar literals, and its
    parameters where they are plain values; shardings, meshes and nested
    programs (by their own keys) are compared as values. It does not show a
    callback or a rule (a `custom_jvp`'s, a `custom_vjp`'s), an array
    literal's values or an equation's context (`compute_on`, XLA metadata;
    interned, so compared by identity): a program with any of the first
    three has no key, the contexts are part of it.
    """
    if jaxpr not in _PROGRAM_KEYS:
        try:
            key: tuple | None = _structure(jaxpr)
            hash(key)
        except (_NoKey, TypeError):  # TypeError: a type or parameter that does not hash.
            key = None
        _PROGRAM_KEYS[jaxpr] = key
    return _PROGRAM_KEYS[jaxpr]


def _type_key(aval: Any) -> tuple:
    """What a variable's type says to the program: not the mesh an Auto
    sharding happens to name (a value out of a sharding constraint has one)."""
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    fields = ("shape", "dtype", "weak_type", "vma", "manual_axis_type", "memory_space")
    return (type(aval), spec, *(getattr(aval, f, None) for f in fields))


def _structure(jaxpr: Jaxpr) -> tuple:
    numbers: dict = {}  # Variables by the order they are made in.

    def defined(v: Any) -> Any:
        if isinstance(v, DropVar):
            return ("dropped", _type_key(v.aval))
        numbers[v] = len(numbers)
        return _type_key(v.aval)

    def used(v: Any) -> Any:
        if isinstance(v, Literal):
            if np.ndim(v.val):
                raise _NoKey  # An array's values.
            return ("literal", _type_key(v.aval), repr(np.asarray(v.val).item()))
        return numbers[v]

    signature = tuple(defined(v) for v in (*jaxpr.constvars, *jaxpr.invars))
    eqns = []
    for eqn in jaxpr.eqns:
        params = tuple((name, _param_key(value)) for name, value in eqn.params.items())
        if any(k is _UNKNOWN for _, k in params):
            raise _NoKey  # A callback, a rule, something unknown.
        ins = tuple(used(v) for v in eqn.invars)
        outs = tuple(defined(v) for v in eqn.outvars)
        eqns.append((eqn.primitive, ins, outs, params, eqn.ctx))
    return (len(jaxpr.constvars), signature, tuple(eqns), tuple(used(v) for v in jaxpr.outvars))


def stand_in(aval: Any, dtype: Any, weak_type: bool | None = None) -> jax.ShapeDtypeStruct:
    """A tracing stand-in of `aval` in `dtype`: its shape, weak type (unless
    given), and its sharding where its type holds one (explicit mesh axes)."""
    sharding = getattr(aval, "sharding", None)
    explicit = sharding is not None and jax.sharding.AxisType.Explicit in sharding.mesh.axis_types
    return jax.ShapeDtypeStruct(
        aval.shape,
        dtype,
        weak_type=aval.weak_type if weak_type is None else weak_type,
        sharding=sharding if explicit else None,
    )


def shaped(var: Any) -> jax.core.ShapedArray:
    """The abstract value (shape, dtype, weak type) of a jaxpr variable or literal."""
    aval = var.aval
    if not isinstance(aval, jax.core.ShapedArray):  # A token or an opaque value.
        raise TypeError(f"expected an array variable, got {aval!r}")
    return aval


def remat_body(eqn: JaxprEqn) -> Jaxpr:
    """The program a `remat` (`jax.checkpoint`) equation runs."""
    return param(eqn, "jaxpr")


def context_mesh_size() -> int | None:
    """The number of devices of the mesh the code being traced is under: the
    abstract mesh (`jax.set_mesh`, a `shard_map` body), else the mesh of a
    `with mesh:` block (deprecated, still used: EasyDeL's models), read from
    `jax.interpreters.pxla.thread_resources`; None outside any mesh."""
    abstract = jax.sharding.get_abstract_mesh()
    if not abstract.empty:
        return abstract.size
    from jax.interpreters import pxla

    with warnings.catch_warnings():  # Deprecated with `with mesh:`, which is still in use.
        warnings.simplefilter("ignore", DeprecationWarning)
        resources = getattr(pxla, "thread_resources", None)
    mesh = getattr(getattr(resources, "env", None), "physical_mesh", None)
    if mesh is None:
        raise JaxChanged("jax.interpreters.pxla.thread_resources.env.physical_mesh")
    return None if mesh.empty else mesh.size


def name_stack(eqn: JaxprEqn) -> str:
    """The equation's name stack, e.g. the Flax module path that emitted it."""
    return str(eqn.source_info.name_stack)


def current_name_stack() -> str:
    """The name stack of the code being traced now (relative to the innermost trace)."""
    return str(jex.source_info_util.current_name_stack())


# A `jax.named_scope` whose name carries fields ("tag[k=v;...]") to every
# equation traced inside it, read back from their name stacks: JAX keeps no
# other per-equation record across `jit`, `remat` and lifted transforms. A
# user's own scope of the same name would be read as one (the tags are
# prefixed `jmp_policy_`).


def marked_scope(tag: str, **fields: str) -> contextlib.AbstractContextManager:
    """A named scope marking the equations traced inside it with `tag` and `fields`."""
    inner = ";".join(f"{k}={v}" for k, v in fields.items())
    return jax.named_scope(f"{tag}[{inner}]" if fields else tag)


@functools.cache
def _mark_pattern(tag: str) -> re.Pattern:
    return re.compile(re.escape(tag) + r"(?:\[([\w=;]*)\])?(?![\w\[])")


def marks_in(stack: str, tag: str) -> tuple[dict[str, str], ...]:
    """The fields of each `marked_scope(tag, ...)` in the name stack `stack`, outermost first."""
    if tag not in stack:
        return ()
    return tuple(
        dict(field.split("=", 1) for field in inner.split(";") if field)
        for inner in _mark_pattern(tag).findall(stack)
    )


def scan_result_parts(out: Any) -> tuple[Any, Any] | None:
    """`(carry, ys)` of a scan body's result, as `lax.scan` requires it; None
    where it is not a pair (JAX's own check then says what is wrong)."""
    return tuple(out) if type(out) in (tuple, list) and len(out) == 2 else None


def _read(env: dict[Any, Any], v: Any) -> Any:
    if isinstance(v, jex.core.Literal):
        val, dtype = v.val, shaped(v).dtype
        same = hasattr(val, "dtype") and val.dtype == dtype
        return val if same else np.asarray(val, dtype)
    return env[v]


def live_equations(jaxpr: Jaxpr) -> list[JaxprEqn]:
    """The equations of `jaxpr` that its results need, or that have effects, in order."""
    needed = {v for v in jaxpr.outvars if not isinstance(v, jex.core.Literal)}
    live = []
    for eqn in reversed(jaxpr.eqns):
        if eqn.effects or any(v in needed for v in eqn.outvars):
            live.append(eqn)
            needed.update(v for v in eqn.invars if not isinstance(v, jex.core.Literal))
    return live[::-1]


def eval_jaxpr(
    jaxpr: Jaxpr,
    consts: Sequence[Any],
    args: Sequence[Any],
    apply: Callable[[JaxprEqn, list[Any]], Any],
) -> list[Any]:
    """Runs `jaxpr` equation by equation, each through `apply(eqn, input values)`.

    `apply` returns the equation's output (a list for primitives with multiple
    results). The equation's name stack (Flax module paths) and context
    managers are kept, so the rewritten program reads like the original.
    Equations no result needs and without effects are skipped, as XLA would
    drop them (a model built inside `apply` draws parameters it then replaces).
    """
    env: dict = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    su = jex.source_info_util
    for eqn in live_equations(jaxpr):
        invals = [_read(env, v) for v in eqn.invars]
        stack = su.current_name_stack() + eqn.source_info.name_stack
        with su.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
            outs = apply(eqn, invals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jex.core.DropVar):
                env[v] = out
    return [_read(env, v) for v in jaxpr.outvars]


def origin(eqn: JaxprEqn) -> str:
    """Where an equation comes from, as JAX prints it: "file:line:column (function)"."""
    return str(jex.source_info_util.summarize(eqn.source_info))
