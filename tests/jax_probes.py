"""Probes of the JAX internals `jax_internals` reads: one each, run by `test_jax_internals.py`.

Each builds a small program with the installed JAX and reads it through
`jax_internals`; it raises `JaxChanged`, naming that JAX, where the internal
is not what jmp_policy was checked against (`CHECKED_AGAINST`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.jax_internals import CHECKED_AGAINST, JaxChanged

# The probes by name: each raises `JaxChanged` if the installed JAX changed what it checks.
PROBES: dict[str, Callable[[], None]] = {}


def _probe(name: str) -> Callable[[Callable[[], None]], Callable[[], None]]:
    def register(check: Callable[[], None]) -> Callable[[], None]:
        PROBES[name] = check
        return check

    return register


def _expect(condition: bool, what: str) -> None:
    if not condition:
        raise JaxChanged(what)


def _eqns(fn: Callable, *args: Any) -> list[ji.JaxprEqn]:
    return list(jax.make_jaxpr(fn)(*args).jaxpr.eqns)


def _only(eqns: list[ji.JaxprEqn], primitive: ji.Primitive | str) -> ji.JaxprEqn:
    found = [e for e in eqns if primitive in (e.primitive, e.primitive.name)]
    name = primitive if isinstance(primitive, str) else primitive.name
    _expect(len(found) == 1, f"one {name} equation where {CHECKED_AGAINST} trace one")
    return found[0]


_X = np.ones((2, 2), np.float32)


@_probe("dot_general parameters")
def _check_dot_params() -> None:
    dims = (((1,), (0,)), ((), ()))
    eqn = _only(
        _eqns(lambda a: lax.dot_general(a, a, dims, None, jnp.float32), _X), ji.dot_general_p
    )
    p = ji.dot_params(eqn)
    try:
        as_tuples = tuple(tuple(map(tuple, d)) for d in p.dimension_numbers)
    except TypeError:
        as_tuples = None
    _expect(as_tuples == dims, "dot_general's dimension_numbers as ((lc, rc), (lb, rb))")
    _expect(np.dtype(p.preferred_element_type) == np.float32, "dot_general's result type")


@_probe("conv_general_dilated parameters")
def _check_conv_params() -> None:
    x = np.ones((1, 1, 4), np.float32)
    eqn = _only(
        _eqns(lambda a: lax.conv_general_dilated(a, a, (1,), "SAME"), x), ji.conv_general_dilated_p
    )
    _expect(len(ji.conv_dimension_numbers(eqn)) == 3, "conv's (lhs, rhs, out) dimension numbers")
    ji.product_precision(eqn)
    ji.bind(eqn, [x, x], ji.with_result_type(eqn, np.dtype(np.float32)))


@_probe("ragged_dot_general: a product by name, with a result type")
def _check_ragged_dot() -> None:
    lhs, rhs = np.ones((4, 3), np.float32), np.ones((2, 3, 5), np.float32)
    sizes = np.array([1, 3], np.int32)
    eqn = _only(_eqns(lambda a, b: lax.ragged_dot(a, b, sizes), lhs, rhs), "ragged_dot_general")
    _expect(eqn.primitive.name in ji.PRODUCT_NAMES, "ragged_dot_general's name")
    _expect(len(eqn.invars) == 3, "ragged_dot_general's operands (lhs, rhs, group sizes)")
    out = ji.bind(eqn, [lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16), sizes],
                  ji.with_result_type(eqn, np.dtype(np.float32)))  # fmt: skip
    _expect(out.dtype == np.float32 and out.shape == (4, 5), "ragged_dot_general's result type")


@_probe("the mesh code is traced under, a `with mesh:` block's too")
def _check_context_mesh_size() -> None:
    import warnings

    _expect(ji.context_mesh_size() is None, "no mesh outside a mesh context")
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("a", "b"))
    with jax.set_mesh(one):
        _expect(ji.context_mesh_size() == 1, "jax.set_mesh's mesh")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        with one:
            _expect(ji.context_mesh_size() == 1, "a `with mesh:` block's mesh")


@_probe("convert_element_type parameters")
def _check_new_dtype() -> None:
    eqn = _only(_eqns(lambda a: a.astype(jnp.bfloat16), _X), ji.convert_element_type_p)
    _expect(ji.new_dtype(eqn) == jnp.bfloat16, "convert_element_type's new_dtype")


@_probe("nested programs: jit and closed_call")
def _check_call_program() -> None:
    eqn = _only(_eqns(lambda a: jax.jit(jnp.sin)(a), _X), "jit")
    _expect(eqn.primitive in ji.CALL_JAXPR_PARAM, "jax.jit as the jit_p primitive")
    _, program = ji.call_program(eqn)
    _expect(isinstance(program, ji.ClosedJaxpr), "a jit equation's program as a ClosedJaxpr")


@_probe("nested programs: scan, while_loop, cond")
def _check_control_flow() -> None:
    def f(a):
        a = lax.scan(lambda c, _: (c * 2, None), a, length=2)[0]
        a = lax.while_loop(lambda c: c[0, 0] < 4, lambda c: c * 2, a)
        return lax.cond(a[0, 0] > 0, jnp.sin, jnp.cos, a)

    eqns = _eqns(f, _X)
    for primitive in ji.CONTROL_FLOW_JAXPR_PARAMS:
        programs = ji.control_flow_programs(_only(eqns, primitive))
        for value in programs.values():
            for v in value if isinstance(value, tuple) else (value,):
                _expect(isinstance(v, ji.ClosedJaxpr), f"{primitive.name}'s programs")


@_probe("jax.checkpoint")
def _check_remat() -> None:
    eqn = _only(_eqns(jax.checkpoint(jnp.sin), _X), ji.remat_p)
    _expect(isinstance(ji.remat_body(eqn), ji.Jaxpr), "a remat equation's program as a Jaxpr")
    jax.checkpoint(jnp.sin, **ji.remat_options(eqn))(_X)


@_probe("custom_jvp")
def _check_custom_jvp() -> None:
    eqn = _only(_eqns(jax.nn.relu, _X), ji.custom_jvp_call_p)
    _expect(isinstance(ji.custom_jvp_primal(eqn), ji.ClosedJaxpr), "a custom_jvp's primal program")


@_probe("shard_map")
def _check_shard_map() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    spec = jax.sharding.PartitionSpec("d")
    f = jax.shard_map(jnp.sin, mesh=mesh, in_specs=spec, out_specs=spec)
    eqn = _only(_eqns(f, _X), ji.SHARD_MAP_NAME)
    _expect(isinstance(ji.shard_map_body(eqn), ji.Jaxpr), "a shard_map's per-device program")
    # The specs are stored flat: the body takes and returns the flat values.
    jax.shard_map(lambda *a: tuple(map(jnp.sin, a)), **ji.shard_map_options(eqn))(_X)


@_probe("shard_map: the axes a value varies over")
def _check_varying_axes() -> None:
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("d",))
    P = jax.sharding.PartitionSpec

    def body(x, w):
        axes = (ji.varying_axes(jax.typeof(x)), ji.varying_axes(jax.typeof(w)))
        _expect(axes == ({"d"}, set()), "a sharded value varying over its axis, a replicated not")
        marked = ji.varying_alike(x, w)[1]
        _expect(ji.varying_axes(jax.typeof(marked)) == {"d"}, "a value marked varying")
        return x

    f = jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    jax.make_jaxpr(f)(_X, _X)


@_probe("inlined jit")
def _check_inlined_jit() -> None:
    eqns = _eqns(lambda a: ji.inlined_jit(jnp.sin)(a), _X)
    _expect([e.primitive.name for e in eqns] == ["sin"], "jax.jit inlined into the caller")


@_probe("jnp.einsum's _dot_general")
def _check_einsum() -> None:
    calls = []

    def dot_general(*args, **kwargs):
        calls.append(1)
        return lax.dot_general(*args, **kwargs)

    ji.einsum_with_dot_general(dot_general)("ij,jk->ik", _X, _X)
    _expect(bool(calls), "jnp.einsum's _dot_general= argument, called for its products")


def _expect_error(
    run: Callable[[], Any], recognised: Callable[[Exception], bool], what: str
) -> None:
    """`run()` must raise an error that `recognised` tells for JAX's own."""
    try:
        run()
    except Exception as e:
        _expect(recognised(e), f"the text or type of {e!r}")
    else:
        raise JaxChanged(f"an error for {what}")


@_probe("the forward-mode error of a custom_vjp")
def _check_forward_mode_error() -> None:
    f = jax.custom_vjp(jnp.sin)
    f.defvjp(lambda x: (jnp.sin(x), x), lambda x, g: (g * jnp.cos(x),))
    _expect_error(
        lambda: jax.jvp(f, (_X,), (_X,)),
        lambda e: isinstance(e, TypeError) and ji.is_forward_mode_of_custom_vjp(e),
        "jax.jvp of a custom_vjp",
    )


@_probe("the loop-carry type error")
def _check_carry_error() -> None:
    _expect_error(
        lambda: lax.scan(lambda c, _: (c.astype(jnp.bfloat16), None), _X, length=1),
        ji.is_loop_carry_type_change,
        "a scan body changing its carry's dtype",
    )


@_probe("the dtype-mismatch errors")
def _check_dtype_mismatch_errors() -> None:
    buffer, update = np.zeros((2, 2), np.float32), np.ones((1, 2), jnp.bfloat16)

    def strict_add():
        with jax.numpy_dtype_promotion("strict"):
            return jnp.add(buffer, jnp.asarray(update))

    for run in (lambda: lax.dynamic_update_slice(buffer, update, (0, 0)), strict_add):
        _expect_error(run, ji.is_dtype_mismatch, "operands of float32 and bfloat16")


@_probe("dead equations: effects mark what must stay")
def _check_live_equations() -> None:
    def f(a: Any) -> Any:
        jnp.sin(a)  # Needed by nothing, no effect: dropped.
        jax.debug.print("{}", a)  # An effect: kept.
        return a * 2.0

    closed = jax.make_jaxpr(f)(_X)
    kept = [e.primitive.name for e in ji.live_equations(closed.jaxpr)]
    _expect(kept == ["debug_print", "mul"], "equations' effects (a debug print's)")


@_probe("eval_jaxpr: name stacks, contexts, literals, bind parameters")
def _check_eval_jaxpr() -> None:
    @jax.named_scope("probe")
    def f(a):
        return jnp.sin(a) * 2.0, jnp.argmax(a)

    closed = jax.make_jaxpr(f)(_X)
    _expect(all(ji.name_stack(e) == "probe" for e in closed.jaxpr.eqns), "equation name stacks")
    got = ji.eval_jaxpr(closed.jaxpr, closed.consts, [_X], ji.bind)
    _expect(all(np.array_equal(a, b) for a, b in zip(got, f(_X))), "eval_jaxpr's results")


@_probe("custom_vjp_call: its primal program and its backward rule")
def _check_custom_vjp() -> None:
    @jax.custom_vjp
    def f(a):
        return jnp.sin(a)

    def bwd(a: Any, g: Any) -> tuple[Any]:
        return (g * jnp.cos(a),)

    f.defvjp(lambda a: (jnp.sin(a), a), bwd)
    eqn = _only(_eqns(f, _X), ji.custom_vjp_call_p)
    primal = ji.custom_vjp_primal(eqn)
    got = ji.eval_jaxpr(primal.jaxpr, primal.consts, [_X], ji.bind)
    _expect(np.allclose(got[0], np.sin(_X)), "the primal program of a custom_vjp")
    _expect(ji.custom_vjp_bwd(eqn) is bwd, "the backward rule of a custom_vjp")


@_probe("writes of another float dtype: their errors")
def _check_writes() -> None:
    buffer, update = np.zeros((2, 2), jnp.bfloat16), np.ones((1, 2), np.float32)
    index = np.zeros((1, 1), np.int32)
    scatter_dims = lax.ScatterDimensionNumbers((1,), (0,), (0,))

    def write(b: Any, u: Any) -> Any:
        return lax.dynamic_update_slice(b, u, (0, 0))

    def scatter(b: Any, u: Any) -> Any:
        return lax.scatter(b, index, u, scatter_dims)

    for fn in (write, scatter):
        _expect_error(
            functools.partial(jax.make_jaxpr(fn), buffer, update),
            ji.is_write_dtype_mismatch,
            f"{fn.__name__}: a float32 value into a bfloat16 buffer",
        )
        written = _eqns(fn, buffer.astype(np.float32), update)[-1]
        _expect(written.primitive in ji.WRITTEN_OPERAND, f"{fn.__name__}'s primitive")


@_probe("loops, branches and calls: their programs, and a loop body's trace")
def _check_nested_programs() -> None:
    seen = []

    def body(c: Any, x: Any) -> Any:
        seen.append((ji.loop_body_carry((c, x)), ji.loop_body_carry((x, c))))
        return c * x, x

    eqn = _only(_eqns(lambda c, xs: lax.scan(body, c, xs), _X[0], _X), "scan")
    as_body, swapped = seen[0]
    _expect(
        as_body is not None and as_body[0] == "scan" and swapped is None,
        "a scan body's trace, said by its debug info",
    )
    parts = ji.loop_parts(eqn)
    _expect(
        parts is not None and (len(parts.consts), len(parts.carry), len(parts.xs)) == (0, 1, 1),
        "a scan's constants, carry and scanned inputs",
    )

    # A transposed scan (the backward pass of one) keeps its parts as JAX 0.12's
    # nested flat tree: consts, carries and scanned inputs all the same.
    def scanned(x):
        return lax.scan(lambda c, _: (jnp.sin(c) @ x, None), x, None, length=2)[0].sum()

    transposed = [e for e in jax.make_jaxpr(jax.grad(scanned))(_X).jaxpr.eqns
                  if e.primitive.name == "scan"][-1]  # fmt: skip
    parts = ji.loop_parts(transposed)
    _expect(
        parts is not None
        and len(parts.consts) + len(parts.carry) + len(parts.xs) == len(transposed.invars)
        and len(parts.carry) >= 1,
        "a transposed scan's constants, carry and scanned inputs",
    )
    loop = lambda c: lax.while_loop(lambda c: c[0, 0] < 1, lambda c: c + 1, c)  # noqa: E731
    eqn = _only(_eqns(loop, _X), "while")
    parts = ji.loop_parts(eqn)
    _expect(parts is not None and len(parts.carry) == 1, "a while loop's carry")
    eqn = _only(_eqns(lambda p, x: lax.cond(p, lambda: x, lambda: -x), True, _X), "cond")
    _expect(len(ji.branches(eqn) or []) == 2, "a cond's branches")
    jit_p = next(iter(ji.CALL_JAXPR_PARAM))
    eqn = _only(_eqns(jax.jit(lambda x: x * 2), _X), jit_p)
    _expect(ji.inlined_body(eqn) is not None, "a jit's program")


@_probe("where an equation comes from")
def _check_origin() -> None:
    # Compiled here: JAX names no frame of jmp_policy's own files.
    user_code = eval("lambda x: jnp.sin(x)", {"jnp": jnp})
    (eqn,) = _eqns(user_code, _X)
    _expect(ji.origin(eqn) == "<string>:1:10 (<lambda>)", "an equation's file, line and function")
