"""State keeps its dtype: the one rule by which every front end splits a result.

A policy's output dtype is for a function's results. What the function takes
in and hands back (a decode cache written or grown, a loop's carry, a value
passed through) comes back in the dtype it came in: the next call, or
`lax.scan`'s type check, expects exactly that. The rule reads the traced
program, never the result's structure, shapes or names:

* A returned array built from an argument by buffer operations keeps that
  argument's dtype: written into (`dynamic_update_slice`, scatters,
  `.at[]`), grown (`concatenate`, `stack`, `pad`, or copied into a larger
  buffer), selected, sorted, sliced, reshaped, cast or passed through, the
  carry of a loop the argument started, through nested calls, branches and
  checkpoints (`buffer_sources`).
* A framework's state, as its API says while the program is traced (the
  collections linen's `apply` returns, also to a function around it),
  keeps the dtype it came in (`declare_state`).
* A function traced as the body of `lax.scan`, `lax.while_loop` or
  `lax.fori_loop` (JAX says so while tracing it) returns its carry in the
  carry's dtypes, as the loop requires.
* Every other floating result takes the output dtype; anything else passes
  through unchanged.

Arithmetic on an argument (`x + f(x)`, a running average) makes a result.
Where the program cannot say it (statistics returned in the result rather
than in a framework's state), `returns_state` does: a pytree prefix of the
result with `True` for state (as the program made it, or its argument's
dtype where it flows from one) and `False` for a result.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import jax
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import cast, is_float

# A pytree prefix of a function's result: True (state), False (a result),
# None (the rule decides), or a container of those.
ReturnsState = Any

# Operations whose result is their first (and only floating) operand's
# elements, moved: exact in any dtype.
MOVES_DATA = frozenset(
    {
        "copy", "reshape", "squeeze", "broadcast_in_dim", "transpose", "rev", "slice",
        "dynamic_slice", "gather", "sharding_constraint", "split", "unstack", "tile",
        "stop_gradient",
    }
)  # fmt: skip
# Operations whose result is their first operand's data, moved or rewritten
# in part: a buffer grown, selected or cast is still that buffer (`top_k`'s
# values are its elements; its indices are integers).
_MOVES_FIRST = MOVES_DATA | {
    "scatter-add", "scatter-mul", "scatter-min", "scatter-max", "pad",
    "convert_element_type", "reduce_precision", "top_k",
}  # fmt: skip
# Writes: the result is the buffer written into and what is written, each
# in part: a cache written at an index, or copied into a larger fresh buffer.
_WRITES = {"dynamic_update_slice": 1, "scatter": 2}  # The position of what is written.
# Operations whose result is made of several operands' data.
_MOVES_ALL = frozenset({"concatenate", "stack"})
_SELECTS = frozenset({"select_n"})  # Operand 0 is the predicate.
# Operations passing each operand through as the result at its position
# (`sort` reorders each operand alike).
_PASSES_EACH = frozenset({"device_put", "optimization_barrier", "sort"})

Sources = tuple[int, ...]  # Input positions, in order.


def _union(*groups: Sources) -> Sources:
    return tuple(sorted(set().union(*groups)))


def buffer_sources(jaxpr: ji.Jaxpr, given: Sequence[Sources] | None = None) -> list[Sources]:
    """For each output of `jaxpr`, the inputs it is built from by buffer operations.

    `given` labels the inputs (default: each its own position). An output
    computed by arithmetic has none; a loop's carry has its initial value's
    whatever the body does, since JAX keeps the carry's type.
    """
    env: dict[Any, Sources] = {}
    labels = given if given is not None else [(i,) for i in range(len(jaxpr.invars))]
    env.update(zip(jaxpr.invars, labels))

    def read(v: Any) -> Sources:
        return () if isinstance(v, ji.Literal) else env.get(v, ())

    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        name = eqn.primitive.name
        n = len(eqn.outvars)
        if name in _MOVES_FIRST:
            outs = [ins[0]] * n
        elif name in _WRITES:
            outs = [_union(ins[0], ins[_WRITES[name]])] * n
        elif name in _MOVES_ALL:
            outs = [_union(*ins)] * n
        elif name in _SELECTS:
            outs = [_union(*ins[1:])] * n
        elif name in _PASSES_EACH:
            outs = ins[:n]
        elif aliased := ji.aliased_outputs(eqn):  # A kernel writing into its inputs.
            outs = [ins[aliased[i]] if i in aliased else () for i in range(n)]
        else:
            outs = _nested_sources(eqn, ins) or [()] * n
        env.update((v, s) for v, s in zip(eqn.outvars, outs) if not isinstance(v, ji.DropVar))
    return [read(v) for v in jaxpr.outvars]


def _nested_sources(eqn: ji.JaxprEqn, ins: list[Sources]) -> list[Sources] | None:
    """The sources through a call, checkpoint, custom rule, `shard_map`, loop or branch."""
    body = ji.inlined_body(eqn)
    if body is not None:
        return buffer_sources(body, ins)
    loop = ji.loop_parts(eqn)
    if loop is not None:
        # A carry starts as its initial value and keeps its type: its sources
        # grow to a fixed point of what the body writes into it.
        body, consts, carry, xs = loop
        carries = [ins[i] for i in carry]
        while True:
            outs = buffer_sources(body, [ins[i] for i in consts] + carries + [ins[i] for i in xs])
            grown = [_union(c, o) for c, o in zip(carries, outs)]
            if grown == carries:
                return carries + outs[len(carries) :]
            carries = grown
    branches = ji.branches(eqn)
    if branches is not None:
        per_branch = [buffer_sources(b, ins[1:]) for b in branches]
        return [_union(*outs) for outs in zip(*per_branch)]
    return None


class _Declared:
    """The state declared while one program is traced: each value's id -> (the
    value, the dtype it keeps), and the dtypes its inputs came in (a program
    may be traced on widened stand-ins; see `interpreter._traced_and_run`)."""

    def __init__(self, inputs: Sequence[Any], dtypes: Sequence[np.dtype]) -> None:
        self.inputs = {id(x): (x, d) for x, d in zip(inputs, dtypes)}
        self.kept: dict[int, tuple[Any, np.dtype | str]] = {}

    def dtype_given(self, x: Any) -> np.dtype:
        return self.inputs[id(x)][1] if id(x) in self.inputs else x.dtype

    def kept_dtype(self, x: Any) -> np.dtype | str | None:
        """The dtype declared state `x` keeps, `AS_MADE`, or None (not state)."""
        value, dtype = self.kept.get(id(x), (None, None))
        return dtype if value is x else None


# State a framework's API names while a program is traced (linen's `apply`
# returns its mutable collections).
_DECLARED: contextvars.ContextVar[_Declared | None] = contextvars.ContextVar(
    "declared_state", default=None
)


# Declared state without a variable it came in as: its dtype as the traced
# program makes it (not a narrower one `autocast` computes it in).
AS_MADE = "as made"


def declare_state(made: Any, given: Any = None) -> None:
    """Says that the arrays of `made`, values of the program being traced, are
    state: returned by it, each keeps the dtype of `given`'s leaf at its path
    (the variable as it came in), else the dtype the traced program makes
    it in (a sown value, as the model sows it). A no-op outside a traced
    call."""
    declared = _DECLARED.get()
    if declared is None:
        return
    dtypes = {
        p: declared.dtype_given(x)
        for p, x in jax.tree_util.tree_leaves_with_path(given)
        if is_float(x)
    }
    for path, x in jax.tree_util.tree_leaves_with_path(made):
        if is_float(x):
            for value in ji.primals(x):
                dtype = dtypes.get(path, AS_MADE)
                if dtype == AS_MADE and declared.kept_dtype(value) is not None:
                    continue  # Also a variable that came in (sown and cached): its dtype.
                declared.kept[id(value)] = (value, dtype)


def is_declared_state(x: Any) -> bool:
    """Whether `x`, a value of the program being traced, was declared state."""
    declared = _DECLARED.get()
    return declared is not None and declared.kept_dtype(x) is not None


@contextlib.contextmanager
def declarations(inputs: Sequence[Any], dtypes: Sequence[np.dtype]) -> Iterator[_Declared]:
    """The state declared while a program of `inputs` (given in `dtypes`) is traced."""
    declared = _Declared(inputs, dtypes)
    token = _DECLARED.set(declared)
    try:
        yield declared
    finally:
        _DECLARED.reset(token)


class Flow:
    """What one traced call returned from its arguments: each result array's source.

    Built by the front end that traced the call (`trace_and_eval(...,
    flow=True)`); `loop_body` is `(kind, carry)` where JAX traced the call as
    the body of a loop ("scan", "while_loop" or "fori_loop"), else None.
    """

    def __init__(
        self,
        sources: dict[int, Any] | None = None,
        declared: dict[int, np.dtype] | None = None,
        made: dict[int, np.dtype] | None = None,
    ) -> None:
        self._sources = sources or {}
        self._declared = declared or {}
        self._made = made or {}
        self.loop_body: tuple[str, Any] | None = None

    def made_dtype(self, leaf: Any) -> np.dtype | None:
        """The dtype the traced program made the result `leaf` in (`autocast`
        may narrow a value between products below it), or None if unknown."""
        return self._made.get(id(leaf))

    def source(self, leaf: Any) -> Any:
        """The argument array `leaf` was built from by buffer operations, or None."""
        return self._sources.get(id(leaf))

    def kept_dtype(self, leaf: Any) -> np.dtype | None:
        """The dtype the result `leaf` keeps as state (declared, or its source's), or None."""
        if id(leaf) in self._declared:
            return self._declared[id(leaf)]
        source = self.source(leaf)
        return None if source is None else source.dtype

    def called_with(self, args: Sequence[Any], caller: Any) -> Flow:
        """This flow, told the call's positional `args` (a loop body's carry among
        them) and its caller's frame: a loop calls its body from JAX's (or Flax's,
        Equinox's) own code; a function a user's body calls with the body's own
        arguments is not the body."""
        body = ji.called_by_a_library(caller)
        self.loop_body = ji.loop_body_carry(args) if body else None
        return self


def flow_of(
    values: Sequence[Any],
    sources: list[Sources],
    outs: Sequence[Any],
    declared: Sequence[np.dtype | str | None] = (),
    made: Sequence[np.dtype] = (),
) -> Flow:
    """The `Flow` of a program run on `values` that returned `outs`, with
    `buffer_sources`, the dtype declared for each result as it was traced,
    and the dtype the traced program made each in."""
    made_in = {id(out): np.dtype(d) for out, d in zip(outs, made) if is_float(out)}
    kept: dict[int, np.dtype] = {
        id(out): made_in.get(id(out), np.dtype(out.dtype)) if isinstance(d, str) else d  # `AS_MADE`
        for out, d in zip(outs, declared)
        if d is not None and is_float(out)
    }
    found = {}
    for out, positions in zip(outs, sources):
        if not positions or not is_float(out):
            continue
        candidates = [values[i] for i in positions if is_float(values[i])]
        if candidates:
            # Of several (a buffer grown from two), the one in the result's dtype.
            same = [v for v in candidates if v.dtype == out.dtype]
            found[id(out)] = (same or candidates)[0]
    return Flow(found, kept, made_in)


def as_given(new: Any, given: Any) -> Any:
    """`new` with each floating leaf at a path where `given` has one in that leaf's dtype.

    A framework's variables (NNX's, linen's collections) are state by its
    API: one written back keeps the dtype it was given, even where the
    program makes it anew (a half KV cache overwritten whole by a float32
    program's keys); one the call creates keeps its dtype as made.
    """
    dtypes = {
        path: x.dtype for path, x in jax.tree_util.tree_leaves_with_path(given) if is_float(x)
    }

    def keep(path: Any, x: Any) -> Any:
        return cast(x, dtypes[path]) if path in dtypes and is_float(x) else x

    return jax.tree_util.tree_map_with_path(keep, new)


def cast_results(
    out: Any,
    flow: Flow,
    to_output: Callable[[Any], Any],
    *,
    returns_state: ReturnsState = None,
) -> Any:
    """`out` with its state in its arguments' dtypes and its results through `to_output`.

    Args:
      out: a function's result.
      flow: what the traced program says of it (see `Flow`).
      to_output: the cast for results, e.g. `policy.cast_to_output`.
      returns_state: None to let the program decide (see the module
        docstring), or a pytree prefix of `out`: `True` for a part that is
        state (each floating leaf in its source argument's dtype, else as
        made), `False` for a result, `None` for the rule.

    Returns:
      `out`, its state in the dtypes it came in, every other part cast by `to_output`.

    Raises:
      ValueError: if `returns_state` is not a prefix of the result's structure.
      TypeError: if `returns_state` holds something other than True, False, None.

    >>> import jax.numpy as jnp
    >>> from jmp_policy import get_policy
    >>> to_output = get_policy("bf16").cast_to_output
    >>> cache, y = jnp.zeros(3), jnp.ones(3)
    >>> flow = Flow({id(cache): cache})  # The cache came back as it went in.
    >>> [x.dtype for x in cast_results((y, cache), flow, to_output)]
    [dtype(bfloat16), dtype('float32')]
    >>> [x.dtype for x in cast_results((y, y), flow, to_output, returns_state=(False, True))]
    [dtype(bfloat16), dtype('float32')]
    """

    def keep_source(leaf: Any, otherwise: Callable[[Any], Any]) -> Any:
        if not isinstance(leaf, ji.ARRAYS):
            return leaf
        kept = flow.kept_dtype(leaf)
        if kept is not None and is_float(leaf):
            return cast(leaf, kept)
        return otherwise(leaf)

    def by_flow(tree: Any) -> Any:
        return jax.tree.map(lambda x: keep_source(x, to_output), tree)

    def as_made(leaf: Any) -> Any:
        made = flow.made_dtype(leaf)
        return leaf if made is None or not is_float(leaf) else cast(leaf, made)

    def as_state(tree: Any) -> Any:
        return jax.tree.map(lambda x: keep_source(x, as_made), tree)

    def as_result(tree: Any) -> Any:
        return jax.tree.map(lambda x: to_output(x) if isinstance(x, ji.ARRAYS) else x, tree)

    result = _by_returns_state(out, returns_state, by_flow, as_state, as_result)
    if flow.loop_body is not None:
        return keep_carry(result, *flow.loop_body, made=out)
    return result


def _by_returns_state(
    out: Any,
    returns_state: ReturnsState,
    by_flow: Callable,
    as_state: Callable,
    as_result: Callable,
) -> Any:
    if returns_state is None:
        return by_flow(out)
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
    choose: dict[Any, Callable[[Any], Any]] = {None: by_flow, True: as_state, False: as_result}
    return spec_def.unflatten([choose[c](p) for c, p in zip(spec, parts)])


def keep_carry(out: Any, kind: str, carry: Any, *, made: Any = None) -> Any:
    """A loop body's result (`kind` "scan": `(carry, ys)`; else the carry)
    with its carry in the dtypes of `carry`, the one the loop gave it, cast
    from `made` (the body's result before any other cast; default `out`)."""
    made = out if made is None else made
    scan = kind == "scan"
    if scan and ji.scan_result_parts(out) is None:
        return out  # JAX's own check says what is wrong.
    new = made[0] if scan else made
    treedef: Any = jax.tree.structure(new)
    try:
        given = treedef.flatten_up_to(carry)
    except (ValueError, TypeError):
        return out
    leaves = jax.tree.leaves(new)
    kept = [cast(x, c.dtype) if is_float(x) and is_float(c) else x for x, c in zip(leaves, given)]
    kept_carry = jax.tree.unflatten(treedef, kept)
    return type(out)((kept_carry, out[1])) if scan else kept_carry
