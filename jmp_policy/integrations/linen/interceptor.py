"""The linen method interceptor: each module's policy, dtype fields and product scope.

Every module call of a wrapped call passes through it: it resolves the
module's policy from the rules (else its parent's), sets the module's dtype
fields for the call only, casts the inputs of a module a rule names, and
marks the products of a module whose rule changes them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import flax.linen as nn
import jax

from jmp_policy.core.policy import Policy
from jmp_policy.engine.decision import policy_products
from jmp_policy.engine.interpreter import as_written, product_scope
from jmp_policy.integrations import casting, flax_internals
from jmp_policy.integrations.linen.arguments import _keeper
from jmp_policy.integrations.linen.call import (
    _ACTIVE_POLICY,
    _CALL,
    _Call,
    _module_path,
    declare_collections,
    remember_given,
)
from jmp_policy.integrations.linen.loop_carries import _carry_loop, _restore_carry
from jmp_policy.integrations.linen.remat_norms import _rematerialised, _should_remat
from jmp_policy.integrations.rules import RuleSet


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


def _promotion(module: nn.Module) -> contextlib.AbstractContextManager:
    """Flax's own layers run under the dtype promotion they are written for.

    Standard: Flax's norms lift half inputs to float32 statistics with
    `jnp.promote_types`, and its recurrent cells add their half gates to a
    float32 carry, as a model's own half-precision config does; strict dtype
    promotion, where the caller set it, would reject both.
    """
    if flax_internals.is_flax_module(module) and hasattr(module, "dtype"):
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
        remember_given(module, call.given)
        inherited = _ACTIVE_POLICY.get()
        policy, named = _module_policy(module, rules, inherited, call)
        if call.configured is None and context.method_name != "setup":
            call.configured = flax_internals.configures_dtypes(module)  # The model's own.
        # What the module computes itself: statistics the hand config keeps
        # in float32 stay so; the modules it calls take `policy`.
        own = policy if named else casting.own_policy(module, policy)
        lookup_as_built = casting.looks_up_as_built(
            module, context.method_name, configured=bool(call.configured), named=named
        )
        as_built = own is not policy or lookup_as_built
        overrides = casting.attribute_overrides(module, own, keep_dtype=as_built)
        changes = any(getattr(module, k) is not v for k, v in overrides.items())
        if changes and not flax_internals.is_flax_layer(module):
            if call.mode.as_written:
                overrides = {}
            call.set_third_party_fields = True
        if call.mode.fields_unset:
            overrides = {}
        overrides.update(casting.matmul_overrides(module, own, rewritten=call.mode.rewrite))
        saved = {name: getattr(module, name) for name in overrides}
        token = _ACTIVE_POLICY.set(policy)
        # The model's own call: the first one, `setup` aside (Flax runs it first).
        top = call.mode.model_first and not call.seen_top and context.method_name != "setup"
        call.seen_top = call.seen_top or top
        given = args
        # Inputs keep their dtypes (the layers cast what they compute with),
        # except those of a module a rule names, but not the model's
        # arguments that `keep_inputs` names.
        keep = _keeper(context.orig_method, call.mode.keep_inputs) if top else lambda key: False
        if casting.casts_inputs(module, named):
            args, kwargs = casting.cast_inputs(policy, args, kwargs, keep)
        # Linen modules are frozen dataclasses: set the attributes for the
        # duration of this call only, and put the user's values back after.
        for name, value in overrides.items():
            object.__setattr__(module, name, value)
        # A module whose products take another compute or matmul dtype than
        # its parent's marks them for the op-level rewrite (see `with_policy`).
        products = policy_products(own)
        scoped = call.mode.rewrite and products != call.products[-1]
        scope = product_scope(*products) if scoped else contextlib.nullcontext()
        if lookup_as_built:  # Also by the op-level rewrite, which takes lookups to half.
            scope = as_written()
        call.products.append(products)
        try:
            if remat_norms and _should_remat(module, context.method_name, policy):
                next_fun = _rematerialised(next_fun, call.norm_programs)
            with _promotion(module), scope:
                out = next_fun(*args, **kwargs)
            out = declare_collections(module, call.given, out)
            loop = _carry_loop(module)
            return out if loop is None else _restore_carry(loop, given, out)
        finally:
            for name, value in saved.items():
                object.__setattr__(module, name, value)
            _ACTIVE_POLICY.reset(token)
            call.running.pop()
            call.products.pop()

    return interceptor
