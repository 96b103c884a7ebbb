"""The one place jmp_policy touches what Flax does not promise, or guesses about it.

As `jmp_policy.core.jax_internals` is for JAX: every Flax private API the
linen and NNX front ends read (or patch), and every guess they make about a
Flax model that the traced program cannot say, is here, each with what it
relies on, so that a Flax upgrade breaks here first and is fixed here once.
Each has a probe in the test suite (`tests/test_flax_internals.py`); a read
that finds one gone falls back to doing without it, as the functions below
say. docs/how_it_decides.md lists them, and why the program cannot say them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import flax.linen.module
import flax.linen.transforms
import jax.numpy as jnp
import numpy as np
from flax import nnx

# Flax's layers (linen and NNX)

# Flax's module base classes: a layer derived from them alone is a third party's.
_MODULE_BASES = (
    frozenset(nn.Module.__mro__)
    | frozenset(nnx.Module.__mro__)
    | frozenset(nnx.bridge.Module.__mro__)
)
# Where Flax makes the classes of lifted modules (`nn.scan`, `nn.remat`, ...).
_LIFTED = "flax.linen.transforms"


def is_flax_module(module: Any) -> bool:
    """A module defined by Flax itself (`nn.Dense`, `nnx.LSTMCell`, ...), by its
    class's package."""
    return type(module).__module__.split(".")[0] == "flax"


def is_flax_layer(module: Any) -> bool:
    """A layer of Flax's (`nn.Dense`, `nnx.Linear`) or derived from one: its
    `dtype` and `param_dtype` mean what Flax's layers make of them (compute
    in `dtype`, parameters in `param_dtype`). A third party's own module may
    read them otherwise, or keep another dtype field beside them."""
    return any(
        c not in _MODULE_BASES
        and c.__module__.split(".")[0] == "flax"
        and c.__module__ != _LIFTED  # `nn.scan(Block)`: the block's own class decides
        for c in type(module).__mro__
    )


# Where Flax's layers infer their dtype from their operands (`dtype=None`):
# `promote_dtype` in linen's and NNX's `dtypes` modules.
_FLAX_DTYPE_INFERENCE = re.compile(r"flax[/\\](linen|nnx[/\\]nn)[/\\]dtypes\.py:.*\(promote_dtype")


def infers_a_layers_dtype(origin: str) -> bool:
    """Whether a conversion written at `origin` ("file:line:column (function)")
    is a Flax layer inferring its dtype from its operands (`dtype=None`):
    under a policy the model's own half config would have set that field."""
    return _FLAX_DTYPE_INFERENCE.search(origin) is not None


def configures_dtypes(model: Any) -> bool:
    """Whether a model has a dtype config of its own: a floating `dtype`
    attribute (Hugging Face's `dtype=jnp.float32`), which its author passes
    to the layers that are to compute in it."""
    dtype = getattr(model, "dtype", None)
    try:
        return dtype is not None and jnp.issubdtype(np.dtype(dtype), jnp.floating)
    except TypeError:
        return False


# linen

_LINEN_ENTRIES = ("apply", "init", "init_with_output")


def linen_entry(fn: Callable) -> str | None:
    """'apply', 'init' or 'init_with_output' for a bound linen method of that
    name (the model's own entry points, by their name), else None."""
    if isinstance(getattr(fn, "__self__", None), nn.Module):
        name = getattr(fn, "__name__", None)
        return name if name in _LINEN_ENTRIES else None
    return None


def looks_like_variables(value: Any) -> bool:
    """Whether a plain function's argument is taken for a linen model's
    variables: a mapping with a `"params"` entry (the front end then checks
    that a model was applied to it)."""
    return isinstance(value, Mapping) and "params" in value


# Flax's lifted transforms name themselves in the debug path of the scope they
# create for their body (e.g. "remat(scan(blocks))", innermost first). Those
# that only wrap the body leave its signature as it is.
_TRANSPARENT_LIFTS = frozenset(
    {"remat", "checkpoint", "jit", "vmap", "map_variables", "named_call"}
)
_LIFT_NAME = re.compile(r"([A-Za-z_]\w*)\(")


def lifted_loop(scope: Any) -> str | None:
    """'scan' or 'while_loop' if `scope` is a lifted loop's body scope, else None.

    A lifted transform runs its body on a module bound to a new root scope
    (no parent, but the module's path). Relies on
    `flax.core.scope.Scope.debug_path`, whose last entry names the transforms
    that made it ("remat(scan(blocks))"); None where it is gone.
    """
    if scope is None or scope.parent is not None or not scope.path:
        return None
    debug_path = getattr(scope, "debug_path", ())
    for name in _LIFT_NAME.findall(debug_path[-1] if debug_path else ""):
        if name in ("scan", "while_loop"):
            return name
        if name not in _TRANSPARENT_LIFTS:
            return None
    return None


def key_nn_jit_traces_also_on(where: Callable[[nn.Module], Any]) -> None:
    """Makes `nn.jit` key its traces of a module's methods also on `where(module)`
    (when that is not None). Patches Flax once, at the first call of a linen
    front end (`call._calling`): a process that only uses `autocast` is left
    as it was.

    Relies on `flax.linen.transforms._HashableProxy.from_module`, the key
    `nn.jit` caches traces under: a dataclass whose field `hash_key` is its hash.
    Where it is gone, nothing is patched (`test_flax_internals.py` and
    `test_linen_architectures.py`'s nn.jit test say so).
    """
    proxy = getattr(flax.linen.transforms, "_HashableProxy", None)
    from_module = getattr(proxy, "from_module", None)
    if from_module is None or getattr(from_module, "_jmp_policy", False):
        return

    def keyed(cls: type, module: nn.Module) -> Any:
        key = from_module(module)
        extra = where(module)
        if extra is None:
            return key
        return dataclasses.replace(key, hash_key=hash((key.hash_key, extra)))

    keyed._jmp_policy = True  # type: ignore[attr-defined]
    proxy.from_module = classmethod(keyed)  # type: ignore[union-attr]


@contextlib.contextmanager
def interceptors_set_aside() -> Iterator[None]:
    """Flax's method interceptors set aside: the abstract `init` is not the caller's call.

    Relies on `flax.linen.module._global_interceptor_stack`, where
    `nn.intercept_methods` keeps them (with `len`, `pop` and `push`). If it
    moves, they see that `init` (`test_user_interceptors_see_each_norm_once` says so).
    """
    stack = getattr(flax.linen.module, "_global_interceptor_stack", None)
    if stack is None:
        yield
        return
    aside = []
    try:
        while len(stack):
            aside.append(stack.pop())
        yield
    finally:
        for interceptor in reversed(aside):
            stack.push(interceptor)


# NNX

# Methods every NNX module has (`train`, `sow`, ...): not a layer's own maths.
_MODULE_METHODS = frozenset(dir(nnx.Module)) - {"__call__"}


def run_methods_in(module: nnx.Module, context: Callable[..., Any], args: tuple) -> None:
    """Makes `module`'s own methods run inside `context(*args)` (a context manager).

    NNX has no method interceptors: `module` (the copy a traced call merged,
    never the caller's) gets a subclass of its own class whose methods enter
    the context and call the class's, looked up at each call (never stale).
    """
    module.__class__ = _in_context(type(module), context, args)


@functools.lru_cache(maxsize=1024)  # Made once per class and context, not at every call.
def _in_context(cls: type, context: Callable[..., Any], args: tuple) -> type:
    def in_context(name: str) -> Callable:
        def method(self: Any, *a: Any, **k: Any) -> Any:
            with context(*args):
                return getattr(super(subclass, self), name)(*a, **k)

        return method

    names = [
        n
        for n in dir(cls)
        if n not in _MODULE_METHODS
        and (n == "__call__" or not n.startswith("__"))
        and inspect.isfunction(getattr(cls, n, None))
    ]
    subclass = type(cls.__name__, (cls,), {n: in_context(n) for n in names})
    return subclass
