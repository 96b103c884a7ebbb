"""Parameters: the dtypes a model makes them in under a policy, and `init`'s own draws.

`apply` reads each parameter in the dtype the model makes it in (`_read_in`),
learnt from `with_policy(model.init, ...)` or one abstract `init`
(`_made_dtypes`, kept in `_MADE`); `init` returns the model's own draws
(`_own_draws`), each in its owner's param dtype (`_params_to_owner_dtypes`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.core.dtypes import is_float
from jmp_policy.core.policy import Policy
from jmp_policy.engine.interpreter import traced_widened_where_refused, widened
from jmp_policy.integrations import flax_internals
from jmp_policy.integrations.linen.call import CallMode, _Call, _calling

# What `apply` takes that `init` does not.
_APPLY_ONLY = ("mutable", "rngs", "capture_intermediates")


def _made_dtypes(
    model: nn.Module,
    policy: Policy,
    interceptor: Callable,
    args: tuple,
    kwargs: dict,
    call: _Call,
) -> dict[str, Any]:
    """The dtype each parameter is made in under the policy, by its path.

    That is the model's own half config: a layer that reads `dtype` as its
    parameters' dtype (gemma's, whose `init` makes every parameter in it)
    makes them in the compute dtype and computes with them so; Flax's layers
    make them in `param_dtype`. Found by running `model.init` under the
    policy abstractly (nothing is computed), out of sight of the caller's own
    method interceptors, with the PRNG streams the call draws from.

    Raises:
      Whatever that `init` raises, with a note saying so (never a silent
      guess of the dtypes).
    """
    # The PRNG streams the call draws from (dropout's), for `init` to draw from too.
    streams = sorted(kwargs.get("rngs") or ())
    kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_ONLY}

    def init(*a: Any, **k: Any) -> Any:
        key = jax.random.key(0)
        return model.init({"params": key, **dict.fromkeys(streams, key)}, *a, **k)

    made = _Call(CallMode(as_written=call.mode.as_written, fields_unset=call.mode.fields_unset))
    try:
        with flax_internals.interceptors_set_aside(), _calling(policy, made, interceptor):
            # A float32 model refuses to write into a half cache it is given;
            # its parameters are made alike with the cache in float32.
            shapes = traced_widened_where_refused(lambda v: _shapes_of(init, *v), (args, kwargs))
    except Exception as e:  # Raised unchanged (a user's own error), with where it arose.
        call.set_third_party_fields = made.set_third_party_fields
        e.add_note(
            f"with_policy was running {type(model).__name__}.init abstractly with the "
            "arguments of this apply, to learn the dtype each parameter is made in under "
            "the policy (a layer may make its parameters in `dtype`)."
        )
        raise
    return _dtypes_by_path(shapes.get("params", {}))


def _by_path(params: Any) -> dict[str, Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(params)
    return {jax.tree_util.keystr(path): x for path, x in flat}


def _dtypes_by_path(params: Any) -> dict[str, Any]:
    return {path: x.dtype for path, x in _by_path(params).items()}


def _read_in(params: Any, dtypes: dict[str, Any]) -> Any:
    """`params`, each floating one made narrower in the model than stored cast to that dtype."""

    def read(path: Any, x: Any) -> Any:
        made = dtypes.get(jax.tree_util.keystr(path))
        if made is None or not is_float(x) or not jnp.issubdtype(made, jnp.floating):
            return x
        return x.astype(made) if np.dtype(made).itemsize < x.dtype.itemsize else x

    return jax.tree_util.tree_map_with_path(read, params)


class _MadeDtypes:
    """The dtypes a model makes its parameters in under a policy, by model and call.

    Recorded by `with_policy(model.init, ...)` (its own draws under the
    policy), else found once by an abstract `init` (`_made_dtypes`). Keyed by
    the model (held weakly; equal linen modules share, and one that cannot be
    hashed, a Hugging Face module holding its config, is its own), the policy
    and rules, and the call's structure and dtypes (not its shapes: `init` on
    a small batch serves `apply` on any).
    """

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._by_id: dict[int, dict] = {}  # Models that cannot be hashed.

    def _records(self, model: Any, create: bool = False) -> dict | None:
        try:
            return self._by_model.setdefault(model, {}) if create else self._by_model.get(model)
        except TypeError:  # Unhashable: by identity, for as long as it lives.
            if create and id(model) not in self._by_id:
                try:
                    weakref.finalize(model, self._by_id.pop, id(model), None)
                except TypeError:  # Not weakly referable either: nothing is kept.
                    return None
                self._by_id[id(model)] = {}
            return self._by_id.get(id(model))

    @staticmethod
    def _key(key: Any, args: tuple, kwargs: dict) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_ONLY}
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = (jax.Array, np.ndarray)
        # `x.dtype` itself: a typed PRNG key's (`key<fry>`) is no numpy dtype.
        values = tuple(x.dtype if isinstance(x, arrays) else x for x in leaves)
        full = (key, treedef, values)
        try:
            hash(full)
        except TypeError:
            return None
        return full

    def get(self, model: Any, key: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        full, records = self._key(key, args, kwargs), self._records(model)
        return None if full is None or records is None else records.get(full)

    def of_the_same_parameters(self, model: Any, key: tuple, paths: set) -> dict | None:
        """Dtypes recorded for `model` under `key` (the policy, rules and mode) by
        any call whose parameters have exactly `paths` (the same parameters), or None."""
        for (recorded, _, _), dtypes in (self._records(model) or {}).items():
            if recorded == key and set(dtypes) == paths:
                return dtypes
        return None

    def put(self, model: Any, key: Any, args: tuple, kwargs: dict, dtypes: dict) -> None:
        full, records = self._key(key, args, kwargs), self._records(model, create=True)
        if full is not None and records is not None:
            records[full] = dtypes


_MADE = _MadeDtypes()


class MadeKey(NamedTuple):
    """What the dtypes a model makes its parameters in depend on, the call aside."""

    policy: Policy
    rules: tuple


def variables_as_made(
    model: nn.Module, made_key: MadeKey, interceptor: Callable, call_args: tuple, call: _Call
) -> Any:
    """An `apply`'s variables (`call_args[0]`) with each parameter in the dtype
    the model makes it in under the policy."""
    variables, args, kwargs = call_args
    if not flax_internals.looks_like_variables(variables):
        return variables
    key = (*made_key, call.mode.as_written, call.mode.fields_unset)
    # Recorded by a call of the same structure, else by `with_policy(model.init)`
    # for the same parameters (`init` may not run on a cached decoding step's
    # arguments), else found by an abstract `init`.
    dtypes = _MADE.get(model, key, args, kwargs)
    if dtypes is None:
        paths = set(_dtypes_by_path(variables["params"]))
        dtypes = _MADE.of_the_same_parameters(model, key, paths)
    if dtypes is None:
        dtypes = _made_dtypes(model, made_key.policy, interceptor, args, kwargs, call)
    _MADE.put(model, key, args, kwargs, dtypes)
    return {**variables, "params": _read_in(variables["params"], dtypes)}


def variables_made(
    target: Callable, entry: str, made_key: MadeKey, call_args: tuple, made: Any, call: _Call
) -> Any:
    """The variables an `init` under the policy made: the model's own draws
    (`_own_draws`), each parameter in its owner's param dtype; its dtypes
    recorded for the `apply`s to come."""
    if not flax_internals.looks_like_variables(made):
        return made
    model, (_, args, kwargs) = target.__self__, call_args  # type: ignore[attr-defined]
    key = (*made_key, call.mode.as_written, call.mode.fields_unset)
    _MADE.put(model, key, args, kwargs, _dtypes_by_path(made["params"]))
    own = _own_draws(target, entry, call_args, made["params"])
    return _params_to_owner_dtypes({**made, "params": own}, call.owners, made_key.policy)


def _shapes_of(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`jax.eval_shape(fn, *args, **kwargs)`, only the arrays abstract (a
    `train=False` flag stays a Python value)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    arrays = (jax.Array, np.ndarray, jax.ShapeDtypeStruct)
    at = [i for i, x in enumerate(leaves) if isinstance(x, arrays)]

    def on(*arrays: Any) -> Any:
        full = list(leaves)
        for i, x in zip(at, arrays):
            full[i] = x
        a, k = jax.tree.unflatten(treedef, full)
        return fn(*a, **k)

    return jax.eval_shape(
        on, *(jax.ShapeDtypeStruct(np.shape(leaves[i]), leaves[i].dtype) for i in at)
    )


def _own_draws(target: Callable, entry: str, call: tuple[Any, tuple, dict], made: Any) -> Any:
    """The parameters `model.init` itself draws, where the policy's draws differ.

    A parameter the policy draws in another dtype than the plain `init` (half
    where the model draws it in its `dtype`, `self.param(..., self.dtype)`, or
    under a half param dtype; float32 where its author set a half
    `param_dtype`) has other random values: it gets the plain `init`'s, cast
    after. Only then is `init` run a second time;
    which parameters differ is read from an abstract plain `init`. Its
    floating arguments are given to it in float32, as to the float32 model
    it is (which would write float32 into a half cache given to it).

    Raises:
      The plain `init`'s own error, with a note, where it cannot run.
      ValueError: if it makes other parameters than the policy's.
    """
    first, args, kwargs = call

    def plain(*a: Any, **k: Any) -> Any:
        out = target(first, *a, **k)
        return (out if entry == "init" else out[1])["params"]

    try:
        own = _shapes_of(plain, *widened((args, kwargs), abstract=True))
    except Exception as error:
        error.add_note(
            "with_policy was running the model's own init (its floating arguments in "
            "float32) to draw its parameters as it does."
        )
        raise
    own_leaves, made_leaves = _by_path(own), _by_path(made)
    if {k: x.shape for k, x in own_leaves.items()} != {k: x.shape for k, x in made_leaves.items()}:
        raise ValueError(
            "with_policy: the model makes other parameters under the policy than its own "
            "init does (a shape or structure that follows a dtype), so its own draws "
            "cannot stand in for the policy's."
        )
    # Drawn in another dtype (a wider one too: an author's half `param_dtype`
    # under a float32 policy), a parameter's random values differ.
    if all(made_leaves[k].dtype == x.dtype for k, x in own_leaves.items()):
        return made  # The same draws.
    args, kwargs = widened((args, kwargs), abstract=False)
    return plain(*args, **kwargs)


def _params_to_owner_dtypes(
    variables: Any, owners: dict[tuple[str, ...], Policy], policy: Policy
) -> Any:
    """Each real floating parameter in the param dtype of the module that owns it.

    Layers create their parameters in `param_dtype`; a module without that
    attribute (`self.param(...)` in a custom module) creates float32 ones, and
    its own policy (its rule's, or its parent's) decides, whatever rules other
    modules have. Complex parameters stay complex.
    """
    if "params" not in variables:
        return variables

    def cast(path, leaf):
        keys = tuple(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        owner = next(
            (owners[keys[:i]] for i in range(len(keys), -1, -1) if keys[:i] in owners), policy
        )
        return owner.cast_to_param(leaf)

    params = jax.tree_util.tree_map_with_path(cast, variables["params"])
    return {**variables, "params": params}
