"""`with_policy`: a policy applied as a function transform over Flax linen modules.

Flax linen modules take `dtype` (computation) and `param_dtype` (storage)
attributes. `with_policy` sets them on every module as it is called, through
a linen method interceptor, so a model written without precision in mind
runs under any policy. A module's floating inputs are cast to its compute
dtype as well: without that, the float32 output of a float32 LayerNorm would
promote the next matmul back to float32 (a silent loss of Tensor Cores).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from jmp_policy.core.autocast import matmuls_in
from jmp_policy.core.matmul import matmul_dot_general
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.integrations.rules import PolicyLike, Rules, RuleSet

# The policy of the module being called; children without a rule inherit it.
_ACTIVE_POLICY: contextvars.ContextVar[Policy] = contextvars.ContextVar("policy")
# The module paths seen and the rules' path patterns matched during the current call.
_SEEN: contextvars.ContextVar[tuple[set[str], set[str]]] = contextvars.ContextVar("seen")
_LINEN_ENTRIES = ("apply", "init", "init_with_output")
# Flax's norms lift half inputs to float32 statistics with `jnp.promote_types`,
# which strict dtype promotion rejects; they are written for standard promotion
# (equinox runs its norms the same way).
_FLAX_NORMS = (nn.BatchNorm, nn.GroupNorm, nn.InstanceNorm, nn.LayerNorm, nn.RMSNorm)
# Norms whose only variables are parameters; under a half policy they are
# recomputed in the backward pass (see `with_policy`). Exact classes: a
# subclass may add state or submodules.
_REMAT_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


def _module_policy(module: nn.Module, rules: RuleSet, inherited: Policy) -> Policy:
    path = "/".join(str(p) for p in module.path)
    paths, matched = _SEEN.get((set(), set()))
    paths.add(path)
    return rules.policy_for(module, path, inherited, matched)[0]


def _attribute_overrides(module: nn.Module, policy: Policy) -> dict[str, Any]:
    overrides = {"dtype": policy.compute_dtype, "param_dtype": policy.param_dtype}
    return {k: v for k, v in overrides.items() if hasattr(module, k)}


def _attention_fn_with(attention_fn: Callable, policy: Policy) -> Callable:
    """`attention_fn` with its two einsums taking the policy's matmul dtype."""
    dot_general = matmul_dot_general(policy.matmul_dtype)
    try:
        takes_dot_general = "einsum_dot_general" in inspect.signature(attention_fn).parameters
    except (TypeError, ValueError):
        takes_dot_general = False
    if takes_dot_general:  # nn.dot_product_attention, or a partial of it.
        return functools.partial(attention_fn, einsum_dot_general=dot_general)
    return matmuls_in(attention_fn, policy.matmul_dtype)  # Any other function.


def _matmul_overrides(module: nn.Module, policy: Policy) -> dict[str, Any]:
    """The attributes through which `module` takes the policy's matmul dtype.

    `dot_general` for Dense and DenseGeneral (attention's projections are
    DenseGeneral children, each under its own policy); attention's
    `attention_fn` for its two einsums. A `*_cls` factory would win over the
    injected function in Flax: the policy clears it. Empty without a matmul
    dtype. Only Flax's layers: a user module's own `dot_general` field is
    passed on to children that have their own policy (a rule may keep one
    out of FP8), so it is left alone. `nn.Einsum` has no hook (flax 0.12.8):
    it multiplies in the compute dtype.
    """
    dot_general = matmul_dot_general(policy.matmul_dtype)
    if dot_general is None:
        return {}
    overrides: dict[str, Any] = {}
    if isinstance(module, (nn.Dense, nn.DenseGeneral)):
        overrides["dot_general"] = dot_general
        overrides["dot_general_cls"] = None
    if isinstance(module, nn.MultiHeadDotProductAttention):
        overrides["attention_fn"] = _attention_fn_with(module.attention_fn, policy)
        # Flax rejects these together with einsum_dot_general.
        overrides["qk_attn_weights_einsum_cls"] = None
        overrides["attn_weights_value_einsum_cls"] = None
    return overrides


def _rematerialised(next_fun: Callable) -> Callable:
    """`next_fun` under `jax.checkpoint`: its internals are recomputed, not saved.

    Only the norm's (half) input and its parameters are saved for the backward
    pass, instead of the float32 copies of the input that the statistics
    need. Flax lets a module read its variables inside a JAX transform (not
    create them: `_should_remat` leaves those calls alone).
    """
    return lambda *args, **kwargs: jax.checkpoint(lambda: next_fun(*args, **kwargs))()


def _should_remat(module: nn.Module, method_name: str, policy: Policy) -> bool:
    return (
        type(module) in _REMAT_NORMS
        and method_name == "__call__"
        and jax.numpy.finfo(policy.compute_dtype).bits < 32
        and not module.is_initializing()
        and not module.is_mutable_collection("params")
    )


def _make_interceptor(rules: RuleSet, remat_norms: bool) -> Callable:
    def interceptor(next_fun, args, kwargs, context):
        # `setup` included: parameters created there (nn.Embed's) must take the
        # module's param dtype, also where a rule changes it.
        module = context.module
        policy = _module_policy(module, rules, _ACTIVE_POLICY.get())
        overrides = _attribute_overrides(module, policy)
        overrides.update(_matmul_overrides(module, policy))
        saved = {name: getattr(module, name) for name in overrides}
        token = _ACTIVE_POLICY.set(policy)
        # Linen modules are frozen dataclasses: set the attributes for the
        # duration of this call only, and put the user's values back after.
        for name, value in overrides.items():
            object.__setattr__(module, name, value)
        promotion = (
            jax.numpy_dtype_promotion("standard")
            if isinstance(module, _FLAX_NORMS)
            else contextlib.nullcontext()
        )
        try:
            if remat_norms and _should_remat(module, context.method_name, policy):
                next_fun = _rematerialised(next_fun)
            with promotion:
                return next_fun(*policy.cast_to_compute(args), **policy.cast_to_compute(kwargs))
        finally:
            for name, value in saved.items():
                object.__setattr__(module, name, value)
            _ACTIVE_POLICY.reset(token)

    return interceptor


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


def _returns_state(kwargs: dict) -> bool:
    mutable = kwargs.get("mutable", False)
    return bool(mutable) or bool(kwargs.get("capture_intermediates", False))


def with_policy(
    fn: Callable, policy: PolicyLike, *, rules: Rules | None = None, remat_norms: bool = True
) -> Callable:
    """Returns `fn` running under a mixed precision policy.

    For a Flax linen `model.apply`, every module computes in the compute dtype
    (its `dtype` attribute is set for the call, also where it was `None` or
    float32) and its floating inputs are cast to that dtype; parameters stay
    stored in the param dtype and are cast inside each module, so gradients
    come back in the param dtype. The model's inputs are cast to compute and
    its result to output; mutable collections (`batch_stats`) are returned as
    the modules keep them (float32). `model.init` and `model.init_with_output`
    create parameters in the param dtype. Any other function has its floating
    arguments cast to compute and its result to output.

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

    A policy with a `matmul_dtype` (`"p=f32,c=bf16,o=f32,m=bf16"`,
    `"mixed_float8"`) also sets the products of Flax's `Dense`,
    `DenseGeneral` (attention's projections) and attention's two einsums
    (`attention_fn`): `half_dot_general` (float32 accumulation) or
    `fp8_dot_general`, forward and backward, replacing a `dot_general`
    wired into those layers; a rule can keep a module out (e.g.
    `{"head": "mixed_bfloat16"}`). Convolutions and `nn.Einsum` (no hook)
    run in the compute dtype.

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

    Returns:
      The wrapped function. Jit it (`jax.jit(with_policy(...))`): a jitted
      wrapped function and a jitted unwrapped one never share a trace.

    Raises:
      TypeError: if `fn` is already jitted (jit the result instead), or a rule
        key or value is of the wrong type.
      ValueError: if a policy spec is malformed; when called, if a path pattern
        matches no module of a whole-model call.

    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> import jmp_policy as jmp
    >>> model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(2)])
    >>> x = jnp.ones((4, 3))
    >>> variables = jmp.with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    >>> apply = jmp.with_policy(model.apply, "mixed_bfloat16", rules={"layers_2": "f32"})
    >>> variables["params"]["layers_0"]["kernel"].dtype, apply(variables, x).dtype
    (dtype('float32'), dtype('float32'))
    """
    if hasattr(fn, "lower") and hasattr(fn, "__wrapped__"):
        raise TypeError(
            "with_policy got a jitted function, whose cached traces would ignore "
            "the policy; jit the result instead: jax.jit(with_policy(fn, policy))."
        )
    if not callable(fn):
        raise TypeError(f"with_policy expects a function as its first argument, got {fn!r}.")
    policy = get_policy(policy)
    rule_set = RuleSet(rules, nn.Module, "decoder/*/LayerNorm_*")
    if not isinstance(remat_norms, bool):
        raise TypeError(f"remat_norms must be True or False, got {remat_norms!r}.")
    interceptor = _make_interceptor(rule_set, remat_norms)
    entry = _linen_entry(fn)
    # Rules may store some modules' parameters in another dtype; then each
    # module's `param_dtype` decides and init casts nothing afterwards.
    cast_params = rule_set.param_dtypes <= {policy.param_dtype}

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = _ACTIVE_POLICY.set(policy)
        paths: set[str] = set()
        matched: set[str] = set()
        seen_token = _SEEN.set((paths, matched))
        try:
            with nn.intercept_methods(interceptor):
                if entry is None:
                    args, kwargs = policy.cast_to_compute((args, kwargs))
                    return policy.cast_to_output(fn(*args, **kwargs))
                # The first argument is the variables (apply) or the PRNG key
                # (init): variables keep their dtypes; modules cast parameters.
                first, args, kwargs = _split_first(entry, args, kwargs)
                args, kwargs = policy.cast_to_compute((args, kwargs))
                result = fn(first, *args, **kwargs)
        finally:
            _ACTIVE_POLICY.reset(token)
            _SEEN.reset(seen_token)
        if entry is not None and "method" not in kwargs:
            # A whole-model call met every module: a pattern that matched none is a typo.
            rule_set.check_all_matched(matched, paths, fn.__self__)
        if entry == "init":
            return _params_to_param_dtype(result, policy) if cast_params else result
        if entry == "init_with_output":
            out, variables = result
            if cast_params:
                variables = _params_to_param_dtype(variables, policy)
            return policy.cast_to_output(out), variables
        if _returns_state(kwargs):
            out, state = result
            return policy.cast_to_output(out), state
        return policy.cast_to_output(result)

    return wrapped


def _params_to_param_dtype(variables: Any, policy: Policy) -> Any:
    # Modules without a `param_dtype` attribute create float32 parameters.
    if "params" not in variables:
        return variables
    return {**variables, "params": policy.cast_to_param(variables["params"])}
