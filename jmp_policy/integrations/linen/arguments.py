"""The arguments of a wrapped call: those `keep_inputs` names, and a partial's own."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable


def _keeper(fn: Callable, names: frozenset[str]) -> Callable[[int | str], bool]:
    """Whether an argument (position or keyword) is one of `names` of `fn`'s signature.

    Raises:
      ValueError: if a name is not a parameter of `fn`.
    """
    if not names:
        return lambda key: False
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    unknown = sorted(names - {p.name for p in params})
    if unknown:
        inner = _unwrap_partial(fn)[0]
        raise ValueError(
            f"keep_inputs names {unknown[0]!r}, which is not an argument of "
            f"{getattr(inner, '__qualname__', inner)}; its arguments are "
            f"{[p.name for p in params]}."
        )
    positional = [
        p.name
        for p in params
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    ]

    def keep(key):
        if isinstance(key, int):
            return key < len(positional) and positional[key] in names
        return key in names

    return keep


def _unwrap_partial(fn: Callable) -> tuple[Callable, tuple, dict]:
    """`(function, bound args, bound kwargs)` of a (nested) `functools.partial`."""
    args: tuple = ()
    kwargs: dict = {}
    while isinstance(fn, functools.partial):
        args, kwargs = (*fn.args, *args), {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs
