"""What a policy casts, decided once for the linen and NNX integrations.

The rule follows what a model's own half-precision config (`dtype=jnp.bfloat16`
on every layer, by hand) does in Flax:

* Layers compute in the compute dtype: the policy sets each module's `dtype`
  and `param_dtype` attributes (`attribute_overrides`), and Flax's layers cast
  their own inputs and parameters where they compute (`promote_dtype`).
* Values that move between modules (arguments, states, caches, carries,
  timesteps, coordinates) keep the dtype they were given: no module boundary
  casts, except that of a module a rule names (`casts_inputs`), which is
  asked for by the user.
* What goes in and comes back (a cache, a carry, a value passed through)
  keeps its dtype: the output dtype applies to a call's results only, by the
  state rule of `jmp_policy.engine.data_flow`, which `autocast` uses too.
* Under a matmul dtype every product takes it: Flax's dense layers through
  their `dot_general` hook (`matmul_overrides`, which also replaces a
  `dot_general` wired in by hand), every other product (`jnp.einsum`, `@`,
  attention, `nn.Einsum`, third-party layers) through the op-level rewrite of
  `jmp_policy.engine.interpreter.matmuls_in`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import flax.linen as nn
import jax
import numpy as np
from flax import nnx
from jax import lax

from jmp_policy.core import jax_internals
from jmp_policy.core.dtypes import is_complex, is_float
from jmp_policy.core.policy import Policy
from jmp_policy.engine.decision import policy_products
from jmp_policy.engine.interpreter import matmuls_in
from jmp_policy.engine.products.matmul_dtype import (
    asks_full_precision,
    matmul_dot_general,
    traced_dot_general,
)
from jmp_policy.engine.rerun import run_again_where_refused

T = TypeVar("T")

# The dense layers whose `dot_general` hook takes the matmul dtype; `*_cls`
# factories win over the injected function in Flax, so they are cleared.
_DENSE = (nn.Dense, nn.DenseGeneral, nnx.Linear, nnx.LinearGeneral)


def keeps_its_dtypes(module: Any) -> bool:
    """A complex layer (`dtype` or `param_dtype` complex) keeps both under any policy.

    A real policy dtype would silently drop the imaginary part of its inputs
    and parameters.
    """
    return any(is_complex(getattr(module, k, None)) for k in ("dtype", "param_dtype"))


def run_as_written(
    run: Callable[[], T],
    as_written: Callable[[Exception], T],
    refused: Callable[[Exception], bool],
    model: Any,
) -> T:
    """`run()`, or where it fails as `refused` says, `as_written(error)`: the
    call again, a third party's own modules' dtype fields as their author
    wrote them (`rerun`).

    Such a module may keep dtypes in fields of its own that the policy does
    not set (MaxText's rotary `fprop_dtype`) and check that they agree with
    `dtype`. Run as written, every product is still in the policy's dtypes
    (the engine decides); the values between products are in the model's
    own. Says so in a `RuntimeWarning`; where the call fails this way too,
    the first error is raised unchanged (the model's own error).
    """

    def says(error: Exception) -> str:
        return (
            f"jmp_policy: {type(model).__name__} fails with the policy's dtypes in its "
            f"modules' fields ({type(error).__name__}: {error}); it runs with them as "
            "written, every product in the policy's dtypes, the values between products "
            "in the model's own."
        )

    return run_again_where_refused(run, as_written, refused=refused, says=says)


# Modules whose own maths are statistics the model's own half config keeps in
# float32 (it builds them without a `dtype`): SpectralNorm's power iteration.
_FLOAT32_STATISTICS: tuple[type, ...] = (nn.SpectralNorm, nnx.SpectralNorm)


def own_policy(module: Any, policy: Policy) -> Policy:
    """The policy of what `module` computes itself: `policy`, or for a module
    of float32 statistics, its compute dtype at least float32 (the modules it
    wraps still take `policy`)."""
    if not isinstance(module, _FLOAT32_STATISTICS):
        return policy
    return policy.with_compute_dtype(np.promote_types(policy.compute_dtype, np.float32))


def looks_up_as_built(module: Any, method_name: str, *, configured: bool, named: bool) -> bool:
    """Whether a linen `nn.Embed`'s lookup keeps the dtype it was built with.

    In a model that `flax_internals.configures_dtypes`, an embedding built without a `dtype`
    (Hugging Face's) returns its table's dtype in the model's own half
    config, and so does the residual stream it feeds. Its lookup is no
    product: it stays so under the policy, while `attend` (a product) takes
    the compute dtype, as under `autocast`. A rule naming the module sets it.
    """
    return (
        configured
        and not named
        and method_name == "__call__"
        and isinstance(module, nn.Embed)
        and module.dtype is None
    )


def attribute_overrides(module: Any, policy: Policy, *, keep_dtype: bool = False) -> dict[str, Any]:
    """The `dtype` and `param_dtype` attributes a module takes under `policy`
    (`param_dtype` only, with `keep_dtype`: see `looks_up_as_built`).

    A layer whose author asked for `precision=HIGHEST` (or a float32 dot
    algorithm) computes in float32 under every policy: the author's explicit
    precision wins, as it does for a product under `autocast`.
    """
    if keeps_its_dtypes(module):
        return {}
    compute: Any = policy.compute_dtype
    if asks_full_precision(getattr(module, "precision", None)):
        compute = np.promote_types(compute, np.float32)
    overrides = {"dtype": compute, "param_dtype": policy.param_dtype}
    if keep_dtype:
        del overrides["dtype"]
    return {k: v for k, v in overrides.items() if hasattr(module, k)}


def matmul_overrides(module: Any, policy: Policy, *, rewritten: bool = False) -> dict[str, Any]:
    """The attributes through which a Flax layer takes the policy's matmul dtype.

    `dot_general` for the dense layers (replacing one wired in by hand);
    linen attention's `einsum_dot_general`, where its `attention_fn` takes
    one (replacing a hand-wired one too); NNX's `Einsum.einsum_op` and its
    attention's `attention_fn` (rewritten by `matmuls_in`: NNX has no hook
    there, and `jmp_policy.nnx.with_policy` no call to rewrite). Empty without
    a matmul dtype; every other product takes it through the op-level
    rewrite of the call (`matmuls_in`). With `rewritten` (the call is
    rewritten), a dense layer multiplying with `lax.dot_general` is left to
    the rewrite: one product fewer to trace.
    """
    m, scaling, r = policy.matmul_dtype, policy.fp8_scaling, policy_products(policy).results
    dot_general = matmul_dot_general(m, scaling, reduce_dtype=r)
    if dot_general is None:
        return {}
    overrides: dict[str, Any] = {}
    wired = getattr(module, "dot_general", None) not in (None, lax.dot_general) or (
        getattr(module, "dot_general_cls", None) is not None
    )
    if isinstance(module, _DENSE) and (wired or not rewritten):
        overrides["dot_general"] = dot_general
        if hasattr(module, "dot_general_cls"):
            overrides["dot_general_cls"] = None  # Flax prefers the factory.
    if isinstance(module, nn.MultiHeadDotProductAttention) and _takes_dot_general(
        module.attention_fn
    ):
        # Its einsums take the product as a static argument of their jit: one
        # for what FP8 products save in this trace (set per call by linen).
        overrides["attention_fn"] = functools.partial(
            module.attention_fn,
            einsum_dot_general=traced_dot_general(m, scaling, r),
        )
        # Flax rejects these together with einsum_dot_general.
        overrides["qk_attn_weights_einsum_cls"] = None
        overrides["attn_weights_value_einsum_cls"] = None
    if isinstance(module, nnx.Einsum):
        overrides["einsum_op"] = functools.partial(_einsum_as_traced, m, scaling, r)
    if isinstance(module, nnx.MultiHeadAttention):
        # Every layer's attention has the same shapes: Flax's own, which reads
        # nothing but its arguments, shares one rewrite (traced once for all
        # layers). Another may read what changes between calls (a bias, a
        # temperature): rewritten per call, never stale.
        own = module.attention_fn is nnx.dot_product_attention
        overrides["attention_fn"] = matmuls_in(
            module.attention_fn, m, scaling, shared=own, reduce_dtype=r
        )
    return overrides


def _einsum_as_traced(
    matmul_dtype: Any, fp8_scaling: str, reduce_dtype: Any, *args: Any, **kwargs: Any
) -> Any:
    """`jnp.einsum` with the product `traced_dot_general` picks as it is traced
    (NNX sets `einsum_op` once, before any trace)."""
    dot_general = traced_dot_general(matmul_dtype, fp8_scaling, reduce_dtype)
    assert dot_general is not None  # Set only for a policy with a matmul dtype.
    return jax_internals.einsum_with_dot_general(dot_general)(*args, **kwargs)


def _takes_dot_general(attention_fn: Callable) -> bool:
    try:
        return "einsum_dot_general" in inspect.signature(attention_fn).parameters
    except (TypeError, ValueError):
        return False


def casts_inputs(module: Any, named: bool) -> bool:
    """Whether a module's floating inputs are cast to its compute dtype at its boundary.

    Only where a rule names the module: everywhere else the layers cast what
    they compute with, as in a model's own half-precision config.
    """
    return named and not keeps_its_dtypes(module)


def cast_inputs(
    policy: Policy, args: tuple, kwargs: dict, keep: Callable[[int | str], bool]
) -> tuple[tuple, dict]:
    """`args` and `kwargs` with floating inputs cast to compute, except the kept ones."""
    return (
        tuple(a if keep(i) else policy.cast_to_compute(a) for i, a in enumerate(args)),
        {k: v if keep(k) else policy.cast_to_compute(v) for k, v in kwargs.items()},
    )


def name_unfit_state(
    error: Exception, state: dict[str, Any], policy: Policy, front_end: str, what: str, fix: str
) -> None:
    """Raises a `TypeError` naming the state that does not fit the compute
    dtype, if `error` is a dtype mismatch it may come from; else returns.

    A decode cache made float32 (the plain `model.init`, Flax's `init_cache`)
    gets half keys and values written into it under a half policy, and
    `dynamic_update_slice` fails with a message naming neither. `state`: each
    name's variables (a pytree); `what` names them, `fix` says why and the way
    out (`{dtype}` and `{name}` are filled in).
    """
    if not jax_internals.is_dtype_mismatch(error):
        return  # The user's own error, or another of JAX's: it reaches the user unchanged.
    c = np.dtype(policy.compute_dtype)
    unfit = {}
    for name, tree in state.items():
        dtypes = {str(x.dtype) for x in jax.tree.leaves(tree) if is_float(x)}
        if dtypes - {c.name}:
            unfit[name] = sorted(dtypes)
    if unfit:
        names = ", ".join(f"{k!r} ({', '.join(v)})" for k, v in unfit.items())
        raise TypeError(
            f"{front_end}: the model computes in {c.name} under {policy}, and {what} {names} "
            f"do not fit it {fix.format(dtype=c.name, name=next(iter(unfit)))}"
        ) from error
