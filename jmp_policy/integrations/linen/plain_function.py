"""`with_policy` of a plain function (a `lambda` around `apply`), and its guess of Flax variables.

Its floating arguments are cast to compute, except those that look like
Flax variables (a mapping with `"params"`), where the call checks that a model
was applied to each, and those the program gives a model as its variables
(statistics passed apart from the parameters), seen as it is traced.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from jmp_policy.core import jax_internals
from jmp_policy.core.policy import Policy
from jmp_policy.engine.data_flow import Flow
from jmp_policy.engine.decision import Rules
from jmp_policy.engine.interpreter import trace_and_eval
from jmp_policy.integrations import casting, flax_internals
from jmp_policy.integrations.linen.arguments import _keeper
from jmp_policy.integrations.linen.call import (
    _CALL,
    CallMode,
    _Call,
    _calling,
    _identity,
    explain_state_dtypes,
)


def _plain_function(
    fn: Callable,
    policy: Policy,
    interceptor: Callable,
    keep_inputs: frozenset[str],
    scaled: bool,
    op_rules: Rules,
    to_output: Callable[[Any, Flow], Any],
) -> Callable:
    """`with_policy` of a function that is not a linen entry point (a `lambda` around apply)."""
    keep = _keeper(fn, keep_inputs)

    def call_fn(args: tuple, kwargs: dict, uncast: frozenset, cast_ids: dict) -> Any:
        # The function's floating arguments are its inputs, except Flax
        # variables (a mapping with "params"): modules cast their parameters
        # themselves, and `batch_stats` stay float32. Cast inside the traced
        # program, what comes back from an argument is seen to.
        variables = [
            k
            for k in (*range(len(args)), *kwargs)
            if flax_internals.looks_like_variables(args[k] if isinstance(k, int) else kwargs[k])
        ]
        keeps = lambda k: keep(k) or k in variables or k in uncast  # noqa: E731
        cast_args, cast_kwargs = casting.cast_inputs(policy, args, kwargs, keeps)
        for k, value in (*enumerate(cast_args), *cast_kwargs.items()):
            if not keeps(k):
                cast_ids.update((id(x), k) for x in jax.tree.leaves(value))
        out = fn(*cast_args, **cast_kwargs)
        _check_bound_as_variables(variables, args, kwargs, _CALL.get())
        return out

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        caller = (
            jax_internals.caller_frame()
        )  # A loop calls its body from JAX's code (`Flow.called_with`).
        _refuse_nnx_modules(args, kwargs)
        uncast: frozenset = frozenset()
        while True:
            call = _Call(CallMode(rewrite=True, model_first=False))
            cast_ids: dict[int, int | str] = {}
            run = functools.partial(call_fn, uncast=uncast, cast_ids=cast_ids)
            try:
                with _calling(policy, call, interceptor, (args, kwargs) if scaled else ()):
                    out, flow = trace_and_eval(run, (args, kwargs), op_rules, flow=True)
            except (TypeError, ValueError) as e:
                for _, variables in call.given.values():  # A float32 cache, named.
                    explain_state_dtypes(e, variables, policy)
                raise
            # An argument the program gave a model as its variables (statistics
            # passed apart from the parameters) is state: traced again, uncast.
            given = set().union(*(_identity(v)[0] for _, v in call.given.values()))
            variables = {k for i, k in cast_ids.items() if i in given} - uncast
            if not variables:
                return to_output(out, flow.called_with(args, caller))
            uncast |= variables

    return wrapped


def _check_bound_as_variables(keys: list, args: tuple, kwargs: dict, call: _Call) -> None:
    """Raises unless each argument left uncast as Flax variables was a model's variables:
    its arrays, or (through a `jax.jit`) variables of its structure and shapes."""
    for key in keys:
        value = args[key] if isinstance(key, int) else kwargs[key]
        ids, layout = _identity(value)
        bound = [_identity(variables) for _, variables in call.given.values()]
        if ids and not any(ids & seen or layout == same for seen, same in bound):
            raise TypeError(
                f"with_policy took argument {key!r} (a mapping with a 'params' entry) for "
                "Flax variables and left it in its dtypes, but no linen model was applied "
                "to it. If it is not a model's variables, cast it yourself "
                "(policy.cast_to_compute) or pass its entries under other names."
            )


def _refuse_nnx_modules(args: tuple, kwargs: dict) -> None:
    for leaf in jax.tree.leaves((args, kwargs), is_leaf=lambda x: isinstance(x, nnx.Module)):
        if isinstance(leaf, nnx.Module):
            raise TypeError(
                f"jmp_policy.with_policy got the NNX module {type(leaf).__name__} as an "
                "argument; an NNX model takes its policy from "
                "jmp_policy.nnx.with_policy(model, policy) or jmp_policy.nnx.PolicyModule."
            )
