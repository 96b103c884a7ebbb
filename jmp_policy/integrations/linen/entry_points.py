"""`with_policy` and linen's entry points: `apply`, `init`, `init_with_output`.

Also what `autocast` asks of a linen entry point: which parts of its result
are state (`state_in_result`), and `apply`'s collections in the dtypes the
variables were given in (`apply_keeping_variables`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import flax
import flax.linen as nn
from flax import nnx
from jax.typing import DTypeLike

from jmp_policy.core import jax_internals
from jmp_policy.core.dtypes import SCALED_MATMUL_DTYPES
from jmp_policy.core.policy import get_policy, policy_argument, to_float_dtype
from jmp_policy.engine.data_flow import Flow, ReturnsState, as_given, cast_results
from jmp_policy.engine.decision import product_rules
from jmp_policy.engine.interpreter import trace_and_eval
from jmp_policy.integrations import casting, flax_internals
from jmp_policy.integrations.linen.arguments import _unwrap_partial
from jmp_policy.integrations.linen.call import CallMode, _Call, _calling, explain_state_dtypes
from jmp_policy.integrations.linen.interceptor import _make_interceptor
from jmp_policy.integrations.linen.parameters import MadeKey, variables_as_made, variables_made
from jmp_policy.integrations.linen.plain_function import _plain_function
from jmp_policy.integrations.rules import PolicyLike, Rules, RuleSet, input_names


def _split_first(entry: str, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """`(variables or rngs, other args, other kwargs)`, given by position or by name."""
    if args:
        return args[0], args[1:], kwargs
    name = "variables" if entry == "apply" else "rngs"
    if name not in kwargs:
        raise TypeError(f"{entry}() missing its first argument, {name!r}.")
    kwargs = dict(kwargs)
    return kwargs.pop(name), (), kwargs


def state_in_result(fn: Callable, kwargs: dict) -> Any:
    """Which parts of a linen entry point's result are state (`returns_state`):
    `init`'s variables and the collections `apply` returns; None for a result
    holding none, or for any other function."""
    entry = flax_internals.linen_entry(fn)
    if entry == "init":
        return True
    if entry == "init_with_output" or (entry == "apply" and _returns_collections(kwargs)):
        return (None, True)
    return None


def collections_as_given(collections: Any, variables: Any) -> Any:
    """The collections `apply` returns, each variable given in `variables` in
    the dtype it was given (`jmp_policy.engine.data_flow.as_given`)."""
    if not isinstance(collections, Mapping) or not isinstance(variables, Mapping):
        return collections
    kept = as_given(flax.core.unfreeze(dict(collections)), flax.core.unfreeze(dict(variables)))
    return flax.core.freeze(kept) if isinstance(collections, flax.core.FrozenDict) else kept


def apply_keeping_variables(run: Callable, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`autocast`'s call of a linen `apply` that returns collections: the
    variables given come back in their dtypes; `NotImplemented` for any other call."""
    if flax_internals.linen_entry(fn) != "apply" or not _returns_collections(kwargs):
        return NotImplemented
    out, collections = run(fn, args, kwargs)
    return out, collections_as_given(collections, _split_first("apply", args, kwargs)[0])


def _returns_collections(kwargs: dict) -> bool:
    mutable = kwargs.get("mutable", False)
    return bool(mutable) or bool(kwargs.get("capture_intermediates", False))


def with_policy(
    fn: Callable,
    policy: PolicyLike,
    *,
    rules: Rules | None = None,
    remat_norms: bool = True,
    keep_inputs: str | Iterable[str] = (),
    returns_state: ReturnsState = None,
    config_dtype: DTypeLike | None = None,
) -> Callable:
    """Returns `fn` running under a mixed precision policy.

    For a Flax linen `model.apply` (or a `functools.partial` of it), every
    module computes in the compute dtype (its `dtype` attribute is set for the
    call, also where it was `None` or float32; in a model with a floating
    `dtype` config of its own, an `nn.Embed` built without a `dtype` looks up
    in its table's dtype, as in the model's own half config, unless a rule
    names it);
    parameters stay stored in the
    param dtype and are cast inside each module, so gradients come back in the
    param dtype. The results are cast to the output dtype, the state the
    model threads through is not (see below); mutable collections
    (`batch_stats`, `cache`) are returned as the modules keep them.
    `model.init` and `model.init_with_output` return `model.init`'s own
    random draws (also of a parameter drawn in the model's `dtype`, as
    `self.param(..., self.dtype)`), each cast to the param dtype of the
    module that owns it (its rule's, else its parent's); the other
    collections (a decode cache) are made under the policy.

    `apply` reads each parameter in the dtype the model makes it in under the
    policy, where that is narrower than its stored dtype: a layer that reads
    `dtype` as its parameters' dtype and computes with them as they are
    (Google DeepMind's `gemma`: `self.param(..., self.dtype)`, then
    `jnp.einsum(x, w)`) computes in bfloat16 as its own bf16 config does, its
    parameters stored (and trained) in the param dtype. Flax's layers make
    theirs in `param_dtype` and cast where they compute: read as stored. The
    dtypes come from `with_policy(model.init, ...)` (its own draws), else from
    one abstract `init` when a model, policy and call structure are first
    seen (a checkpoint loaded without `init`).

    The cast rule is that of the model's own half-precision config (every
    layer's `dtype` set by hand): layers cast what they compute with (Flax's
    layers cast their inputs and parameters to `dtype` inside), and no module
    boundary casts, so values moving between modules (arguments, states,
    caches, timesteps) keep their dtypes, also into a module or a model with
    a `dtype` field: a diffusion model's float32 timesteps reach its
    sinusoidal embedding as float32, a float32 RNN state passed to an inner
    cell stays float32. Only a module a rule names has its floating inputs
    cast, to the rule's compute dtype (`rules={MyModel: "f32"}`: the whole
    model, inputs included, in float32), except the model's arguments that
    `keep_inputs` names. Integers, booleans and complex arrays are never
    cast, and a module whose `dtype` or `param_dtype` is complex keeps both.
    Flax's own layers run under standard dtype promotion (their norms lift
    half inputs to float32 statistics, their cells add half gates to a
    float32 carry), also where the caller set strict promotion.

    The result is split into results and state by the rule `jmp_policy.nnx`
    and `autocast` use too (`jmp_policy.engine.data_flow`), read from the traced
    call: a cache written or grown, a carry or a value passed through comes
    back in the dtype it went in, wherever it sits in the result; every
    other floating result takes the output dtype; `returns_state` says it
    where the program cannot. A decode cache made by the plain
    `model.init` (float32) does not fit a half model: the dtype error it
    causes is re-raised as a `TypeError` naming the collection and the fix.

    Carries of lifted loops keep the dtypes the model gives them: the body of
    `nn.scan` (also under `nn.remat`/`nn.vmap`, and the cells of `nn.RNN`)
    and of `nn.while_loop` returns its carry cast back to the dtypes it
    received, so an LSTM's float32 carry stays float32 while its gates
    multiply in half, and a float32 LayerScale parameter or a float32 rule
    inside a scanned block does not change the carry's type.

    Any other function (a `lambda` around `apply`) has its floating arguments
    cast to compute, except Flax variables (a mapping with a `"params"`
    key, whose `batch_stats` stay float32) and the arguments `keep_inputs`
    names, and its results cast to output; the modules it calls follow the
    rules above. An NNX module is refused: use `jmp_policy.nnx`.

    Normalisation layers need no rule: Flax's norms compute their statistics
    in float32 (`force_float32_reductions`) and emit the compute dtype, so the
    next matmul stays in half precision; they run under standard dtype
    promotion, which that float32 lift needs, also where the caller set
    `jax_numpy_dtype_promotion="strict"`. That lift makes float32 copies of
    the input, which JAX would save for the backward pass (more bytes than
    the half input itself): so `nn.LayerNorm`, `nn.RMSNorm` and `nn.GroupNorm`
    computing in half precision are rematerialised (`jax.checkpoint`): the
    backward pass recomputes them from their half input, a few elementwise
    ops. The forward values are the same; gradients agree up to half
    precision rounding (XLA may fuse the recomputation differently).
    `remat_norms=False` turns it off. Only these exact classes (a subclass
    may hold other state), never float32 norms, and never while parameters
    are being created (`init`, or `apply` with mutable params). Attention keeps Flax's own choice
    (softmax in the compute dtype): Flax's `force_fp32_for_softmax=True` would
    also turn the weights-times-values matmul into float32.

    Every product is decided at the level of operations, whatever the
    fields say: the call is rewritten (`matmuls_in`) so that a product whose
    operands are wider than its module's compute dtype takes them in it, with
    float32 accumulation; so a layer that keeps its dtype in a field of
    another name (a rotary embedding's `fprop_dtype`), reads `dtype` as its
    parameters' dtype, or sits behind `nnx.bridge.ToLinen`, multiplies in
    the compute dtype too. Under a bfloat16 compute dtype (and the FP8
    policies) the values between products follow `autocast`'s rule as well:
    what the model computes from a product's half result stays half, a
    float32-set operation (an exponential) computes in float32 and is
    rounded back once, a norm's statistics stay float32; so a layer no field
    reaches saves for the backward pass what the model's own half config
    saves. A cast the model writes to its config's dtype (MaxText's
    `cfg.dtype`, float32 in the float32 config a policy runs) is a widening
    the program cannot tell from the author's own: `config_dtype` names it
    (see Args). Where a
    third party's module fails with the policy's dtypes in its own fields
    (MaxText's checks that its keys, in `fprop_dtype`, and values agree),
    the call runs again with them as written, every product still decided
    so, and a `RuntimeWarning` says so; so does a lifted loop written as a
    function (`nn.scan(fn, ...)(self, ...)`, `nn.while_loop`) whose carry
    the policy's fields would change (the model's own half config fails
    there): every module's fields as written, the engine keeps the carry.

    A policy with a `matmul_dtype` (`"p=f32,c=bf16,o=f32,m=bf16"`,
    `"mixed_float8"`) sets every product of the model: `half_dot_general`
    (float32 accumulation) or `fp8_dot_general`, forward and backward. The
    call is rewritten at the level of operations (`matmuls_in`), so Flax's
    layers, attention, `nn.Einsum`, `Embed.attend`, `nn.OptimizedLSTMCell`
    and `jnp.einsum`/`@`/`jnp.dot` in model code all take it; a `dot_general`
    wired into a `Dense` by hand is replaced. A rule can keep a module out
    (e.g. `{"head": "mixed_bfloat16"}`), also a product the model's author
    wrote in float32 on purpose (`{"logits": "f32"}`). Convolutions run in
    the compute dtype.

    Rules override the policy per module class or per module path:

    * a class matches its subclasses; the nearest class in the module's MRO wins;
    * a path pattern (`fnmatch`, where `*` also matches `/`) is matched against
      the module's path such as `"decoder/layers_0/LayerNorm_0"` and beats
      any class rule; the pattern with more literal characters wins;
    * remaining ties go to the rule listed first;
    * a module without a matching rule inherits its parent's policy;
    * a path pattern that matches no module of a whole-model call (no
      `method=`) is a `ValueError`, as in `jmp_policy.nnx` (a typo, most
      likely); a module that runs only in some calls (e.g. a train-only head)
      is matched in the calls where it runs, so wrap those applies with the
      rule and the others without.

    Args:
      fn: a bound linen `model.apply` / `model.init` / `model.init_with_output`,
        or any function of arrays.
      policy: a `Policy` or a spec such as `"mixed_bfloat16"`.
      rules: optional `{module class or path pattern: Policy or spec}`.
      remat_norms: recompute half-precision norm layers in the backward pass
        rather than save their float32 intermediates.
      keep_inputs: names of arguments of the model's call (or of `fn`, for a
        plain function) whose floating arrays are passed as given, never cast
        (for a model, only a rule naming it casts its inputs).
      returns_state: a pytree prefix of the result, `True` for a part that
        is state (in the dtype of the argument it is built from, else as
        made: a cache the model makes), `False` for a
        result (the output dtype); None (the default) lets the rule decide.
      config_dtype: the dtype the model's own config names for its
        computation where the model casts to it itself (`x.astype(cfg.dtype)`:
        a no-op in its own half config, a widening in the float32 config a
        policy runs): a cast of a half value to it leaves it half, its
        float32-set operations still computing in float32, and a product of
        values so cast takes the policy. None (the default): every widening
        the program writes is the author's.

    Returns:
      The wrapped function. Jit it (`jax.jit(with_policy(...))`): a jitted
      wrapped function and a jitted unwrapped one never share a trace.

    Raises:
      TypeError: if `fn` is already jitted (jit the result instead), is an NNX
        module (or is given one), a rule key or value or `keep_inputs` is
        of the wrong type, or `config_dtype` is not a floating dtype.
      ValueError: if a policy spec is malformed; when called, if a path pattern
        matches no module of a whole-model call, or `keep_inputs` names an
        argument the model's call does not have.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jmp_policy as jmp
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((4, 3))
    >>> variables = jmp.with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    >>> apply = jmp.with_policy(model.apply, "mixed_bfloat16", rules={"layers_2": "f32"})
    >>> variables["params"]["layers_0"]["kernel"].dtype, apply(variables, x).dtype
    (dtype('float32'), dtype('float32'))
    >>> lstm = nn.RNN(nn.LSTMCell(4), return_carry=True)
    >>> xs = jnp.ones((2, 5, 3))
    >>> params = jmp.with_policy(lstm.init, "mixed_bfloat16")(jax.random.key(0), xs)
    >>> (c, h), ys = jmp.with_policy(lstm.apply, "mixed_bfloat16")(params, xs)
    >>> c.dtype, ys.dtype  # The carry as LSTMCell.initialize_carry made it.
    (dtype('float32'), dtype('float32'))
    """
    _check_function(fn)
    policy = get_policy(policy_argument(policy))
    rule_set = RuleSet(rules, nn.Module, "decoder/*/LayerNorm_*")
    if not isinstance(remat_norms, bool):
        raise TypeError(f"remat_norms must be True or False, got {remat_norms!r}.")
    keep_inputs = input_names(keep_inputs)
    interceptor = _make_interceptor(rule_set, remat_norms)
    matmul_dtypes = (policy.matmul_dtype, *rule_set.matmul_dtypes)
    scaled = any(m in SCALED_MATMUL_DTYPES for m in matmul_dtypes)
    target, bound_args, bound_kwargs = _unwrap_partial(fn)
    entry = flax_internals.linen_entry(target)
    config = None if config_dtype is None else to_float_dtype(config_dtype, "config_dtype")
    op_rules = product_rules(policy, scaled_scopes=scaled, config_dtype=config)

    def to_output(out: Any, flow: Flow) -> Any:
        return cast_results(out, flow, policy.cast_to_output, returns_state=returns_state)

    if entry is None:
        return _plain_function(fn, policy, interceptor, keep_inputs, scaled, op_rules, to_output)

    model: nn.Module = target.__self__  # type: ignore[attr-defined]  # A bound linen method.
    made_key = MadeKey(policy, tuple(rule_set.rules))

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        caller = (
            jax_internals.caller_frame()
        )  # A loop calls its body from JAX's code (`Flow.called_with`).
        args, kwargs = (*bound_args, *args), {**bound_kwargs, **kwargs}
        positional = args
        # The first argument is the variables (apply) or the PRNG key (init):
        # variables keep their dtypes; modules cast their parameters.
        first, args, kwargs = _split_first(entry, args, kwargs)

        call_args = (first, args, kwargs)
        traced = _tracer(target, entry, made_key, interceptor, op_rules, scaled, call_args)
        # `init`'s products are never seen: only its parameters are kept.
        mode = CallMode(keep_inputs, rewrite=entry != "init")
        result, flow, call = _run(traced, mode, entry, model)
        if "method" not in kwargs:
            # A whole-model call met every module: a pattern that matched none is a typo.
            rule_set.check_all_matched(call.matched, call.paths, getattr(target, "__self__", None))
        if entry != "apply":
            made = result if entry == "init" else result[1]
            made = variables_made(target, entry, made_key, call_args, made, call)
            return made if entry == "init" else (to_output(result[0], flow), made)
        if _returns_collections(kwargs):
            out, collections = result
            return to_output(out, flow), collections_as_given(collections, first)
        return to_output(result, flow.called_with(positional, caller))

    return wrapped


def _tracer(
    target: Callable,
    entry: str,
    made_key: MadeKey,
    interceptor: Callable,
    op_rules: Any,
    scaled: bool,
    call_args: tuple,
) -> Callable[[_Call], tuple[Any, Flow]]:
    """How a linen entry point's call runs, given its record: through the
    engine (its products decided where the call's mode rewrites them), its
    flow recorded."""
    first, args, kwargs = call_args
    policy = made_key.policy

    def run(first: Any, args: tuple, kwargs: dict) -> Any:
        return target(first, *args, **kwargs)

    def traced(call: _Call) -> tuple[Any, Flow]:
        variables = first
        if entry == "apply":
            model = target.__self__  # type: ignore[attr-defined]
            variables = variables_as_made(model, made_key, interceptor, call_args, call)
        values = (variables, args, kwargs) if scaled else ()
        rules = op_rules if call.mode.rewrite else None
        with _calling(policy, call, interceptor, values):
            try:
                return trace_and_eval(run, (variables, args, kwargs), rules, flow=True)
            except (TypeError, ValueError) as e:
                if entry == "apply":
                    explain_state_dtypes(e, variables, policy)
                raise

    return traced


def _run(
    traced: Callable[[_Call], tuple[Any, Flow]], mode: CallMode, entry: str, model: nn.Module
) -> tuple[Any, Flow, _Call]:
    """`traced`'s result, flow and call record, run as `mode` says, or where that
    fails, once more with a third party's modules' fields as written
    (`casting.run_as_written`, through the one path that runs a call again)."""
    first = _Call(mode)

    def run(call: _Call) -> tuple[Any, Flow, _Call]:
        return (*traced(call), call)

    def refused(error: Exception) -> bool:
        carry = jax_internals.is_loop_carry_type_change(error)
        return carry or (entry == "apply" and first.set_third_party_fields)

    def as_written(error: Exception) -> tuple[Any, Flow, _Call]:
        # A lifted loop (`nn.scan(fn, ...)`, `nn.while_loop`) whose body the
        # fields made change its carry: the engine keeps carries, the fields go.
        carry = jax_internals.is_loop_carry_type_change(error)
        return run(_Call(dataclasses.replace(mode, as_written=True, fields_unset=carry)))

    return casting.run_as_written(lambda: run(first), as_written, refused, model)


def _check_function(fn: Any) -> None:
    if hasattr(fn, "lower") and hasattr(fn, "__wrapped__"):
        raise TypeError(
            "with_policy got a jitted function, whose cached traces would ignore "
            "the policy; jit the result instead: jax.jit(with_policy(fn, policy))."
        )
    if not callable(fn):
        raise TypeError(f"with_policy expects a function as its first argument, got {fn!r}.")
    if isinstance(fn, nn.Module):
        raise TypeError(
            f"with_policy takes a linen model's apply or init (model.apply), got the "
            f"module {type(fn).__name__} itself; use with_policy(model.apply, policy)."
        )
    if isinstance(fn, nnx.Module) or isinstance(getattr(fn, "__self__", None), nnx.Module):
        name = type(getattr(fn, "__self__", fn)).__name__
        raise TypeError(
            "jmp_policy.with_policy is for Flax linen (model.apply / model.init) and "
            f"plain functions, got the NNX module {name}; use jmp_policy.nnx.with_policy"
            "(model, policy) or jmp_policy.nnx.PolicyModule(model, policy)."
        )
