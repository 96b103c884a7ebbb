"""The one place jmp_policy reads JAX's traced programs: jaxprs and their equations.

`autocast`, the backward pass of the float32-accumulating matmuls and
`diagnose` walk jaxprs. `jax.extend` promises no compatibility across JAX
releases, and the equation attributes used here (`eqn.params` keys such as
`"jaxpr"`, `"call_jaxpr"`, `"branches"`, `"prevent_cse"`, `eqn.ctx`,
`Primitive.get_bind_params`) are not documented API. Everything of that kind
is in this module, so that a JAX upgrade breaks here first and is fixed here
once. Checked against jax and jaxlib 0.10.2.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import jax.extend as jex
import numpy as np

Jaxpr = jex.core.Jaxpr
ClosedJaxpr = jex.core.ClosedJaxpr
JaxprEqn = jex.core.JaxprEqn
Primitive = jex.core.Primitive
primitives = jex.core.primitives

# Equations whose parameters hold a program run as if inlined: which parameter.
CALL_JAXPR_PARAM: dict[Primitive, str] = {
    primitives.jit_p: "jaxpr",
    primitives.closed_call_p: "call_jaxpr",
}
# Control flow: the parameters holding programs whose input and output types are
# fixed by the loop carry or the branch signature.
CONTROL_FLOW_JAXPR_PARAMS: dict[Primitive, tuple[str, ...]] = {
    primitives.scan_p: ("jaxpr",),
    primitives.while_p: ("cond_jaxpr", "body_jaxpr"),
    primitives.cond_p: ("branches",),
}
# `shard_map` (also what `jax.pmap` lowers to since JAX 0.8) is not in
# `jax.extend.core.primitives`: it is matched by name.
SHARD_MAP_NAME = "shard_map"
remat_p: Primitive = primitives.remat_p
custom_jvp_call_p: Primitive = primitives.custom_jvp_call_p
convert_element_type_p: Primitive = primitives.convert_element_type_p
dot_general_p: Primitive = primitives.dot_general_p
conv_general_dilated_p: Primitive = primitives.conv_general_dilated_p


def primitive_names() -> frozenset[str]:
    """The names of the primitives `jax.extend` exposes (for validating user lists)."""
    return frozenset(p.name for p in vars(primitives).values() if isinstance(p, Primitive))


def bind(eqn: JaxprEqn, args: Sequence[Any], params: dict[str, Any] | None = None) -> Any:
    """Runs the equation's primitive on `args`, with its own or replaced `params`."""
    params = eqn.params if params is None else params
    return eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(params))


def remat_options(eqn: JaxprEqn) -> dict[str, Any]:
    """The `jax.checkpoint` arguments that made a `remat` equation."""
    return {"prevent_cse": eqn.params["prevent_cse"], "policy": eqn.params["policy"]}


def is_shard_map(eqn: JaxprEqn) -> bool:
    """Whether the equation is a `shard_map` (or a `jax.pmap`, which is one)."""
    return eqn.primitive.name == SHARD_MAP_NAME


def shard_map_body(eqn: JaxprEqn) -> Jaxpr:
    """The per-device program of a `shard_map` equation (no constants)."""
    return eqn.params["jaxpr"]


def shard_map_options(eqn: JaxprEqn) -> dict[str, Any]:
    """The `jax.shard_map` arguments that made a `shard_map` equation."""
    params = eqn.params
    return {
        "mesh": params["mesh"],
        "in_specs": tuple(params["in_specs"]),
        "out_specs": tuple(params["out_specs"]),
        "axis_names": frozenset(params["newly_manual_axes"]),
        "check_vma": params["check_vma"],
    }


def custom_jvp_primal(eqn: JaxprEqn) -> ClosedJaxpr:
    """The primal program of a `custom_jvp_call` equation."""
    return eqn.params["call_jaxpr"]


def sub_jaxprs(eqn: JaxprEqn) -> Iterator[Jaxpr]:
    """Every program nested in the equation's parameters."""
    for value in eqn.params.values():
        for v in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(v, ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, Jaxpr):
                yield v


_PLAIN = (bool, int, float, complex, str, type, np.dtype, enum.Enum, type(None))


def is_plain(value: Any) -> bool:
    """A value whose text (and equality) says all it is: a number, string, type,
    dtype, enum or None, or a tuple of them; not a function, array or object."""
    if isinstance(value, tuple):
        return all(is_plain(v) for v in value)
    return isinstance(value, _PLAIN)


def program_key(jaxpr: Jaxpr) -> tuple | None:
    """A key equal for two programs only if they compute the same; None if
    their text cannot tell.

    The text of a program names its operations, types and literals, and its
    parameters where they are plain values. It does not show a nested
    program's rules, a callback, an array literal's values or an equation's
    context (`compute_on`, XLA metadata; interned, so compared by identity):
    a program with any of the first three has no key, the contexts are part
    of it.
    """
    for eqn in jaxpr.eqns:
        if not all(is_plain(v) for v in eqn.params.values()):
            return None  # A nested program, a callback, a sharding.
        if any(isinstance(v, jex.core.Literal) and np.ndim(v.val) for v in eqn.invars):
            return None
    return (str(jaxpr), tuple(eqn.ctx for eqn in jaxpr.eqns))


def shaped(var: Any) -> jax.core.ShapedArray:
    """The abstract value (shape, dtype, weak type) of a jaxpr variable or literal."""
    aval = var.aval
    if not isinstance(aval, jax.core.ShapedArray):  # A token or an opaque value.
        raise TypeError(f"expected an array variable, got {aval!r}")
    return aval


def remat_body(eqn: JaxprEqn) -> Jaxpr:
    """The program a `remat` (`jax.checkpoint`) equation runs."""
    return eqn.params["jaxpr"]


def name_stack(eqn: JaxprEqn) -> str:
    """The equation's name stack, e.g. the Flax module path that emitted it."""
    return str(eqn.source_info.name_stack)


def current_name_stack() -> str:
    """The name stack of the code being traced now (relative to the innermost trace)."""
    return str(jex.source_info_util.current_name_stack())


def _read(env: dict[Any, Any], v: Any) -> Any:
    if isinstance(v, jex.core.Literal):
        val, dtype = v.val, shaped(v).dtype
        same = hasattr(val, "dtype") and val.dtype == dtype
        return val if same else np.asarray(val, dtype)
    return env[v]


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
    """
    env: dict = {}
    env.update(zip(jaxpr.constvars, consts))
    env.update(zip(jaxpr.invars, args))
    su = jex.source_info_util
    for eqn in jaxpr.eqns:
        invals = [_read(env, v) for v in eqn.invars]
        stack = su.current_name_stack() + eqn.source_info.name_stack
        with su.user_context(eqn.source_info.traceback, name_stack=stack), eqn.ctx.manager:
            outs = apply(eqn, invals)
        outs = outs if eqn.primitive.multiple_results else [outs]
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, jex.core.DropVar):
                env[v] = out
    return [_read(env, v) for v in jaxpr.outvars]
