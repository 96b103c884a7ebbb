"""Half-precision norms rematerialised: recomputed in the backward pass (`remat_norms`)."""

from __future__ import annotations

import functools
from collections.abc import Callable

import flax.linen as nn
import jax
import numpy as np

from jmp_policy.core import jax_internals
from jmp_policy.core.policy import Policy

# Norms whose only variables are parameters; under a half policy they are
# recomputed in the backward pass (see `with_policy`). Exact classes: a
# subclass may add state or submodules.
_REMAT_NORMS = (nn.GroupNorm, nn.LayerNorm, nn.RMSNorm)


def _should_remat(module: nn.Module, method_name: str, policy: Policy) -> bool:
    return (
        type(module) in _REMAT_NORMS
        and method_name == "__call__"
        and jax.numpy.finfo(policy.compute_dtype).bits < 32
        and not module.is_initializing()
        and not module.is_mutable_collection("params")
    )


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
