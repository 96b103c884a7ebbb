"""Every JAX internal jmp_policy reads, checked against the installed JAX.

`jmp_policy/core/jax_internals.py` is the one module that touches what JAX does
not promise to keep; each internal there has a probe (`jax_probes.py`, beside
this file). A JAX release that changes one fails here, with a message naming that JAX, before any feature
gives a wrong result.
"""

from __future__ import annotations

import ast
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy.core import jax_internals as ji

from jax_probes import PROBES

PACKAGE = pathlib.Path(ji.__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(PROBES))
def test_the_installed_jax_has_what_jmp_policy_reads(name):
    PROBES[name]()


def test_every_internal_has_a_probe():
    expected = {
        "dot_general parameters",
        "conv_general_dilated parameters",
        "ragged_dot_general: a product by name, with a result type",
        "the mesh code is traced under, a `with mesh:` block's too",
        "convert_element_type parameters",
        "nested programs: jit and closed_call",
        "nested programs: scan, while_loop, cond",
        "jax.checkpoint",
        "custom_jvp",
        "shard_map",
        "shard_map: the axes a value varies over",
        "inlined jit",
        "jnp.einsum's _dot_general",
        "the forward-mode error of a custom_vjp",
        "custom_vjp_call: its primal program and its backward rule",
        "the loop-carry type error",
        "the dtype-mismatch errors",
        "writes of another float dtype: their errors",
        "loops, branches and calls: their programs, and a loop body's trace",
        "where an equation comes from",
        "eval_jaxpr: name stacks, contexts, literals, bind parameters",
        "dead equations: effects mark what must stay",
    }
    assert set(PROBES) == expected


def test_a_missing_parameter_is_a_clear_error_naming_the_jax_version():
    eqn = jax.make_jaxpr(jnp.sin)(1.0).jaxpr.eqns[0]
    with pytest.raises(ji.JaxChanged, match=f"jax {jax.__version__}") as info:
        ji.param(eqn, "dimension_numbers")
    assert "'dimension_numbers' of sin equations" in str(info.value)
    assert isinstance(info.value, RuntimeError)


def test_a_probe_fails_with_jax_changed_when_jax_changes(monkeypatch):
    # As if a JAX release renamed dot_general's dimension_numbers.
    real = ji.dot_params
    monkeypatch.setattr(
        ji, "dot_params", lambda eqn: real(eqn)._replace(dimension_numbers=((0,), (0,)))
    )
    with pytest.raises(ji.JaxChanged, match="dimension_numbers"):
        PROBES["dot_general parameters"]()


def test_inlined_jit_leaves_no_call_and_is_traced_once():
    traces = []

    def f(x):
        traces.append(1)
        return jnp.sin(x) * 2

    g = ji.inlined_jit(f)
    x = np.ones(3, np.float32)
    eqns = jax.make_jaxpr(lambda x: g(x) + g(x))(x).jaxpr.eqns
    assert [e.primitive.name for e in eqns] == ["sin", "mul", "sin", "mul", "add"]
    assert len(traces) == 1


def _reads_outside_the_seam(path: pathlib.Path) -> list[str]:
    """Reads of an equation's `params` or name stack, of frames, and `_dot_general=`
    calls in `path` (private imports of JAX: tests/test_packaging.py)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Attribute) and node.attr == "params":
            if isinstance(node.value, ast.Name) and node.value.id == "eqn":
                found.append(f"{path.name}:{node.lineno}: eqn.params")
        if isinstance(node, ast.keyword) and node.arg == "_dot_general":
            found.append(f"{path.name}:{node.lineno}: _dot_general=")
        if isinstance(node, ast.Attribute) and node.attr in ("name_stack", "_getframe"):
            if not (isinstance(node.value, ast.Name) and node.value.id == "ji"):
                found.append(f"{path.name}:{node.lineno}: {node.attr}")
    return found


def test_no_module_but_the_seam_reads_jax_internals():
    modules = [p for p in PACKAGE.rglob("*.py") if p.name != "jax_internals.py"]
    assert len(modules) > 20
    assert [r for p in modules for r in _reads_outside_the_seam(p)] == []
    assert _reads_outside_the_seam(PACKAGE / "core" / "jax_internals.py") != []


def test_caller_frame_is_the_wrapped_functions_caller():
    # What the front ends read to tell a loop's body (called from JAX's own
    # code) from a function a user's code calls.
    seen = []

    def wrapped(carry, _):
        frame = ji.caller_frame()
        seen.append((frame.f_code.co_name, ji.called_by_a_library(frame)))
        return carry, None

    wrapped(0.0, None)
    jax.lax.scan(wrapped, 0.0, jnp.zeros(2))  # the body: called from JAX's code
    jax.lax.scan(lambda c, x: wrapped(c, x), 0.0, jnp.zeros(2))  # called by user code
    assert seen[0] == ("test_caller_frame_is_the_wrapped_functions_caller", False)
    assert seen[1][1] is True and seen[2] == ("<lambda>", False), seen


def test_a_marked_scope_reaches_every_equation_traced_inside_it():
    # How a module's policy reaches its products: the marks are read back
    # from the name stacks of the equations, inside jit too; a nested
    # program (remat, scan) is traced with a name stack of its own, which
    # the interpreter prefixes with the outer one.
    tag = "jmp_policy_probe"

    def f(x):
        with ji.marked_scope(tag, c="bfloat16", m="none"):
            y = jax.jit(jnp.sin)(x)
            y = jax.checkpoint(jnp.cos)(y)
        return y * 2

    eqns = jax.make_jaxpr(f)(1.0).jaxpr.eqns
    marks = [ji.marks_in(ji.name_stack(e), tag) for e in eqns]
    assert marks == [({"c": "bfloat16", "m": "none"},)] * 2 + [()], marks
    with ji.marked_scope(tag):
        assert ji.marks_in(ji.current_name_stack(), tag) == ({},)
    assert ji.marks_in(f"{tag}_other/{tag}x", tag) == ()
    assert ji.scan_result_parts((1, 2)) == (1, 2) and ji.scan_result_parts((1, 2, 3)) is None
