"""`autocast`: the engine's front end for any JAX function.

`autocast(fn, policy)` runs `fn`'s traced program through the engine
(`jmp_policy.engine`) with the policy's rules over the whole function, and
casts its results: state (as the program says, or `returns_state`) in the
dtype it came in, the rest in the output dtype. Frameworks whose calls hold
state (Flax NNX modules, linen's `mutable` collections, Equinox's `State`)
register a handler or a reader here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from jmp_policy.core import jax_internals
from jmp_policy.core.policy import Policy, get_policy, policy_argument
from jmp_policy.engine.data_flow import ReturnsState, cast_results
from jmp_policy.engine.decision import (
    FLOAT32_PRIMITIVES,
    HALF_PRIMITIVES,
    PROMOTE_PRIMITIVES,
    Rules,
    known_primitive_names,
    policy_products,
)
from jmp_policy.engine.interpreter import flow_recording_runner

# Handlers for arguments holding state that `fn` updates in place (Flax NNX
# modules): `handler(run, fn, args, kwargs)` returns `fn`'s result, running a
# pure function of that state through `run(pure_fn, args, kwargs)` and writing
# the new state back, or `NotImplemented` if the call holds no such state.
# The core knows no framework: the package registers the Flax NNX handler.
StateHandler = Callable[[Callable, Callable, tuple, dict], Any]
_STATE_HANDLERS: list[StateHandler] = []


def register_state_handler(handler: StateHandler) -> None:
    """Lets `autocast` thread a framework's mutable state through the traced program."""
    if handler not in _STATE_HANDLERS:
        _STATE_HANDLERS.append(handler)


# Readers of what a framework's API says is state in a call's result (linen's
# `apply(..., mutable=...)` returns the updated collections, Equinox keeps it
# in `eqx.nn.State`): `reader(fn, kwargs, result)` returns a `returns_state`
# prefix of the result, or None.
StateReader = Callable[[Callable, dict, Any], Any]
_STATE_READERS: list[StateReader] = []


def register_state_reader(reader: StateReader) -> None:
    """Lets `autocast` know which parts of a framework call's result are state."""
    if reader not in _STATE_READERS:
        _STATE_READERS.append(reader)


# Contexts a framework enters around each traced call, in which its API
# declares what is state as the program is traced (linen's interceptor: the
# mutable collections an `apply` inside `fn` returns, `declare_state`).
TraceContext = Callable[[], contextlib.AbstractContextManager]
_TRACE_CONTEXTS: list[TraceContext] = []


def register_trace_context(context: TraceContext) -> None:
    """Lets `autocast` enter a framework's context around each traced call."""
    if context not in _TRACE_CONTEXTS:
        _TRACE_CONTEXTS.append(context)


def _framework_state(fn: Callable, kwargs: dict, result: Any) -> ReturnsState:
    for reader in _STATE_READERS:
        said = reader(fn, kwargs, result)
        if said is not None:
            return said
    return None


def _primitive_names(ops: Iterable[Any], arg: str) -> frozenset[str]:
    if isinstance(ops, str):
        ops = [ops]
    try:
        ops = list(ops)
    except TypeError:
        raise TypeError(
            f"autocast({arg}=...) takes an iterable of primitive names or primitives, got {ops!r}."
        ) from None
    names = set()
    known = None
    for op in ops:
        name = op if isinstance(op, str) else getattr(op, "name", None)
        if not isinstance(name, str):
            raise TypeError(
                f"autocast({arg}=...) takes primitive names or primitives "
                f"(e.g. 'exp' or jax.extend.core.primitives.exp_p), got {op!r}."
            )
        if isinstance(op, str):
            # A misspelt name would match no operation and change nothing.
            known = known_primitive_names() if known is None else known
            if name not in known:
                close = difflib.get_close_matches(name, sorted(known), 3)
                hint = f" (did you mean {', '.join(map(repr, close))}?)" if close else ""
                raise ValueError(
                    f"autocast({arg}=...): unknown primitive name {name!r}{hint}. Accepted "
                    "are the names of jax.extend.core.primitives (e.g. 'exp', 'tanh', "
                    "'dot_general'); pass a primitive object for one defined elsewhere."
                )
        names.add(name)
    return frozenset(names)


def _scope_rules(
    rules: Mapping[str, Policy | str | None] | None, base: Rules
) -> tuple[tuple[str, Rules | None], ...]:
    """autocast's `rules=` as the engine's: each regex, and its policy's rules."""
    if rules is None:
        return ()
    if not isinstance(rules, Mapping):
        raise TypeError(
            f"autocast(rules=...) takes a mapping of named-scope regexes to policies "
            f"(or None: as written), e.g. {{'rotary': 'float32'}}, got {rules!r}."
        )
    out: list[tuple[str, Rules | None]] = []
    for pattern, policy in rules.items():
        if not isinstance(pattern, str):
            raise TypeError(f"autocast(rules=...): keys are regexes (str), got {pattern!r}.")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"autocast(rules=...): {pattern!r} is no regex: {e}.") from None
        if policy is None:
            out.append((pattern, None))
            continue
        given = get_policy(policy_argument(policy, f"rules[{pattern!r}]"))
        c, m, scaling, r = policy_products(given)
        here = dataclasses.replace(
            base, compute_dtype=c, matmul_dtype=m, fp8_scaling=scaling, reduce_dtype=r
        )
        out.append((pattern, here))
    return tuple(out)


def autocast(
    fn: Callable,
    policy: Policy | str,
    *,
    half_primitives: Iterable[Any] = HALF_PRIMITIVES,
    float32_primitives: Iterable[Any] = FLOAT32_PRIMITIVES,
    promote_primitives: Iterable[Any] = PROMOTE_PRIMITIVES,
    returns_state: ReturnsState = None,
    rules: Mapping[str, Policy | str | None] | None = None,
) -> Callable:
    """Runs `fn` with matmuls in half precision and sensitive ops in float32.

    A transform over the traced program of any JAX function (plain `jnp`, Flax
    linen or NNX, Equinox), in the spirit of `torch.autocast`: `jmp_policy.engine`
    says what each operation runs in. Activations stay in the compute dtype
    between products, as in the model's own half config (sums and products
    over many values in float32; under float16, a float32 value meeting a
    half one wins, as in PyTorch AMP). Arrays keep the dtypes they are given (storage is
    `Policy.cast_to_param`'s job); only the operations are rewritten, and the
    floating results are cast to `policy.output_dtype`, except state, read
    from the traced program: a cache written or grown, a value passed
    through, a loop's carry (and `fn`'s carry where JAX traces it as a loop
    body), an Equinox `State`, linen's `mutable` collections come back in
    the dtypes they went in, by the rule linen's `with_policy` and
    `jmp_policy.nnx` use too (`jmp_policy.engine.data_flow`). Non-array results (an
    Equinox module's activation) come back as returned. `param_dtype` is not
    used. Array arguments are traced, anything else is static. Each call traces
    `fn` again, so call it under `jax.jit`.

    Composes with `jax.jit`, `jax.grad`, `jax.vmap`, `lax.scan` and
    `jax.checkpoint` on either side; the bodies of `jax.shard_map` and
    `jax.pmap` (which JAX 0.10 runs as a `shard_map`) are rewritten too. Autocast of
    an autocast function: the inner one decides for the operations inside it.
    Flax NNX modules that update their state (BatchNorm statistics, `Rngs`)
    work as `fn` (`autocast(model, policy)(x)`), as a bound method, or as
    arguments (`autocast(step, policy)(model, x)`), eagerly and under
    `nnx.jit`: their state is threaded through the traced program and written
    back; a module `fn` merely closes over gets a `TypeError` saying so. Not
    supported: forward-mode differentiation (`jax.jvp`, `jax.jacfwd`) through
    the half matmuls, which carry a `jax.custom_vjp`. A user's `custom_vjp`
    is rewritten too: its forward, and its backward rule from the inputs as
    residuals (the rule recomputes the forward, as under `jax.checkpoint`).

    Args:
      fn: the function to transform.
      policy: a `Policy` or a spec for `get_policy` (e.g. "mixed_bfloat16").
      half_primitives: names of primitives that run on `compute_dtype`
        operands with float32 accumulation (bilinear ones only).
      float32_primitives: names of primitives that run in float32.
      promote_primitives: names of primitives that run in the widest floating
        dtype of their inputs. Extend a list with e.g.
        `float32_primitives=FLOAT32_PRIMITIVES | {"tanh"}`. A name in several
        lists takes the first of half, float32, promote.
      returns_state: a pytree prefix of `fn`'s result, `True` for a part
        that is state (in the dtype of the argument it is built from, else
        as made: a cache `fn` makes), `False` for a result (the output
        dtype); None (the default) lets the state rule decide.
      rules: other policies by `jax.named_scope` path (Keras names its
        layers' scopes, Flax its modules'): a regex searched in an
        operation's path, e.g. `{"rotary": "float32"}`, and the policy
        its operations take there, or None to run them as written
        (`as_written`); the first match wins.

    Returns:
      The transformed function, with `fn`'s signature.

    Raises:
      TypeError: if `fn` is not callable, or a primitive list holds something
        other than names or primitives.
      ValueError: if a primitive list holds a name that is no JAX primitive's
        (the message lists close matches), or a `rules` key is no regex.

    >>> import jax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> from jmp_policy import autocast
    >>> def f(x, w):
    ...   return jax.nn.softmax(x @ w)
    >>> g = autocast(f, "mixed_bfloat16")
    >>> x, w = jnp.linspace(-1, 1, 6).reshape(2, 3), jnp.ones((3, 4))
    >>> g(x, w).dtype
    dtype('float32')
    >>> bool(jnp.allclose(jax.jit(g)(x, w), f(x, w), atol=1e-2))
    True
    """
    if not callable(fn):
        raise TypeError(f"autocast expects a function as its first argument, got {fn!r}.")
    policy = get_policy(policy_argument(policy))
    c, m, scaling, r = policy_products(policy)
    engine_rules = Rules(
        compute_dtype=c,
        half=_primitive_names(half_primitives, "half_primitives"),
        float32=_primitive_names(float32_primitives, "float32_primitives"),
        promote=_primitive_names(promote_primitives, "promote_primitives"),
        matmul_dtype=m,
        fp8_scaling=scaling,
        reduce_dtype=r,
    )
    engine_rules = dataclasses.replace(engine_rules, by_scope=_scope_rules(rules, engine_rules))

    # Not `functools.wraps`: it would copy `fn.__dict__`, and with it the
    # `lower` of a `jax.pmap` or `jax.jit` function, which lowers the
    # original program.
    @functools.wraps(fn, updated=())
    def wrapped(*args, **kwargs):
        caller = jax_internals.caller_frame()
        run, flows = flow_recording_runner(engine_rules)
        with contextlib.ExitStack() as contexts:
            for context in _TRACE_CONTEXTS:
                contexts.enter_context(context())
            for handler in _STATE_HANDLERS:
                outs = handler(run, fn, args, kwargs)
                if outs is not NotImplemented:
                    break
            else:
                outs = run(fn, args, kwargs)
        # What the program returns from an argument keeps its dtype; results
        # take the output dtype.
        flow = flows[-1].called_with(args, caller)
        said = _framework_state(fn, kwargs, outs) if returns_state is None else returns_state
        return cast_results(outs, flow, policy.cast_to_output, returns_state=said)

    return wrapped
