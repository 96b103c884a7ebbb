"""The record of one call of a wrapped function, and the context it runs in.

A `CallMode` holds what a call decided before it runs; a `_Call`, what the
interceptor learns while the model runs (the module paths met, the rules
matched, each module's policy); `_calling` sets it, the
policy and the interceptor for the call's duration. `nn.jit` keys its traces
on the call too (`_nn_jit_keyed_on_the_call`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import itertools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.core.policy import Policy
from jmp_policy.engine.data_flow import declare_state, is_declared_state
from jmp_policy.engine.decision import Products, policy_products
from jmp_policy.engine.residuals import traced_for
from jmp_policy.integrations import casting, flax_internals

# The policy of the module being called; children without a rule inherit it.
_ACTIVE_POLICY: contextvars.ContextVar[Policy] = contextvars.ContextVar("policy")


_TRACE_KEYS: Iterator[int] = itertools.count(1)


@dataclasses.dataclass(frozen=True)
class CallMode:
    """What a call of a wrapped function decided before it runs."""

    keep_inputs: frozenset[str] = frozenset()
    rewrite: bool = False  # Products are decided by the op-level rewrite (not in `init`).
    # A third party's own modules keep their dtype fields as written (`casting.run_as_written`).
    as_written: bool = False
    # No module's dtype fields are set, Flax's own either: after a lifted loop
    # refused the carry they changed (the engine alone decides the products).
    fields_unset: bool = False
    # The first intercepted call is the model's own (its inputs); not for a
    # plain function, whose modules are all called from it.
    model_first: bool = True


@dataclasses.dataclass
class _Call:
    """What one call of a wrapped function learns while it runs, under its `mode`."""

    mode: CallMode
    # Whether the policy set a dtype field of a third party's own module.
    set_third_party_fields: bool = False
    seen_top: bool = False  # The model's own call has been intercepted.
    # Whether the model has a dtype config (`flax_internals.configures_dtypes`); None
    # until its own call.
    configured: bool | None = None
    paths: set[str] = dataclasses.field(default_factory=set)  # Module paths seen.
    matched: set[str] = dataclasses.field(default_factory=set)  # Path patterns matched.
    # The policy of each module path: parameters are stored in their owner's param dtype.
    owners: dict[tuple[str, ...], Policy] = dataclasses.field(default_factory=dict)
    # Rematerialised norms by program, shared between layers (see `_rematerialised`).
    norm_programs: dict[tuple, Callable] = dataclasses.field(default_factory=dict)
    # The paths of the modules running, innermost last, and of each root
    # scope (by id) the path its modules are under (see `_module_path`).
    running: list[tuple[str, ...]] = dataclasses.field(default_factory=list)
    prefixes: dict[int, tuple[Any, tuple[str, ...]]] = dataclasses.field(default_factory=dict)
    # What decides the products in each running module's scope (`policy_products`), innermost last.
    products: list[Products] = dataclasses.field(default_factory=list)
    # `nn.jit` keys its traces on it (see `_nn_jit_keyed_on_the_call`).
    trace_key: int = dataclasses.field(default_factory=lambda: next(_TRACE_KEYS))
    # The variables bound to each model (a root scope, by id), as they came in
    # (`remember_given`): state keeps their dtypes, and a plain function's
    # arguments taken for variables are checked against them.
    given: dict[int, Any] = dataclasses.field(default_factory=dict)


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("call")


def _module_path(module: nn.Module, call: _Call) -> tuple[str, ...]:
    """The module's path in the model, also for a module applied by hand.

    A module applied by hand inside another (a tied head:
    `self.lm_head.apply({"params": {"kernel": emb.T}}, h)`) runs in a new
    root scope, at path (); it is at the caller's path plus its own name, and
    the modules inside it below that.
    """
    scope = module.scope
    if scope is None:
        return tuple(str(p) for p in module.path)
    root = scope
    while root.parent is not None:
        root = root.parent
    if id(root) not in call.prefixes:
        by_hand = call.running and not root.path and root is scope
        name = [module.name] if module.name else []
        # The scope is kept with its prefix: its id is not reused during the call.
        call.prefixes[id(root)] = (root, (*call.running[-1], *name) if by_hand else ())
    return (*call.prefixes[id(root)][1], *(str(p) for p in module.path))


@contextlib.contextmanager
def _calling(
    policy: Policy, call: _Call, interceptor: Callable, values: Any = ()
) -> Iterator[None]:
    """The context of one call of a wrapped function: its policy, its record, the
    interceptor; FP8 products traced inside (in jitted functions too) save what
    the derivatives of `values` (the call's arguments, under an FP8 policy) need."""
    _nn_jit_keyed_on_the_call()  # Once, at the first call that intercepts linen modules.
    token = _ACTIVE_POLICY.set(policy)
    call_token = _CALL.set(call)
    call.products.append(policy_products(policy))  # The rewrite's own, outside every scope.
    try:
        with nn.intercept_methods(interceptor), traced_for(jax.tree.leaves(values)):
            yield
    finally:
        _ACTIVE_POLICY.reset(token)
        _CALL.reset(call_token)


def remember_given(module: nn.Module, given: dict[int, Any]) -> None:
    """Keeps a model's variables as they came in, at its root scope's first call."""
    root = module.scope
    if root is not None and root.parent is None and id(root) not in given:
        # A copy of the structure (its leaves as they are now: the scope's own
        # dicts change as the call writes), and the scope, so its id stays its own.
        given[id(root)] = (root, jax.tree.map(lambda x: x, module.variables))


def declare_collections(module: nn.Module, given: dict[int, Any], out: Any) -> Any:
    """At the end of a model's call (a root scope's), its mutable collections are
    state: what `apply` hands back keeps the dtypes it came in (`declare_state`),
    also where a function around `apply` returns it.

    Returns the call's result `out`, where it is also in a collection (sown,
    captured, cached) as a copy: state is told by identity, and the result
    stays a result.
    """
    root = module.scope
    if root is None or root.parent is not None:
        return out
    declare_state(root.mutable_variables(), given.get(id(root), (None, None))[1])
    return jax.tree.map(lambda x: jnp.array(x, copy=True) if is_declared_state(x) else x, out)


def recording_interceptor() -> Callable:
    """A linen method interceptor that only declares collections (for `autocast`)."""
    given: dict[int, Any] = {}

    def interceptor(next_fun, args, kwargs, context):
        remember_given(context.module, given)
        out = next_fun(*args, **kwargs)
        if context.method_name == "__call__" or not context.method_name.startswith("__"):
            out = declare_collections(context.module, given, out)
        return out

    return interceptor


def _identity(tree: Any) -> tuple[set[int], Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {id(x) for _, x in flat}, [(jax.tree_util.keystr(p), np.shape(x)) for p, x in flat]


def _nn_jit_keyed_on_the_call() -> None:
    """Makes `nn.jit` trace a method again for each call under a policy, per module path.

    `nn.jit` keys its traces on a module's fields and scope (not its path),
    and the interceptor runs inside the trace: a method traced without a
    policy (or under another, or for a layer another rule names) would serve
    this call, silently, and its modules would not be seen by the rules. So
    under a policy the key also holds the call and the module's path. Flax's
    key is private (`flax_internals`): if it moves, `test_flax_internals.py`
    and `test_linen_architectures.py`'s nn.jit test say so.
    """

    def where(module: nn.Module) -> Any:
        call = _CALL.get(None)
        if call is None:
            return None
        return (call.trace_key, tuple(str(p) for p in module.path))

    flax_internals.key_nn_jit_traces_also_on(where)


def explain_state_dtypes(error: Exception, variables: Any, policy: Policy) -> None:
    """Raises a `TypeError` naming the collections, if a dtype error may come from them."""
    if isinstance(variables, Mapping):
        collections = {k: v for k, v in variables.items() if k not in ("params", "batch_stats")}
        casting.name_unfit_state(
            error, collections, policy, "with_policy", "the collections",
            "(a decode cache made by the plain model.init is float32): make them with "
            "jmp_policy.with_policy(model.init, policy), as the hand-written half-precision "
            "model would, or cast them, e.g. "
            "jax.tree.map(lambda x: x.astype(jnp.{dtype}), variables[{name!r}]).",
        )  # fmt: skip
