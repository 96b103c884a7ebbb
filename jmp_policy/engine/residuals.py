"""What the FP8 and FP4 products save for their backward pass.

A low-precision product needs its operands again in the backward pass, each
quantized along the axes that backward product contracts. Saving those
quantized copies (1 byte an element, and their scales) instead of the
operands themselves (2 bytes in bfloat16) is where FP8 training saves
activation memory, as NVIDIA's Transformer Engine and torchao do.

A quantized copy cannot carry a tangent, though: JAX carries the tangent of
an FP8 array in FP8, where it overflows or flushes to zero. Forward-over-
reverse differentiation (`jax.hessian`, `jax.jvp` of `jax.grad`:
Hessian-vector products) differentiates the saved values, so there the
operands are saved as they are, and quantized again in the backward pass
with tangents in their own dtype (see `fp8`).

Which form a product takes is decided where it is traced, from what the
program says: `differentiation_depth` counts the derivatives its operands
are traced under (a `jax.custom_jvp` whose rule runs once per level). Under
two or more, the operands are saved. Where JAX traces the product before the
outer derivative is applied (inside `jax.jit`, `jax.checkpoint` or a scan that
an outer `jax.jvp` differentiates later), the depth cannot be seen: the
quantized copies are saved, and differentiating them raises a `TypeError`
saying how to save the operands instead (`fp8_residuals("operands")`), never
a silently wrong derivative.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from typing import Any

import jax

RESIDUALS = ("quantized", "operands")
_RESIDUALS: contextvars.ContextVar[str] = contextvars.ContextVar("residuals", default="quantized")
# The depth of the values a program being traced will run on (`traced_for`).
_DEPTH_TRACED_FOR: contextvars.ContextVar[int] = contextvars.ContextVar("depth", default=0)


def check_residuals(residuals: Any, name: str = "residuals") -> str:
    """`residuals` if it is one of `RESIDUALS`; a `ValueError` naming `name` otherwise."""
    if not (isinstance(residuals, str) and residuals in RESIDUALS):
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, RESIDUALS))} (what FP8 and FP4 "
            "products save for the backward pass: the quantized copies, or the operands "
            f"themselves, which second-order differentiation needs), got {residuals!r}."
        )
    return residuals


@contextlib.contextmanager
def fp8_residuals(residuals: str) -> Iterator[None]:
    """Sets what the FP8 and FP4 products traced inside save for the backward pass.

    `"quantized"` (the default) saves the FP8 or FP4 copies of the operands
    the backward products use, and their scales: about half the activation
    memory of saving bfloat16 operands. A product traced under second-order
    differentiation (`jax.hessian`, `jax.jvp` of `jax.grad`, where that is
    seen as the product is traced) saves its operands anyway.
    `"operands"` saves the operands themselves (in the compute dtype),
    quantizing them again in the backward pass: what Hessian-vector products
    need where the product is traced before the outer derivative is taken
    (a jitted or checkpointed function, a scan, differentiated by an outer
    `jax.jvp`), which otherwise raises a `TypeError` that points here.

    The setting is read while JAX traces: a function jitted inside the block
    keeps the form it was traced with.

    Args:
      residuals: `"quantized"` or `"operands"`.

    Raises:
      ValueError: if `residuals` is neither.

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> x, w = jnp.ones((4, 8)), jnp.ones((8, 2))
    >>> def loss(w):
    ...     return jnp.sum(jnp.tanh(jmp.fp8_dot_general(x, w, (((1,), (0,)), ((), ())))))
    >>> grad = jax.jit(jax.grad(loss))  # traced before the jax.jvp around it is seen
    >>> with jmp.fp8_residuals("operands"):
    ...     print(jax.jvp(grad, (w,), (w,))[1].shape)
    (8, 2)
    """
    token = _RESIDUALS.set(check_residuals(residuals))
    try:
        yield
    finally:
        _RESIDUALS.reset(token)


def residual_form(residuals: str | None, *operands: Any) -> str:
    """What a product of `operands` traced now saves: the explicit `residuals`,
    else `fp8_residuals`' setting, with the operands saved under second order."""
    chosen = _RESIDUALS.get() if residuals is None else check_residuals(residuals)
    depth = max(_DEPTH_TRACED_FOR.get(), differentiation_depth(*operands))
    return "operands" if chosen == "quantized" and depth >= 2 else chosen


@contextlib.contextmanager
def traced_for(values: Sequence[Any]) -> Iterator[None]:
    """Products traced inside see the derivatives `values` are traced under:
    for a program traced on stand-ins (`jax.make_jaxpr`), then run on `values`."""
    depth = max(_DEPTH_TRACED_FOR.get(), differentiation_depth(*values))
    token = _DEPTH_TRACED_FOR.set(depth)
    try:
        yield
    finally:
        _DEPTH_TRACED_FOR.reset(token)


def differentiation_depth(*xs: Any) -> int:
    """How many derivatives (`jax.jvp`, `jax.grad`, `jax.linearize`, nested) the
    arrays `xs` are traced under: 0 for a value, 2 inside `jax.hessian`."""
    return max((_depth(x) for x in xs if isinstance(x, jax.core.Tracer)), default=0)


def _depth(x: Any) -> int:
    levels = [0]

    @jax.custom_jvp
    def probe(x):
        return x

    @probe.defjvp
    def probe_jvp(primals, tangents):
        # Runs once for each derivative `x` is traced under: the primal is
        # the next one's tracer, probed again.
        levels[0] += 1
        probe(primals[0])
        return primals[0], tangents[0]

    probe(x)
    return levels[0]


@jax.custom_jvp
def to_be_saved_quantized(operands: Any) -> Any:
    """`operands` as they are, before they are quantized to be saved for the
    backward pass; differentiating them raises a `TypeError` (the quantized
    copies could not carry their tangents)."""
    return operands


@to_be_saved_quantized.defjvp
def _to_be_saved_quantized_jvp(primals, tangents):
    del primals, tangents
    raise TypeError(
        "An FP8 or FP4 product (fp8_dot_general, a policy with m=f8, f8_rowwise, mxfp8 "
        "or nvfp4) saved quantized copies of its operands for the backward pass, and a "
        "derivative of that backward pass was asked for (forward over reverse: jax.jvp "
        "or jax.linearize of jax.grad, jax.hessian). jmp_policy saves the operands "
        "themselves where it sees second order as the product is traced; here JAX traced "
        "it first (inside jax.jit, jax.checkpoint or a scan under the outer derivative). "
        'Trace it under `with jmp_policy.fp8_residuals("operands"):` (or pass '
        'fp8_dot_general(..., residuals="operands")): the backward pass then quantizes '
        "the operands again, and carries tangents in their own dtype."
    )
