"""`with_policy`: a policy applied as a function transform over Flax linen modules.

Flax linen modules take `dtype` (computation) and `param_dtype` (storage)
attributes. `with_policy` sets them on every module as it is called, through
a linen method interceptor, so a model written without precision in mind
runs under any policy, as its own hand-written half-precision config would:
Flax's layers cast what they compute with, values moving between modules
keep their dtypes (`jmp_policy.integrations.casting` decides, for linen and
NNX alike), and the carries of lifted loops (`nn.scan`, `nn.RNN`,
`nn.while_loop`) keep theirs. Every product's dtype is decided by the
op-level rewrite of the call (`matmuls_in`), the fields being only the usual
route: a product whose operands are wider than its module's compute dtype
takes it, and under a matmul dtype every product takes that; a module whose
rule changes either marks its products with a name scope (`product_scope`).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import inspect
import itertools
import re
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import flax.linen as nn
import flax.linen.module
import flax.linen.transforms
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jmp_policy.core import jax_internals
from jmp_policy.core.autocast import policy_products, product_rules
from jmp_policy.core.dtypes import SCALED_MATMUL_DTYPES, is_float
from jmp_policy.core.interpreter import product_scope, trace_and_eval
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.core.residuals import traced_for
from jmp_policy.core.state import Flow, ReturnsState, as_given, cast_results, keep_carry
from jmp_policy.integrations import casting
from jmp_policy.integrations.rules import PolicyLike, Rules, RuleSet, input_names

# The policy of the module being called; children without a rule inherit it.
_ACTIVE_POLICY: contextvars.ContextVar[Policy] = contextvars.ContextVar("policy")


_TRACE_KEYS: Iterator[int] = itertools.count(1)


@dataclasses.dataclass
class _Call:
    """What one call of a wrapped function records and needs while it runs."""

    keep_inputs: frozenset[str]
    rewrite: bool = False  # Products are decided by the op-level rewrite (not in `init`).
    # A third party's own modules keep their dtype fields as written (`casting.run_as_written`).
    as_written: bool = False
    # Whether the policy set a dtype field of a third party's own module.
    set_third_party_fields: bool = False
    top: bool = True  # The next intercepted call is the model's own (its inputs).
    # Whether the model has a dtype config (`casting.configures_dtypes`); None
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
    products: list[tuple] = dataclasses.field(default_factory=list)
    # `nn.jit` keys its traces on it (see `_nn_jit_keyed_on_the_call`).
    trace_key: int = dataclasses.field(default_factory=lambda: next(_TRACE_KEYS))
    # The variables bound to each model (a root scope, by id): their arrays'
    # ids, and their structure and shapes (seen again inside a `jax.jit`).
    bound: dict[int, tuple[set[int], Any]] = dataclasses.field(default_factory=dict)


_CALL: contextvars.ContextVar[_Call] = contextvars.ContextVar("call")
_LINEN_ENTRIES = ("apply", "init", "init_with_output")
# Norms whose only variables are parameters; under a half policy they are
# recomputed in the backward pass (see `with_policy`). Exact classes: a
# subclass may add state or submodules.
_REMAT_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


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


def _module_policy(
    module: nn.Module, rules: RuleSet, inherited: Policy, call: _Call
) -> tuple[Policy, bool]:
    """`(policy, whether a rule named the module)`; records the module's path."""
    path = _module_path(module, call)
    call.running.append(path)
    call.paths.add("/".join(path))
    policy, named = rules.policy_for(module, "/".join(path), inherited, call.matched)
    call.owners[path] = policy
    return policy, named


# Flax's lifted transforms name themselves in the debug path of the scope they
# create for their body (e.g. "remat(scan(blocks))", innermost first). Those
# that only wrap the body leave its signature as it is.
_TRANSPARENT_LIFTS = frozenset(
    {"remat", "checkpoint", "jit", "vmap", "map_variables", "named_call"}
)
_LIFT_NAME = re.compile(r"([A-Za-z_]\w*)\(")


def _carry_loop(module: nn.Module) -> str | None:
    """'scan' or 'while_loop' if this call is the body of that lifted loop, else None.

    A lifted transform runs its body on a module bound to a new root scope
    (no parent, but the module's path), whose debug path names the
    transforms. Children of the body have a parent scope: only the body's
    own call returns the carry.
    """
    scope = module.scope
    if scope is None or scope.parent is not None or not scope.path:
        return None
    debug_path = getattr(scope, "debug_path", ())
    for name in _LIFT_NAME.findall(debug_path[-1] if debug_path else ""):
        if name in ("scan", "while_loop"):
            return name
        if name not in _TRANSPARENT_LIFTS:
            return None
    return None


def _restore_carry(loop: str, given_args: tuple, out: Any) -> Any:
    """The body's result with its carry in the dtypes the loop gave it.

    A scan body is `(carry, *xs) -> (carry, ys)`, a while-loop body
    `carry -> carry`: JAX requires the carry to come out as it went in. The
    body computes under the policy (a half carry for half layers, float32
    for a float32 rule or parameter); the carry keeps the dtypes the model
    gave it (e.g. the float32 state of `LSTMCell.initialize_carry`), as the
    state rule keeps a loop body's carry (`keep_carry`).
    """
    if not given_args:
        return out
    return keep_carry(out, "while_loop" if loop == "while_loop" else "scan", given_args[0])


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


def _rematerialised(next_fun: Callable, traced: dict[tuple, Callable]) -> Callable:
    """`next_fun` under `jax.checkpoint`: its internals are recomputed, not saved.

    Only the norm's (half) input and its parameters are saved for the backward
    pass, instead of the float32 copies of the input that the statistics
    need. Flax lets a module read its variables inside a JAX transform (not
    create them: `_should_remat` leaves those calls alone).

    The norms of a deep model are one program many times over: each call is
    traced to a jaxpr (its parameters become arguments), and calls with the
    same jaxpr share one checkpointed function (in `traced`), so JAX
    differentiates and transposes the rematerialised program once, not per
    layer.
    """

    def checkpointed(*args, **kwargs):
        inputs = jax.tree.leaves((args, kwargs))
        if not all(isinstance(x, (jax.Array, np.ndarray)) for x in inputs):
            # A Python value may steer the norm's code: trace it as it is.
            return jax.checkpoint(lambda: next_fun(*args, **kwargs))()
        program, out_shape = jax.make_jaxpr(lambda a, k: next_fun(*a, **k), return_shape=True)(
            args, kwargs
        )
        # Constants (the parameters) are arguments: programs of one key share.
        fn: Callable = functools.partial(_evaluate, program.jaxpr)
        key = jax_internals.program_key(program.jaxpr)
        if key is not None:
            fn = traced.setdefault(key, fn)
        outs = jax.checkpoint(fn)(list(program.consts), inputs)
        return jax.tree.unflatten(jax.tree.structure(out_shape), outs)

    return checkpointed


def _evaluate(jaxpr: jax_internals.Jaxpr, consts: list, args: list) -> list:
    return jax_internals.eval_jaxpr(jaxpr, consts, args, jax_internals.bind)


def _should_remat(module: nn.Module, method_name: str, policy: Policy) -> bool:
    return (
        type(module) in _REMAT_NORMS
        and method_name == "__call__"
        and jax.numpy.finfo(policy.compute_dtype).bits < 32
        and not module.is_initializing()
        and not module.is_mutable_collection("params")
    )


def _promotion(module: nn.Module) -> contextlib.AbstractContextManager:
    """Flax's own layers run under the dtype promotion they are written for.

    Standard: Flax's norms lift half inputs to float32 statistics with
    `jnp.promote_types`, and its recurrent cells add their half gates to a
    float32 carry, as a model's own half-precision config does; strict dtype
    promotion, where the caller set it, would reject both.
    """
    if casting.is_flax_module(module) and hasattr(module, "dtype"):
        return jax.numpy_dtype_promotion("standard")
    return contextlib.nullcontext()


def _make_interceptor(rules: RuleSet, remat_norms: bool) -> Callable:
    def interceptor(next_fun, args, kwargs, context):
        # `setup` included: parameters created there (nn.Embed's) must take the
        # module's param dtype, also where a rule changes it.
        name = context.method_name
        module = context.module
        if (name.startswith("__") and name != "__call__") or module.scope is None:
            # Flax intercepts a module's own `__getattr__` too, which reading
            # its `dtype` below would call again; and a method of an unbound
            # module (an `apply` or `init` a model overrides), which binds it
            # and calls the module's own methods, intercepted then.
            return next_fun(*args, **kwargs)
        call = _CALL.get()
        scope = module.scope
        if scope is not None and scope.parent is None and id(scope) not in call.bound:
            call.bound[id(scope)] = _identity(module.variables)
        inherited = _ACTIVE_POLICY.get()
        policy, named = _module_policy(module, rules, inherited, call)
        if call.configured is None and context.method_name != "setup":
            call.configured = casting.configures_dtypes(module)  # The model's own.
        # What the module computes itself: statistics the hand config keeps
        # in float32 stay so; the modules it calls take `policy`.
        own = policy if named else casting.own_policy(module, policy)
        as_built = own is not policy or casting.looks_up_as_built(
            module, context.method_name, configured=bool(call.configured), named=named
        )
        overrides = casting.attribute_overrides(module, own, keep_dtype=as_built)
        if overrides and not casting.is_flax_layer(module):
            if call.as_written:
                overrides = {}
            call.set_third_party_fields = True
        overrides.update(casting.matmul_overrides(module, own, rewritten=call.rewrite))
        saved = {name: getattr(module, name) for name in overrides}
        token = _ACTIVE_POLICY.set(policy)
        # The model's own call: the first one, `setup` aside (Flax runs it first).
        top = call.top and context.method_name != "setup"
        call.top = call.top and not top
        given = args
        # Inputs keep their dtypes (the layers cast what they compute with),
        # except those of a module a rule names, but not the model's
        # arguments that `keep_inputs` names.
        keep = _keeper(context.orig_method, call.keep_inputs) if top else lambda key: False
        if casting.casts_inputs(module, named):
            args, kwargs = casting.cast_inputs(policy, args, kwargs, keep)
        # Linen modules are frozen dataclasses: set the attributes for the
        # duration of this call only, and put the user's values back after.
        for name, value in overrides.items():
            object.__setattr__(module, name, value)
        # A module whose products take another compute or matmul dtype than
        # its parent's marks them for the op-level rewrite (see `with_policy`).
        products = policy_products(own)
        scoped = call.rewrite and products != call.products[-1]
        scope = product_scope(*products) if scoped else contextlib.nullcontext()
        call.products.append(products)
        try:
            if remat_norms and _should_remat(module, context.method_name, policy):
                next_fun = _rematerialised(next_fun, call.norm_programs)
            with _promotion(module), scope:
                out = next_fun(*args, **kwargs)
            loop = _carry_loop(module)
            return out if loop is None else _restore_carry(loop, given, out)
        finally:
            for name, value in saved.items():
                object.__setattr__(module, name, value)
            _ACTIVE_POLICY.reset(token)
            call.running.pop()
            call.products.pop()

    return interceptor


def _nn_jit_keyed_on_the_call() -> None:
    """Makes `nn.jit` trace a method again for each call under a policy, per module path.

    `nn.jit` keys its traces on a module's fields and scope (not its path),
    and the interceptor runs inside the trace: a method traced without a
    policy (or under another, or for a layer another rule names) would serve
    this call, silently, and its modules would not be seen by the rules. So
    under a policy the key also holds the call and the module's path. Flax's
    key is private: if it moves, `test_linen.py`'s nn.jit tests say so.
    """
    proxy = getattr(flax.linen.transforms, "_HashableProxy", None)
    from_module = getattr(proxy, "from_module", None)
    if from_module is None or getattr(from_module, "_jmp_policy", False):
        return

    def keyed(cls: type, module: nn.Module) -> Any:
        key = from_module(module)
        call = _CALL.get(None)
        if call is None:
            return key
        where = (call.trace_key, tuple(str(p) for p in module.path))
        return dataclasses.replace(key, hash_key=hash((key.hash_key, where)))

    keyed._jmp_policy = True  # type: ignore[attr-defined]
    proxy.from_module = classmethod(keyed)  # type: ignore[union-attr]


_nn_jit_keyed_on_the_call()


def _linen_entry(fn: Callable) -> str | None:
    """'apply', 'init' or 'init_with_output' for a bound linen method, else None."""
    if isinstance(getattr(fn, "__self__", None), nn.Module):
        name = getattr(fn, "__name__", None)
        return name if name in _LINEN_ENTRIES else None
    return None


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
    entry = _linen_entry(fn)
    if entry == "init":
        return True
    if entry == "init_with_output" or (entry == "apply" and _returns_collections(kwargs)):
        return (None, True)
    return None


def collections_as_given(collections: Any, variables: Any) -> Any:
    """The collections `apply` returns, each variable given in `variables` in
    the dtype it was given (`jmp_policy.core.state.as_given`)."""
    if not isinstance(collections, Mapping) or not isinstance(variables, Mapping):
        return collections
    return as_given(flax.core.unfreeze(dict(collections)), flax.core.unfreeze(dict(variables)))


def apply_keeping_variables(run: Callable, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`autocast`'s call of a linen `apply` that returns collections: the
    variables given come back in their dtypes; `NotImplemented` for any other call."""
    if _linen_entry(fn) != "apply" or not _returns_collections(kwargs):
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
    and `autocast` use too (`jmp_policy.core.state`), read from the traced
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
    the compute dtype too. Products already in it run as written. Where a
    third party's module fails with the policy's dtypes in its own fields
    (MaxText's checks that its keys, in `fprop_dtype`, and values agree),
    the call runs again with them as written, every product still decided
    so, and a `RuntimeWarning` says so.

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

    Returns:
      The wrapped function. Jit it (`jax.jit(with_policy(...))`): a jitted
      wrapped function and a jitted unwrapped one never share a trace.

    Raises:
      TypeError: if `fn` is already jitted (jit the result instead), is an NNX
        module (or is given one), or a rule key or value or `keep_inputs` is
        of the wrong type.
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
    policy = get_policy(policy)
    rule_set = RuleSet(rules, nn.Module, "decoder/*/LayerNorm_*")
    if not isinstance(remat_norms, bool):
        raise TypeError(f"remat_norms must be True or False, got {remat_norms!r}.")
    keep_inputs = input_names(keep_inputs)
    interceptor = _make_interceptor(rule_set, remat_norms)
    matmul_dtypes = (policy.matmul_dtype, *rule_set.matmul_dtypes)
    scaled = any(m in SCALED_MATMUL_DTYPES for m in matmul_dtypes)
    target, bound_args, bound_kwargs = _unwrap_partial(fn)
    entry = _linen_entry(target)
    op_rules = product_rules(policy, scaled_scopes=scaled)

    def to_output(out: Any, flow: Flow) -> Any:
        return cast_results(out, flow, policy.cast_to_output, returns_state=returns_state)

    if entry is None:
        return _plain_function(fn, policy, interceptor, keep_inputs, scaled, to_output)

    def run(first, args, kwargs):
        return target(first, *args, **kwargs)

    model: nn.Module = target.__self__  # type: ignore[attr-defined]  # A bound linen method.
    made_key = (policy, tuple(rule_set.rules))

    def read_as_made(variables: Any, args: tuple, kwargs: dict, call: _Call) -> Any:
        """`variables` with each parameter in the dtype the model makes it in under the policy."""
        if not isinstance(variables, Mapping) or "params" not in variables:
            return variables
        key = (*made_key, call.as_written)
        dtypes = _MADE.get(model, key, args, kwargs)
        if dtypes is None:
            dtypes = _made_dtypes(model, policy, interceptor, args, kwargs, call)
            _MADE.put(model, key, args, kwargs, dtypes)
        return {**variables, "params": _read_in(variables["params"], dtypes)}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        args, kwargs = (*bound_args, *args), {**bound_kwargs, **kwargs}
        # The first argument is the variables (apply) or the PRNG key (init):
        # variables keep their dtypes; modules cast their parameters.
        first, args, kwargs = _split_first(entry, args, kwargs)

        def traced(call: _Call) -> tuple[Any, Flow]:
            variables = read_as_made(first, args, kwargs, call) if entry == "apply" else first
            values = (variables, args, kwargs) if scaled else ()
            with _calling(policy, call, interceptor, values):
                try:
                    return trace_and_eval(
                        run,
                        (variables, args, kwargs),
                        op_rules if call.rewrite else None,
                        flow=True,
                    )
                except (TypeError, ValueError) as e:
                    if entry == "apply":
                        _explain_state_dtypes(e, variables, policy)
                    raise

        # `init`'s products are never seen: only its parameters are kept.
        call = _Call(keep_inputs=keep_inputs, rewrite=entry != "init")
        try:
            result, flow = traced(call)
        except Exception as error:
            if entry != "apply" or not call.set_third_party_fields:
                raise
            call = _Call(keep_inputs=keep_inputs, rewrite=True, as_written=True)
            result, flow = casting.run_as_written(error, lambda: traced(call), model)
        if "method" not in kwargs:
            # A whole-model call met every module: a pattern that matched none is a typo.
            rule_set.check_all_matched(call.matched, call.paths, getattr(target, "__self__", None))
        if entry != "apply":
            made = result if entry == "init" else result[1]
            if isinstance(made, Mapping) and "params" in made:
                _MADE.put(model, (*made_key, False), args, kwargs, _dtypes_by_path(made["params"]))
                own = _own_draws(target, entry, (first, args, kwargs), made["params"])
                made = _params_to_owner_dtypes({**made, "params": own}, call.owners, policy)
            return made if entry == "init" else (to_output(result[0], flow), made)
        if _returns_collections(kwargs):
            out, collections = result
            return to_output(out, flow), collections_as_given(collections, first)
        return to_output(result, flow)

    return wrapped


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

    made = _Call(frozenset(), as_written=call.as_written)
    try:
        with _without_callers_interceptors(), _calling(policy, made, interceptor):
            try:
                shapes = _shapes_of(init, args, kwargs)
            except TypeError as e:
                # A float32 model refuses to write into a half cache it is given;
                # its parameters are made alike with the cache in float32.
                if not jax_internals.is_write_dtype_mismatch(e):
                    raise
                shapes = _shapes_of(init, *_widened((args, kwargs)))
    except Exception as e:  # Raised unchanged (a user's own error), with where it arose.
        call.set_third_party_fields = made.set_third_party_fields
        e.add_note(
            f"with_policy was running {type(model).__name__}.init abstractly with the "
            "arguments of this apply, to learn the dtype each parameter is made in under "
            "the policy (a layer may make its parameters in `dtype`)."
        )
        raise
    return _dtypes_by_path(shapes.get("params", {}))


@contextlib.contextmanager
def _without_callers_interceptors() -> Iterator[None]:
    """Flax's method interceptors set aside: the abstract `init` is not the caller's call.

    Flax keeps them in a private stack; if it moves, they see that `init`
    (`test_user_interceptors_see_each_norm_once` says so).
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
    the model (held weakly; equal linen modules share), the policy and rules,
    and the call's structure and dtypes (not its shapes: `init` on a small
    batch serves `apply` on any).
    """

    def __init__(self) -> None:
        self._by_model: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @staticmethod
    def _key(key: Any, args: tuple, kwargs: dict) -> Any:
        kwargs = {k: v for k, v in kwargs.items() if k not in _APPLY_ONLY}
        leaves, treedef = jax.tree.flatten((args, kwargs))
        arrays = (jax.Array, np.ndarray)
        values = tuple(np.dtype(x.dtype) if isinstance(x, arrays) else x for x in leaves)
        full = (key, treedef, values)
        try:
            hash(full)
        except TypeError:
            return None
        return full

    def get(self, model: Any, key: Any, args: tuple, kwargs: dict) -> dict[str, Any] | None:
        full = self._key(key, args, kwargs)
        try:
            return None if full is None else self._by_model.get(model, {}).get(full)
        except TypeError:  # A model that cannot be held weakly, or hashed.
            return None

    def put(self, model: Any, key: Any, args: tuple, kwargs: dict, dtypes: dict) -> None:
        full = self._key(key, args, kwargs)
        try:
            if full is not None:
                self._by_model.setdefault(model, {})[full] = dtypes
        except TypeError:
            pass


_MADE = _MadeDtypes()


def _check_function(fn: Any) -> None:
    if hasattr(fn, "lower") and hasattr(fn, "__wrapped__"):
        raise TypeError(
            "with_policy got a jitted function, whose cached traces would ignore "
            "the policy; jit the result instead: jax.jit(with_policy(fn, policy))."
        )
    if not callable(fn):
        raise TypeError(f"with_policy expects a function as its first argument, got {fn!r}.")
    if isinstance(fn, nnx.Module) or isinstance(getattr(fn, "__self__", None), nnx.Module):
        name = type(getattr(fn, "__self__", fn)).__name__
        raise TypeError(
            "jmp_policy.with_policy is for Flax linen (model.apply / model.init) and "
            f"plain functions, got the NNX module {name}; use jmp_policy.nnx.with_policy"
            "(model, policy) or jmp_policy.nnx.PolicyModule(model, policy)."
        )


@contextlib.contextmanager
def _calling(
    policy: Policy, call: _Call, interceptor: Callable, values: Any = ()
) -> Iterator[None]:
    """The context of one call of a wrapped function: its policy, its record, the
    interceptor; FP8 products traced inside (in jitted functions too) save what
    the derivatives of `values` (the call's arguments, under an FP8 policy) need."""
    token = _ACTIVE_POLICY.set(policy)
    call_token = _CALL.set(call)
    call.products.append(policy_products(policy))  # The rewrite's own, outside every scope.
    try:
        with nn.intercept_methods(interceptor), traced_for(jax.tree.leaves(values)):
            yield
    finally:
        _ACTIVE_POLICY.reset(token)
        _CALL.reset(call_token)


def _plain_function(
    fn: Callable,
    policy: Policy,
    interceptor: Callable,
    keep_inputs: frozenset[str],
    scaled: bool,
    to_output: Callable[[Any, Flow], Any],
) -> Callable:
    """`with_policy` of a function that is not a linen entry point (a `lambda` around apply)."""
    keep = _keeper(fn, keep_inputs)
    op_rules = product_rules(policy, scaled_scopes=scaled)

    def call_fn(args: tuple, kwargs: dict) -> Any:
        # The function's floating arguments are its inputs, except Flax
        # variables (a mapping with "params"): modules cast their parameters
        # themselves, and `batch_stats` stay float32. Cast inside the traced
        # program, what comes back from an argument is seen to.
        variables = [k for k in (*range(len(args)), *kwargs) if _is_variables((args, kwargs), k)]
        keeps = lambda k: keep(k) or k in variables  # noqa: E731
        cast_args, cast_kwargs = casting.cast_inputs(policy, args, kwargs, keeps)
        out = fn(*cast_args, **cast_kwargs)
        _check_bound_as_variables(variables, args, kwargs, _CALL.get())
        return out

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        _refuse_nnx_modules(args, kwargs)
        call = _Call(frozenset(), rewrite=True, top=False)
        with _calling(policy, call, interceptor, (args, kwargs) if scaled else ()):
            out, flow = trace_and_eval(call_fn, (args, kwargs), op_rules, flow=True)
        return to_output(out, flow)

    return wrapped


def _shapes_of(fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`jax.eval_shape(fn, *args, **kwargs)`, only the arrays abstract (a
    `train=False` flag stays a Python value)."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    at = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray))]

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

    A parameter the model draws in its `dtype` (`self.param(..., self.dtype)`)
    or in a half param dtype is drawn in half under the policy: its values
    are the plain `init`'s, cast after. Only then is `init` run a second time;
    which parameters differ is read from an abstract plain `init`. Arguments
    only the policy's model takes (a half cache the float32 model would
    write float32 into) are given to it in float32.

    Raises:
      The plain `init`'s own error, with a note, where it cannot run.
      ValueError: if it makes other parameters than the policy's.
    """
    first, args, kwargs = call

    def plain(*a: Any, **k: Any) -> Any:
        out = target(first, *a, **k)
        return (out if entry == "init" else out[1])["params"]

    try:
        own = _shapes_of(plain, args, kwargs)
    except (TypeError, ValueError) as error:
        args, kwargs = _widened((args, kwargs))
        try:
            own = _shapes_of(plain, args, kwargs)
        except Exception:
            error.add_note(
                "with_policy was running the model's own init (also with its floating "
                "arguments in float32) to draw its parameters as it does."
            )
            raise error from None
    own_leaves, made_leaves = _by_path(own), _by_path(made)
    if {k: x.shape for k, x in own_leaves.items()} != {k: x.shape for k, x in made_leaves.items()}:
        raise ValueError(
            "with_policy: the model makes other parameters under the policy than its own "
            "init does (a shape or structure that follows a dtype), so its own draws "
            "cannot stand in for the policy's."
        )
    if all(made_leaves[k].dtype.itemsize >= x.dtype.itemsize for k, x in own_leaves.items()):
        return made  # The same draws.
    return plain(*args, **kwargs)


def _widened(tree: Any) -> Any:
    """`tree`, its floating arrays narrower than float32 in float32."""

    def widen(x: Any) -> Any:
        if is_float(x) and np.dtype(x.dtype).itemsize < 4:
            return jnp.asarray(x, np.float32)
        return x

    return jax.tree.map(widen, tree)


def _explain_state_dtypes(error: Exception, variables: Any, policy: Policy) -> None:
    """Raises a `TypeError` naming the collections, if a dtype error may come from them.

    A decode cache made by the plain `model.init` is float32; under a half
    policy the model writes half keys and values into it, and Flax's
    `dynamic_update_slice` fails with a message naming neither.
    """
    if not jax_internals.is_dtype_mismatch(error) or not isinstance(variables, Mapping):
        return  # The user's own error, or another of JAX's: it reaches the user unchanged.
    c = np.dtype(policy.compute_dtype)
    mismatched = {}
    for name, tree in variables.items():
        if name in ("params", "batch_stats"):
            continue
        dtypes = {str(x.dtype) for x in jax.tree.leaves(tree) if is_float(x)}
        if dtypes - {c.name}:
            mismatched[name] = sorted(dtypes)
    if not mismatched:
        return
    names = ", ".join(f"{k!r} ({', '.join(v)})" for k, v in mismatched.items())
    raise TypeError(
        f"with_policy: the model computes in {c.name} under {policy}, and the "
        f"collections {names} do not fit it (a decode cache made by the plain "
        "model.init is float32): make them with jmp_policy.with_policy(model.init, "
        "policy), as the hand-written half-precision model would, or cast them, e.g. "
        f"jax.tree.map(lambda x: x.astype(jnp.{c.name}), variables[{next(iter(mismatched))!r}])."
    ) from error


def _unwrap_partial(fn: Callable) -> tuple[Callable, tuple, dict]:
    """`(function, bound args, bound kwargs)` of a (nested) `functools.partial`."""
    args: tuple = ()
    kwargs: dict = {}
    while isinstance(fn, functools.partial):
        args, kwargs = (*fn.args, *args), {**fn.keywords, **kwargs}
        fn = fn.func
    return fn, args, kwargs


def _is_variables(args_kwargs: tuple[tuple, dict], key: int | str) -> bool:
    args, kwargs = args_kwargs
    value = args[key] if isinstance(key, int) else kwargs[key]
    return isinstance(value, Mapping) and "params" in value


def _identity(tree: Any) -> tuple[set[int], Any]:
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {id(x) for _, x in flat}, [(jax.tree_util.keystr(p), np.shape(x)) for p, x in flat]


def _check_bound_as_variables(keys: list, args: tuple, kwargs: dict, call: _Call) -> None:
    """Raises unless each argument left uncast as Flax variables was a model's variables:
    its arrays, or (through a `jax.jit`) variables of its structure and shapes."""
    for key in keys:
        value = args[key] if isinstance(key, int) else kwargs[key]
        ids, layout = _identity(value)
        if ids and not any(ids & seen or layout == same for seen, same in call.bound.values()):
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
