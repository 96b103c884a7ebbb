"""State that a function takes in and returns keeps its dtype.

A policy's output dtype is for a function's results. What the function takes
in and hands back updated (an Equinox `State` with BatchNorm statistics, an
RNN carry, a scan body's carry, a model returned with its parameters) comes
back in the dtypes it came in: the next call, or `lax.scan`'s type check,
expects exactly those.

The rule, generic (no framework is imported): a part of the result is *state*
if it has the pytree structure and array shapes of a part of an argument; the
parts compared are the arguments themselves and, in both the arguments and the
result, what sits inside plain tuples, lists and dicts (so `(y, state)`,
`(carry, y)` and `{"cache": ...}` are seen through). Only containers count (a
tuple, a dict, a `NamedTuple`, an Equinox `State` or `Module`, ...): a bare
array of an argument's shape is a result, as `block(x) -> x + f(x)` is. A
gradient with its parameters' structure therefore keeps the parameters'
dtypes, as `jax.grad` gives it. Everything else takes the output dtype;
non-array leaves (functions, Python scalars, strings) pass through unchanged.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from jmp_policy.core.matmul import cast, is_float

_ARRAYS = (jax.Array, np.ndarray, np.generic)
_PLAIN = (tuple, list, dict)


def _is_plain(tree: Any) -> bool:
    # Exactly these types: a NamedTuple or a dict subclass is a state's type.
    return type(tree) in _PLAIN


def _signature(tree: Any) -> tuple[Any, tuple[Any, ...]] | None:
    """The structure and array shapes of a container, or None for a leaf."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves or jax.tree_util.treedef_is_leaf(treedef):  # Nothing to cast, or a leaf.
        return None
    return treedef, tuple(np.shape(x) if isinstance(x, _ARRAYS) else None for x in leaves)


def _children(tree: Any) -> list[Any]:
    return list(tree.values()) if isinstance(tree, dict) else list(tree)


def _candidates(args: Any) -> list[tuple[tuple[Any, tuple[Any, ...]], Any]]:
    """(signature, tree) of each container in `args` (an iterable of arguments)
    reached through plain tuples, lists and dicts."""
    found = []
    todo = list(args)
    while todo:
        tree = todo.pop()
        signature = _signature(tree)
        if signature is None:
            continue
        found.append((signature, tree))
        if _is_plain(tree):
            todo.extend(_children(tree))
    return found


def _match(tree: Any, candidates: list) -> Any:
    signature = _signature(tree)
    if signature is None:
        return None
    for other, arg in candidates:
        try:
            same = bool(other == signature)
        except Exception:  # A node's aux data that cannot be compared.
            same = False
        if same:
            return arg
    return None


def _like(out: Any, arg: Any) -> Any:
    """`out`'s floating arrays in the dtypes of `arg`'s, leaf by leaf."""

    def leaf(o: Any, a: Any) -> Any:
        return cast(o, a.dtype) if is_float(o) and is_float(a) else o

    return jax.tree.map(leaf, out, arg)


def cast_results(out: Any, args: Any, to_output: Any) -> Any:
    """`out` with its state in the dtypes of the arguments and the rest through `to_output`.

    Args:
      out: a function's result.
      args: the function's arguments (positional ones, then keyword values).
      to_output: the cast for results, e.g. `policy.cast_to_output`.

    Returns:
      `out`, its state (see the module docstring) cast to the dtypes of the
      argument it matches, every other part cast by `to_output`.

    >>> import jax.numpy as jnp
    >>> from jmp_policy import get_policy
    >>> carry = (jnp.zeros(3), jnp.zeros(3))
    >>> y, new_carry = cast_results(
    ...     (jnp.ones(3), carry), [carry, jnp.ones(3)], get_policy("bf16").cast_to_output
    ... )
    >>> y.dtype, new_carry[0].dtype
    (dtype(bfloat16), dtype('float32'))
    """
    candidates = _candidates(args)
    if not candidates:
        return to_output(out)

    def visit(tree: Any) -> Any:
        arg = _match(tree, candidates)
        if arg is not None:
            return _like(tree, arg)
        if not _is_plain(tree):
            return to_output(tree)
        if isinstance(tree, dict):
            return {k: visit(v) for k, v in tree.items()}
        return type(tree)(visit(v) for v in tree)

    return visit(out)
