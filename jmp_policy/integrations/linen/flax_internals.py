"""The one place jmp_policy's linen front end touches what Flax does not promise to keep.

As `jmp_policy.core.jax_internals` is for JAX: every Flax private API the
linen integration reads (or patches) is here, each with what it relies on,
so that a Flax upgrade breaks here first and is fixed here once. Each has a
probe in the test suite (`tests/test_flax_internals.py`); a read that finds
one gone falls back to doing without it, as the functions below say.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import flax.linen.module
import flax.linen.transforms


def debug_path(scope: Any) -> tuple[str, ...]:
    """A scope's debug path, whose last entry names the lifted transforms that made it.

    Relies on `flax.core.scope.Scope.debug_path` (e.g. its last entry
    "remat(scan(blocks))", innermost first); () where it is gone.
    """
    return getattr(scope, "debug_path", ())


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
