"""Mixed precision policies for Flax NNX modules (public as `jmp_policy.nnx`).

NNX has no method interceptors, so the policy is applied to the module
itself, once: `with_policy` returns a copy of the module whose submodules have
their `dtype` (computation) and `param_dtype` (storage) attributes set and
whose `nnx.Param`s are cast to the param dtype. Flax's NNX layers cast their
inputs and parameters to `dtype` on every call (`promote_dtype`), so a float32
LayerNorm does not make the next matmul float32: the next Linear casts the
norm's output back. Norms compute in the compute dtype, as in the model's
own half config, except under strict dtype promotion (float32 there).
`PolicyModule` adds the policy at the model's boundary: results to output
(state keeps its dtype), and every product in the matmul dtype. What is cast
is decided with the linen integration in `jmp_policy.integrations.casting`.

Both are plain NNX modules: they work under `nnx.jit`, `nnx.value_and_grad`
and `nnx.Optimizer`, and as the dtypes are static attributes, a jitted step
traces again for a module under another policy (no stale trace).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import types
from collections.abc import Callable, Container, Iterable
from typing import Any, TypeVar, cast

import flax
import jax
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from jmp_policy.core import jax_internals
from jmp_policy.core.dtypes import SCALED_MATMUL_DTYPES
from jmp_policy.core.loss_scale import LossScale
from jmp_policy.core.loss_scaled import get_loss_scale as _get_loss_scale
from jmp_policy.core.policy import Policy, get_policy, policy_argument, to_float_dtype
from jmp_policy.engine.data_flow import Flow, ReturnsState, as_given, cast_results
from jmp_policy.engine.decision import Products, policy_products, product_rules
from jmp_policy.engine.interpreter import flow_recording_runner, product_scope
from jmp_policy.integrations import casting, flax_internals
from jmp_policy.integrations.rules import PolicyLike, Rules, RuleSet, input_names

M = TypeVar("M", bound=nnx.Module)
PathParts = tuple[Any, ...]


# Norms compute in the compute dtype, as in the model's own half config
# (Flax's NNX norms take their statistics in float32 whatever their dtype), so
# a q/k-norm's keys come out in the values' dtype and fit one cache. Under
# strict dtype promotion Flax's NNX norms cannot run in half at all
# (`jnp.promote_types(bfloat16, float32)`): there they compute in float32 unless
# a rule names them; the next NNX layer casts its inputs to its own dtype.
# `PolicyModule` reads the promotion in force when called, `with_policy`'s
# bare copy (which has no call of its own) when made.
_NORMS = (nnx.BatchNorm, nnx.GroupNorm, nnx.InstanceNorm, nnx.LayerNorm, nnx.RMSNorm)


def _norm_policy(policy: Policy) -> Policy:
    if (
        np.dtype(policy.compute_dtype).itemsize >= 4
        or jax.config.jax_numpy_dtype_promotion != "strict"
    ):
        return policy
    return policy.with_compute_dtype(np.float32)


def _configure(module: nnx.Module, policy: Policy) -> dict[str, Any]:
    """Sets `module`'s dtype attributes (and matmul products) to `policy`'s;
    returns the values they had.

    Only attributes the module holds itself: a wrapper that forwards others
    (`nnx.bridge.ToNNX` reads its linen module's) is left as it is.
    """
    overrides = {
        **casting.attribute_overrides(module, policy),
        **casting.matmul_overrides(module, policy),
    }
    had = {}
    for name, value in overrides.items():
        if name in vars(module) and getattr(module, name) is not value:
            had[name] = getattr(module, name)
            setattr(module, name, value)
    return had


def _path_str(path: PathParts) -> str:
    return "/".join(str(p) for p in path)


def _nearest_prefix(path: PathParts, paths: Container[PathParts]) -> PathParts:
    """The longest proper prefix of `path` in `paths`: a node's module, a module's parent."""
    for i in range(len(path) - 1, 0, -1):
        if path[:i] in paths:
            return path[:i]
    return ()


def _module_policies(
    module: nnx.Module, rules: RuleSet, policy: Policy
) -> tuple[dict[PathParts, Policy], set[PathParts]]:
    """The policy of every submodule, by path (its best rule, else its parent's),
    and the paths of the modules a rule names."""
    modules = dict(nnx.iter_modules(module))
    matched: set[str] = set()
    resolved: dict[PathParts, Policy] = {}
    named_paths: set[PathParts] = set()
    for path in sorted(modules, key=len):  # Parents before their children.
        inherited = resolved[_nearest_prefix(path, resolved)] if path else policy
        best, named = rules.policy_for(modules[path], _path_str(path), inherited, matched)
        if named:
            named_paths.add(path)
        resolved[path] = best
    rules.check_all_matched(matched, (_path_str(p) for p in modules), module)
    return resolved, named_paths


def with_policy(module: M, policy: PolicyLike, *, rules: Rules | None = None) -> M:
    """Returns a copy of an NNX module that computes under a mixed precision policy.

    Every submodule that has a `dtype` attribute gets the compute dtype and
    every one with a `param_dtype` attribute the param dtype, also where they
    were `None` or float32 (`nnx.Embed` fills a `dtype` it was not given
    from its table's, so an embedding built without one cannot be told from
    one given float32: a rule keeps it, e.g. `{nnx.Embed: "f32"}`); the
    existing `nnx.Param`s of each module are cast
    to its param dtype. Flax's NNX layers cast their inputs and parameters to
    `dtype` when called, so matmuls take compute-dtype operands (also after a
    float32 norm) while the stored parameters, and hence the gradients and
    the optimizer's updates, stay in the param dtype. Batch statistics and
    other non-`Param` variables keep their dtype (Flax's are float32).

    Normalisation layers (`nnx.LayerNorm`, `RMSNorm`, `BatchNorm`,
    `GroupNorm`, `InstanceNorm`) take the compute dtype like every layer, as
    in the model's own half config: Flax takes their statistics in float32
    and returns the compute dtype, so a q/k-norm's keys fit the values' cache.
    Under strict dtype promotion, where Flax's NNX norms cannot run in half,
    those that no rule names compute in float32 (in the compute dtype if that
    is wider) and return float32; the next NNX layer casts their output back
    to its own dtype, so no matmul becomes float32. A rule naming a norm (e.g.
    `{nnx.LayerNorm: policy}`) overrides this. The copy is configured for the
    promotion in force when it is made; a `PolicyModule` reads it at each call.

    The copy (`nnx.clone`) has new `Variable`s, sharing arrays not cast, so
    the original module is left unchanged, and updating the copy (with an
    `nnx.Optimizer`) does not update the original. Its class, attributes and
    state paths are the module's: checkpoints and optimizers built for the
    module fit it. Its result is in the dtype its last layer computes in;
    wrap it in a `PolicyModule` to get inputs cast to compute and the result
    to output.

    Rules override the policy per module class or path, exactly as in
    `jmp_policy.with_policy` for linen:

    * a class (an `nnx.Module` subclass) matches its subclasses; the nearest
      class in the module's MRO wins;
    * a path pattern (`fnmatch`, where `*` also matches `/`) is matched
      against the module's path from `nnx.iter_modules`, its parts joined by
      `/`, such as `"blocks/0/norm"`; it beats any class rule, and the
      pattern with more literal characters wins; a pattern that matches no
      module is an error (a typo, most likely);
    * remaining ties go to the rule listed first;
    * a module without a matching rule inherits its parent's policy (a norm
      its parent's, computing in at least float32).

    Modules without a `dtype` attribute (custom modules doing their own
    `jnp` maths) compute in the dtype of whatever they are given. A module
    whose `dtype` or `param_dtype` is complex keeps both, and complex
    parameters are never cast: a complex layer stays complex.

    A policy with a `matmul_dtype` (e.g. `"mixed_float8"`) also sets the
    products of `nnx.Linear`, `LinearGeneral`, `Einsum` and the two einsums
    of `nnx.MultiHeadAttention` (`half_dot_general` or `fp8_dot_general`);
    a rule can keep a module out (e.g. `{"head": "mixed_bfloat16"}`).
    Convolutions run in the compute dtype.

    Args:
      module: the `nnx.Module` (a model, or a `PolicyModule`'s `.module`).
      policy: a `Policy` or a spec such as `"mixed_bfloat16"`.
      rules: optional `{nnx.Module subclass or path pattern: Policy or spec}`.

    Returns:
      The configured copy, of the module's own class.

    Raises:
      TypeError: if `module` is not an `nnx.Module`, or a rule key or value
        is of the wrong type.
      ValueError: if a policy spec is malformed or a path pattern matches no
        submodule.

    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import jmp_policy.nnx
    >>> model = nnx.Sequential(
    ...     nnx.Linear(3, 8, rngs=nnx.Rngs(0)), nnx.LayerNorm(8, rngs=nnx.Rngs(0)),
    ...     nnx.Linear(8, 2, rngs=nnx.Rngs(0)))
    >>> mixed = jmp_policy.nnx.with_policy(model, "mixed_bfloat16", rules={"layers/2": "f32"})
    >>> mixed.layers[0].dtype, mixed.layers[0].kernel.dtype, model.layers[0].dtype
    (<class 'jax.numpy.bfloat16'>, dtype('float32'), None)
    >>> mixed(jnp.ones((4, 3))).dtype  # The last Linear computes in float32.
    dtype('float32')
    """
    return cast(M, _with_policy(module, policy, rules)[0])


def _with_policy(
    module: nnx.Module, policy: PolicyLike, rules: Rules | None
) -> tuple[
    nnx.Module,
    dict[PathParts, Policy],
    set[PathParts],
    set[PathParts],
    dict[PathParts, tuple[dict, bool]],
]:
    if not isinstance(module, nnx.Module):
        kind = type(module)
        raise TypeError(
            f"jmp_policy.nnx.with_policy expects a flax.nnx.Module, got a "
            f"{kind.__module__}.{kind.__qualname__}; for a linen model's apply or a "
            "plain function, jmp_policy.with_policy(model.apply, policy)."
        )
    policy = get_policy(policy_argument(policy))
    rule_set = RuleSet(rules, nnx.Module, "blocks/*/norm")
    mixed = nnx.clone(module)
    _rebind_closures(module, mixed)
    policies, named = _module_policies(mixed, rule_set, policy)
    norms = {
        path
        for path, sub in nnx.iter_modules(mixed)
        if isinstance(sub, _NORMS) and path not in named and not casting.keeps_its_dtypes(sub)
    }
    modules = dict(nnx.iter_modules(mixed))
    # What each module computes itself (float32 statistics stay so; the
    # modules it wraps take their own policies).
    policies = {
        path: p if path in named else casting.own_policy(modules[path], p)
        for path, p in policies.items()
    }
    # The fields of every module as its author wrote them, and of a third
    # party's own ones (`casting.run_as_written`).
    written: dict[PathParts, tuple[dict, bool]] = {}
    for path, sub in modules.items():
        if casting.keeps_its_dtypes(sub):
            continue  # Complex parameters are left alone by `cast_to_param` too.
        had = _configure(sub, _norm_policy(policies[path]) if path in norms else policies[path])
        if had:
            written[path] = (had, not flax_internals.is_flax_layer(sub))
    for path, node in nnx.iter_graph(mixed):
        if isinstance(node, nnx.Param):
            value = node.get_value()
            cast = policies[_nearest_prefix(path, modules)].cast_to_param(value)
            if cast is not value:
                node.set_value(cast)
    return mixed, policies, named, norms, written


def _rebind_closures(original: nnx.Module, copy: nnx.Module) -> None:
    """Functions in `copy` that close over `original`'s modules or variables
    (an `attention_fn` reading a learned bias) read `copy`'s instead.

    `nnx.clone` copies the graph but not its functions: they would go on
    reading the original, which training the copy never updates.
    """
    copies = dict(nnx.iter_graph(copy))
    twin = {
        id(node): copies[path]
        for path, node in nnx.iter_graph(original)
        if path in copies and (_is_node(node) or isinstance(node, nnx.Variable))
    }
    for path, value in copies.items():
        if not path or _is_node(value) or not callable(value):
            continue
        parent, rebound = copies[path[:-1]], _rebound(value, twin, set())
        if rebound is not value and isinstance(parent, nnx.Module):
            object.__setattr__(parent, str(path[-1]), rebound)


def _rebound(fn: Any, twin: dict[int, Any], seen: set[int]) -> Any:
    """`fn` with every module or variable of `twin`'s keys it binds replaced by its twin."""
    if id(fn) in seen:
        return fn
    seen.add(id(fn))

    def swap(value: Any) -> Any:
        if id(value) in twin:
            return twin[id(value)]
        return _rebound(value, twin, seen) if callable(value) else value

    if isinstance(fn, functools.partial):
        func, args = swap(fn.func), tuple(map(swap, fn.args))
        keywords = {k: swap(v) for k, v in fn.keywords.items()}
        if func is fn.func and args == fn.args and keywords == fn.keywords:
            return fn
        return functools.partial(func, *args, **keywords)
    if isinstance(fn, types.MethodType):
        owner = swap(fn.__self__)
        return fn if owner is fn.__self__ else types.MethodType(fn.__func__, owner)
    if not isinstance(fn, types.FunctionType) or not fn.__closure__:
        return fn
    try:
        contents = [cell.cell_contents for cell in fn.__closure__]
    except ValueError:  # A cell not filled yet.
        return fn
    swapped = [swap(c) for c in contents]
    if all(a is b for a, b in zip(swapped, contents)):
        return fn
    new = types.FunctionType(
        fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
        tuple(types.CellType(c) for c in swapped),
    )  # fmt: skip
    new.__kwdefaults__, new.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    new.__dict__.update(fn.__dict__)
    return new


class PolicyModule(nnx.Module):
    """An NNX module under a policy, with the policy's casts at its boundary.

    `PolicyModule(module, policy, rules=...)` holds `with_policy(module,
    policy, rules=rules)` as `.module` (a copy: `module` is left unchanged).
    Calling it calls the module and casts the floating results to the output
    dtype; state it returns keeps its dtype (a cache written or grown comes
    back in the dtype it went in), by the rule of `jmp_policy.engine.data_flow`
    that linen's `with_policy` and `autocast` use too, read from the traced
    call; `returns_state` says it where the program cannot. The
    arguments are passed as given, as to the model's own half-precision
    config: NNX layers cast what they compute with, so plain `jnp` maths on
    the inputs (a diffusion model's timestep embedding) keeps their
    precision. Only where a rule names the module are its floating arguments
    cast to the rule's compute dtype, except those `keep_inputs` names;
    integers, booleans and complex arrays never are. Its products are
    decided at the level of operations, whatever the layers' fields say: a
    product whose operands are wider than its module's compute dtype takes
    them in it (a rotary embedding keeping `fprop_dtype`, a linen layer
    behind `nnx.bridge.ToNNX`), and a matmul dtype every product (`@` and
    `jnp.einsum` in model code, attention); under bfloat16 the values
    between products follow `autocast`'s rule (see `product_rules`). A cast
    the model writes to its config's dtype (MaxText's `x.astype(cfg.dtype)`,
    float32 in the float32 config a policy runs, a no-op in its own half
    config) cannot be told from the author's own widening: `config_dtype`
    names it. A module a rule gives other
    dtypes than its parent's traces its methods' products in a
    `product_scope`. Its norms follow the dtype promotion in force at each
    call (float32 under strict, see `with_policy`). Both are set on the copy
    the traced call merges. Where a call fails with the policy's dtypes in a
    third party's own modules' fields (MaxText's prefill checks that its
    keys, in `fprop_dtype`, and values agree), it runs again with those
    fields as written, every product still decided so, and a
    `RuntimeWarning` says so. Its state is the module's under the prefix
    `module`; call other methods through `.module`.

    Under `nnx.scan` the loop carry must keep its dtype: a rule that puts a
    layer of the scanned body in another compute dtype than its parent
    changes it, which NNX (having no method interceptors) cannot undo; that
    call raises a `TypeError` naming the modules and saying to cast the carry
    back in the loop body.

    Args:
      module: the `nnx.Module` to run under the policy.
      policy: a `Policy` or a spec such as `"mixed_bfloat16"`.
      rules: optional per-class or per-path rules, as in `with_policy`.
      keep_inputs: names of arguments of `module.__call__` never cast (where
        a rule names the module, the only case its inputs are cast).
      returns_state: a pytree prefix of the module's result, `True` for a
        part that is state (in the dtype of the argument it is built from,
        else as made), `False` for a result (the output dtype); None (the
        default) lets the state rule decide.
      config_dtype: the dtype the model's own config names for its
        computation where the model casts to it itself: a cast of a half
        value to it leaves it half (its float32-set operations still compute
        in float32), and a product of values so cast takes the policy. None
        (the default): every widening is the author's.

    Raises:
      TypeError, ValueError: as `with_policy`; TypeError if `keep_inputs` is
        not argument names or `config_dtype` not a floating dtype, ValueError
        if it names an argument `module.__call__` does not have; when called,
        as `jmp_policy.engine.data_flow.cast_results`
        for a `returns_state` that does not fit the result.

    >>> import jax, jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import jmp_policy as jmp
    >>> import jmp_policy.nnx
    >>> model = jmp_policy.nnx.PolicyModule(nnx.Linear(3, 2, rngs=nnx.Rngs(0)), "mixed_bfloat16")
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, x):
    ...     loss, grads = nnx.value_and_grad(lambda m: (m(x) ** 2).mean())(model)
    ...     optimizer.update(model, grads)
    ...     return loss
    >>> loss = train_step(model, optimizer, jnp.ones((4, 3)))
    >>> model(jnp.ones((4, 3))).dtype, model.module.kernel.dtype, model.module.dtype
    (dtype('float32'), dtype('float32'), <class 'jax.numpy.bfloat16'>)
    """

    def __init__(
        self,
        module: nnx.Module,
        policy: PolicyLike,
        *,
        rules: Rules | None = None,
        keep_inputs: str | Iterable[str] = (),
        returns_state: ReturnsState = None,
        config_dtype: DTypeLike | None = None,
    ) -> None:
        config = None if config_dtype is None else to_float_dtype(config_dtype, "config_dtype")
        self.policy = get_policy(policy_argument(policy))
        self.returns_state = returns_state
        self.module, policies, named, norms, written = _with_policy(module, self.policy, rules)

        def as_written(third_party_only: bool) -> tuple:
            return tuple(
                (path, tuple(fields.items()))
                for path, (fields, third_party) in sorted(written.items(), key=str)
                if third_party or not third_party_only
            )

        # A third party's own modules' fields, where they fail with the policy's;
        # every module's, where the policy's would change a loop's carry.
        self._as_written, self._all_as_written = as_written(True), as_written(False)
        # The norms' configuration follows the promotion in force at each call.
        self._norms = tuple((path, policies[path]) for path in sorted(norms, key=_path_str))
        # The model's inputs are cast as any layer's: by its own policy (a
        # rule on the model decides), if it is a layer or a rule names it.
        root = self.module
        casts = casting.casts_inputs(root, () in named)
        self.input_policy = policies[()] if casts else None
        # Every product is decided by the op-level rewrite of the call; the
        # modules whose products a rule decides otherwise than their parent's
        # run their methods in a `product_scope` (see `_CallPlan`).
        scaled = any(p.matmul_dtype in SCALED_MATMUL_DTYPES for p in policies.values())
        self._rules = product_rules(policies[()], scaled_scopes=scaled, config_dtype=config)
        self._scoped = tuple(
            (path, policy_products(policies[path]))
            for path in sorted(policies, key=_path_str)
            if path
            and policy_products(policies[path])
            != policy_products(policies[_nearest_prefix(path, policies)])
        )
        self.keep_inputs = input_names(keep_inputs)
        self._positional = _positional_names(type(root).__call__, self.keep_inputs)
        # Modules a rule puts in another compute dtype than their parent's: the
        # ones whose result can change the dtype of a loop carry.
        self._switched = tuple(
            sorted(
                _path_str(p)
                for p in named
                if p
                and policies[p].compute_dtype
                != policies[_nearest_prefix(p, policies)].compute_dtype
            )
        )

    def _keep(self, key: int | str) -> bool:
        if isinstance(key, int):
            return key < len(self._positional) and self._positional[key] in self.keep_inputs
        return key in self.keep_inputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        caller = jax_internals.caller_frame()  # A loop's, where this module is its body.

        def as_written(error: Exception) -> tuple:
            return self._traced(args, kwargs, self._written_after(error), caller)

        try:
            out, flow = casting.run_as_written(
                lambda: self._traced(args, kwargs, (), caller),
                as_written,
                lambda error: bool(self._written_after(error)),
                self.module,
            )
        except Exception as error:
            if not self._written_after(error):
                _explain_cache_dtypes(error, self.module, self.policy)
            raise
        return cast_results(out, flow, self.policy.cast_to_output, returns_state=self.returns_state)

    def _written_after(self, error: Exception) -> tuple:
        """The modules' fields run as written after `error`: every module's where
        the policy's changed a loop's carry, else a third party's own."""
        carry = jax_internals.is_loop_carry_type_change(error)
        return self._all_as_written if carry else self._as_written

    def _traced(
        self, args: tuple, kwargs: dict, as_written: tuple, caller: Any
    ) -> tuple[Any, Flow]:
        """The module's result, run through the engine (its state written back), and its flow."""
        run, flows = flow_recording_runner(self._rules)
        try:
            # Inputs cast inside the traced program: what comes back from one is seen to.
            plan = _CallPlan(self.input_policy, self._keep, self._norms, self._scoped, as_written)
            out = autocast_with_state(run, plan, (self.module, *args), kwargs)
        except TypeError as e:
            if not (jax_internals.is_loop_carry_type_change(e) and self._switched):
                raise
            raise TypeError(
                f"jmp_policy.nnx: the rules put {self._switched} in another compute dtype than "
                "their parent, and inside nnx.scan (or another loop) their result changes the "
                "dtype of the loop's carry. NNX has no method interceptors to cast it back: "
                "cast the carry back in the loop body (e.g. `return block(x).astype(x.dtype)`), "
                "or drop the rule."
            ) from e
        return out, flows[-1].called_with(args, caller)


@dataclasses.dataclass(frozen=True)
class _CallPlan:
    """A `PolicyModule` call of its module, on the copy the traced call merges.

    So what it sets there (the norms' dtypes for the promotion in force now,
    the product scopes) is gone with the trace, and the caller's module is
    left as it is.
    """

    input_policy: Policy | None  # Casts the inputs not kept, where a rule names the model.
    keep: Callable[[int | str], bool]
    norms: tuple[tuple[PathParts, Policy], ...]
    scoped: tuple[tuple[PathParts, Products], ...]
    as_written: tuple[tuple[PathParts, tuple], ...]  # (path, its fields as written)

    def __call__(self, module: nnx.Module, *args: Any, **kwargs: Any) -> Any:
        needed = self.norms or self.scoped or self.as_written
        modules = dict(nnx.iter_modules(module)) if needed else {}
        for path, fields in self.as_written:
            for name, value in fields:
                setattr(modules[path], name, value)
        written = {path for path, _ in self.as_written}
        for path, norm_policy in self.norms:
            if path not in written:  # A norm run as written stays so (a loop's carry).
                _configure(modules[path], _norm_policy(norm_policy))
        for path, products in self.scoped:
            _run_in_product_scope(modules[path], products)
        policy, keep = self.input_policy, self.keep
        if policy is not None:
            args = tuple(a if keep(i) else policy.cast_to_compute(a) for i, a in enumerate(args))
            kwargs = {k: v if keep(k) else policy.cast_to_compute(v) for k, v in kwargs.items()}
        return module(*args, **kwargs)


def _run_in_product_scope(module: nnx.Module, products: Products) -> None:
    """Makes `module`'s own methods trace their products in `product_scope(*products)`."""
    flax_internals.run_methods_in(module, product_scope, products)


def _positional_names(method: Callable, names: frozenset[str]) -> tuple[str, ...]:
    """The names of `module.__call__`'s positional arguments (`self` aside).

    Raises:
      ValueError: if one of `names` is not an argument of the method.
    """
    params = list(inspect.signature(method).parameters.values())[1:]
    unknown = sorted(names - {p.name for p in params})
    if unknown:
        raise ValueError(
            f"keep_inputs names {unknown[0]!r}, which is not an argument of "
            f"{method.__qualname__}; its arguments are {[p.name for p in params]}."
        )
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in params if p.kind in kinds)


def get_loss_scale(optimizer: nnx.Optimizer | Any) -> LossScale:
    """Returns the current `LossScale` of an `nnx.Optimizer` (or of its `opt_state`).

    `nnx.Optimizer` keeps each array of the optax state in an `OptState`
    variable; `jmp_policy.get_loss_scale(optimizer.opt_state)` finds the loss
    scale but returns it with those variables as its leaves. This returns it
    with plain arrays, as for an optax state.

    Raises:
      ValueError: if the state holds no `LossScaledState`, or more than one.

    >>> import jax.numpy as jnp, optax
    >>> from flax import nnx
    >>> import jmp_policy as jmp
    >>> import jmp_policy.nnx
    >>> tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15))
    >>> optimizer = nnx.Optimizer(nnx.Linear(2, 2, rngs=nnx.Rngs(0)), tx, wrt=nnx.Param)
    >>> jmp_policy.nnx.get_loss_scale(optimizer).loss_scale
    Array(32768., dtype=float32)
    """
    state = optimizer.opt_state if isinstance(optimizer, nnx.Optimizer) else optimizer
    return _get_loss_scale(nnx.as_pure(state))


def _is_node(x: Any) -> bool:
    return nnx.graph.is_graph_node(x)


def autocast_with_state(run: Callable, fn: Callable, args: tuple, kwargs: dict) -> Any:
    """`autocast`'s call of `fn` when it is, or is given, NNX modules (graph nodes).

    NNX modules update their state in place (BatchNorm statistics, `Rngs`
    counters); an update made while `autocast` traces `fn` would belong to
    that trace. So the modules are split (`nnx.split`), a pure function of
    their state is traced and run, and the new state is written back
    (`nnx.update`), eagerly as under `nnx.jit`. A module that `fn` closes over
    is not seen: it gets a `TypeError` saying to pass it as an argument.
    """
    method_of = getattr(fn, "__self__", None) if inspect.ismethod(fn) else None
    head, call = (method_of, getattr(fn, "__func__", None)) if _is_node(method_of) else (fn, None)
    leaves, treedef = jax.tree.flatten((head, args, kwargs), is_leaf=_is_node)
    at = [i for i, leaf in enumerate(leaves) if _is_node(leaf)]
    if not at:
        try:
            return run(fn, args, kwargs)
        except flax.errors.TraceContextError as e:
            raise TypeError(
                "autocast: the function updates the state of an NNX module it closes "
                "over; pass the module as an argument (autocast(fn, policy)(model, x)) "
                "or autocast the module itself (autocast(model, policy)(x))."
            ) from e
    nodes = [leaves[i] for i in at]
    graphdef, state = nnx.split(nodes)
    others = [None if i in at else leaf for i, leaf in enumerate(leaves)]

    def pure(traced_state, others):
        new_nodes = nnx.merge(graphdef, traced_state)
        given = {id(v.get_value()) for v in _variables(new_nodes)}
        full = list(others)
        for i, node in zip(at, new_nodes):
            full[i] = node
        head, a, k = jax.tree.unflatten(treedef, full)
        out = head(*a, **k) if call is None else call(head, *a, **k)
        # What the call updates (statistics, PRNG counters, caches), in the
        # dtypes the variables have: only the variables it wrote, as plain
        # NNX would. Writing back the others would fail where they belong to
        # another trace (a module a jitted function closes over, a state
        # merged inside `jax.grad`).
        updated = nnx.state(new_nodes, lambda _, v: id(v.get_value()) not in given)
        return out, as_given(updated, state)

    out, new_state = run(pure, (state, others), {})
    nnx.update(nodes, new_state)
    return out


def _variables(nodes: Any) -> list[nnx.Variable]:
    return [v for _, v in nnx.iter_graph(nodes) if isinstance(v, nnx.Variable)]


def _explain_cache_dtypes(error: Exception, module: nnx.Module, policy: Policy) -> None:
    """Raises a `TypeError` naming the cache variables, if a dtype error may come from them."""
    caches = {
        jax.tree_util.keystr(path, simple=True, separator="/").removesuffix("/value"): x
        for path, x in jax.tree_util.tree_leaves_with_path(nnx.state(module, nnx.Cache))
    }
    casting.name_unfit_state(
        error, caches, policy, "jmp_policy.nnx", "its cache variables",
        "(Flax's init_cache makes float32 ones by default): make them in {dtype}, e.g. "
        "init_cache(shape, dtype=jnp.{dtype}), as the hand-written half-precision model would.",
    )  # fmt: skip
