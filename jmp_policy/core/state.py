"""State keeps its dtype: the one rule by which every front end splits a result.

A policy's output dtype is for a function's results. What the function takes
in and hands back updated (a decode cache, an RNN carry, BatchNorm
statistics, an Equinox `State`, a model returned with its parameters) comes
back in the dtypes it came in: the next call, or `lax.scan`'s type check,
expects exactly those. Linen's `with_policy`, `jmp_policy.nnx` and `autocast`
all decide it here, so they give the same dtypes on the same model.

The rule, generic (no framework is imported), by what the result holds and
never by where it sits in it:

* A container in the result (a tuple, dict, NamedTuple, dataclass,
  `flax.struct.dataclass`, Equinox module, Hugging Face `ModelOutput`, ...)
  is state if it has the pytree structure and array shapes of an argument or
  of a container inside one; a dict is also state if it holds all the
  entries of an argument's dict plus new ones (a cache with a new `"pos"`).
  Its leaves take the dtypes of that argument's (new entries as made).
* The result itself, and the plain tuples, lists and dicts in it, are seen
  through: each part decides for itself, so `Output(logits, cache)` splits
  as `(logits, cache)` and `(cache, logits)` do.
* Any other container that matches no argument (a NamedTuple, a dataclass:
  a type of the model's own, such as the cache a prefill makes) is state the
  function made: it comes back as made, as in the model's own half config.
* A bare array is a result, wherever it is: `block(x) -> x + f(x)`, and
  logits shaped like the input ids. Results take the output dtype;
  non-array leaves pass through unchanged.

A gradient with its parameters' structure therefore keeps the parameters'
dtypes, as `jax.grad` gives it. Where the rule cannot know (a bare array
carry or cache, a dict cache the function makes), `returns_state` says it: a
pytree prefix of the result with `True` for state (its argument's dtypes, or
as the function made it) and `False` for a result.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from jmp_policy.core.dtypes import cast, is_float

# A pytree prefix of a function's result: True (state), False (a result),
# None (the rule decides), or a container of those.
ReturnsState = Any

_ARRAYS = (jax.Array, np.ndarray, np.generic)
# Groups of parts, seen through: exactly these types (a NamedTuple or a dict
# subclass is a type of the model's own).
_PLAIN = (tuple, list, dict)


def _is_array(x: Any) -> bool:
    return isinstance(x, _ARRAYS)


def _one_level(tree: Any) -> tuple[list[Any], Any] | None:
    """`(children, treedef)` of a pytree node, or None for a leaf."""
    children, treedef = jax.tree_util.tree_flatten(tree, is_leaf=lambda x: x is not tree)
    if jax.tree_util.treedef_is_leaf(treedef):
        return None
    return children, treedef


class _Tree:
    """A container's leaves by key path, with their shapes and dtypes."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree
        flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
        self.treedef: Any = treedef
        self.leaves = {jax.tree_util.keystr(path): leaf for path, leaf in flat}
        self.shapes = {k: np.shape(x) if _is_array(x) else None for k, x in self.leaves.items()}

    def dtypes(self, keys: Any) -> list[Any]:
        return [getattr(self.leaves[k], "dtype", None) for k in keys]

    def same_structure(self, other: _Tree) -> bool:
        try:
            return bool(self.treedef == other.treedef) and self.shapes == other.shapes
        except Exception:  # A node's aux data that cannot be compared.
            return False

    def holds(self, other: _Tree) -> bool:
        """Whether this dict holds every entry of the dict `other`, with its shapes."""
        return (
            isinstance(self.tree, Mapping)
            and type(self.tree) is type(other.tree)
            and all(k in self.shapes and self.shapes[k] == s for k, s in other.shapes.items())
        )


def _containers(args: Sequence[Any]) -> list[_Tree]:
    """Every container holding an array, in `args` and inside them, outermost first."""
    found = []
    todo = list(reversed(args))
    while todo:
        tree = todo.pop()
        level = _one_level(tree)
        if level is None:
            continue
        candidate = _Tree(tree)
        if any(_is_array(x) for x in candidate.leaves.values()):
            found.append(candidate)
            todo.extend(reversed(level[0]))
    return found


def _argument_of(part: _Tree, candidates: list[_Tree]) -> _Tree | None:
    """The argument `part` is the updated version of: the same structure and
    shapes first, else a dict whose entries `part` holds; the same dtypes
    break ties, then the first argument."""
    best, best_score = None, (0, False)
    for arg in candidates:
        if part.same_structure(arg):
            kind = 2
        elif arg.shapes and part.holds(arg):
            kind = 1
        else:
            continue
        keys = list(arg.leaves)
        score = (kind, part.dtypes(keys) == arg.dtypes(keys))
        if score > best_score:
            best, best_score = arg, score
    return best


def _like(part: _Tree, arg: _Tree) -> Any:
    """`part`'s floating leaves in the dtypes of `arg`'s at the same key paths."""

    def leaf(path: Any, x: Any) -> Any:
        given = arg.leaves.get(jax.tree_util.keystr(path))
        return cast(x, given.dtype) if given is not None and is_float(x) and is_float(given) else x

    return jax.tree_util.tree_map_with_path(leaf, part.tree)


def _array_like(x: Any, args: Sequence[Any]) -> Any:
    """A bare array said to be state: in the dtype of an argument array of its shape."""
    same = [a for a in jax.tree.leaves(args) if is_float(a) and np.shape(a) == np.shape(x)]
    if not is_float(x) or not same:
        return x
    if any(a.dtype == x.dtype for a in same):
        return x
    return cast(x, same[0].dtype)


def cast_results(
    out: Any,
    args: Sequence[Any],
    to_output: Callable[[Any], Any],
    *,
    returns_state: ReturnsState = None,
) -> Any:
    """`out` with its state in the dtypes of the arguments and its results through `to_output`.

    Args:
      out: a function's result.
      args: the function's arguments (positional ones, then keyword values).
      to_output: the cast for results, e.g. `policy.cast_to_output`.
      returns_state: None to let the rule decide (see the module docstring),
        or a pytree prefix of `out`: `True` for a part that is state (its
        floating leaves in the dtypes of the argument it matches, else as
        made), `False` for a result, `None` for the rule.

    Returns:
      `out`, its state cast to the dtypes of the argument it matches, every
      other part cast by `to_output`.

    Raises:
      ValueError: if `returns_state` is not a prefix of the result's structure.
      TypeError: if `returns_state` holds something other than True, False, None.

    >>> import jax.numpy as jnp
    >>> from jmp_policy import get_policy
    >>> carry = (jnp.zeros(3), jnp.zeros(3))
    >>> to_output = get_policy("bf16").cast_to_output
    >>> y, new_carry = cast_results((jnp.ones(3), carry), [carry, jnp.ones(3)], to_output)
    >>> y.dtype, new_carry[0].dtype
    (dtype(bfloat16), dtype('float32'))
    >>> h = jnp.zeros(3)  # A bare array carry: said to be state.
    >>> y, new_h = cast_results((h, h), [h], to_output, returns_state=(False, True))
    >>> y.dtype, new_h.dtype
    (dtype(bfloat16), dtype('float32'))
    """
    candidates = _containers(args)

    def auto(tree: Any, top: bool = True) -> Any:
        level = _one_level(tree)
        if level is None:
            return to_output(tree)
        if candidates:
            part = _Tree(tree)
            arg = _argument_of(part, candidates)
            if arg is not None:
                return _like(part, arg)
        if not top and type(tree) not in _PLAIN:
            return tree  # A container of the function's own making: as made.
        children, treedef = level
        return jax.tree_util.tree_unflatten(treedef, [auto(c, False) for c in children])

    def as_state(tree: Any) -> Any:
        if _one_level(tree) is None:
            return _array_like(tree, args)
        part = _Tree(tree)
        arg = _argument_of(part, candidates)
        return tree if arg is None else _like(part, arg)

    if returns_state is None:
        return auto(out)
    spec, treedef = jax.tree_util.tree_flatten(returns_state, is_leaf=lambda x: x is None)
    spec_def: Any = treedef
    for choice in spec:
        if choice is not None and not isinstance(choice, bool):
            raise TypeError(
                "returns_state takes True (state), False (a result) or None (the rule "
                f"decides), or a pytree prefix of the result made of those; got {choice!r}."
            )
    try:
        parts = spec_def.flatten_up_to(out)
    except (ValueError, TypeError) as e:
        raise ValueError(
            f"returns_state={returns_state!r} is not a prefix of the result's structure "
            f"{jax.tree.structure(out)}: give True/False for each part of the result."
        ) from e
    choose: dict[Any, Callable[[Any], Any]] = {None: auto, True: as_state, False: to_output}
    return spec_def.unflatten([choose[c](p) for c, p in zip(spec, parts)])
