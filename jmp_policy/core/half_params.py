"""Half-precision parameters that still learn: Kahan-compensated or
stochastically rounded updates.

A bfloat16 weight has 8 significant bits: an update below half its ulp
(1/512 of the weight, or less) rounds away, and at small learning rates most
updates do. `half_param_updates` wraps an optax optimizer so that the updates
it returns, applied with the ordinary `optax.apply_updates` to half-precision
parameters, give the rounding of a float32 accumulation instead:

* "kahan": a compensation buffer, in the parameter's own half dtype, holds
  what the last rounding lost and adds it back (compensated summation, as in
  the optimi library for PyTorch). Weight and buffer together carry about
  twice the dtype's significant bits: 16 for bfloat16, 22 for float16.
* "stochastic": the float32 result is rounded up or down at random with the
  probabilities that make it unbiased (as in torchao's bfloat16 optimizers;
  Zamirai et al., "Revisiting BFloat16 Training", 2020). No buffer, one PRNG
  key.

Float32 (and any non-half) parameters pass through untouched, with no state.
"""

from __future__ import annotations

import operator
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

_HALF_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(jnp.float16))
_METHODS = ("kahan", "stochastic")


def _is_half(x: Any) -> bool:
    return hasattr(x, "dtype") and np.dtype(x.dtype) in _HALF_DTYPES


def _is_masked(x: Any) -> bool:
    return isinstance(x, optax.MaskedNode)


def _saturate(x: jax.Array, dtype: Any) -> jax.Array:
    """Clips float32 `x` to `dtype`'s finite range, so rounding cannot overflow
    to infinity (float16's range ends at 65504); NaN stays NaN."""
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -big, big)


def _step_to(p: jax.Array, new_p: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The half-precision update from `p` to `new_p`, and where it lands.

    `optax.apply_updates` computes `p + u` in the parameters' dtype. The
    difference of two half values is exact in float32 and, whenever `new_p` is
    within a factor 2 of `p` (Sterbenz), also in the half dtype, so `p + u`
    is exactly `new_p`. Otherwise (a weight collapsing towards or crossing
    zero in one step) `u` may round, and the landing point is off by at most
    half an ulp of `u`: it is computed here with the very same operation as
    optax, so the caller knows it bit for bit.
    """
    diff = new_p.astype(jnp.float32) - p.astype(jnp.float32)
    u = _saturate(diff, p.dtype).astype(p.dtype)
    return u, (p + u).astype(p.dtype)


def _kahan_leaf(comp: Any, p: Any, u: Any) -> tuple[Any, Any]:
    if _is_masked(comp):
        return u, comp
    # The float32 accumulation the half weight and its buffer stand for. The
    # two small terms first: their sum is exact more often.
    target = p.astype(jnp.float32) + (comp.astype(jnp.float32) + u.astype(jnp.float32))
    nearest = _saturate(target, p.dtype).astype(p.dtype)
    step, landed = _step_to(p, nearest)
    # What rounding (and, rarely, an inexact step) left out, carried forward.
    new_comp = _saturate(target - landed.astype(jnp.float32), p.dtype).astype(p.dtype)
    return step, new_comp


def _stochastic_round(target: jax.Array, dtype: Any, key: jax.Array) -> jax.Array:
    """Rounds float32 `target` to one of its two neighbours in `dtype`, up
    with probability (target - down) / (up - down): unbiased."""
    target = _saturate(target, dtype)
    nearest = target.astype(dtype)
    near32 = nearest.astype(jnp.float32)
    away = jnp.where(near32 < target, jnp.inf, -jnp.inf).astype(dtype)
    other = jnp.nextafter(nearest, away)
    down = jnp.minimum(nearest, other)
    up = jnp.maximum(nearest, other)
    down32, up32 = down.astype(jnp.float32), up.astype(jnp.float32)
    span = up32 - down32
    # Exact in float32: both are half values, target lies between them.
    prob_up = (target - down32) / jnp.where(span > 0, span, 1.0)
    draw = jax.random.uniform(key, target.shape, jnp.float32)
    rounded = jnp.where(draw < prob_up, up, down)
    # Already representable (or NaN, or a zero-width span): no coin to toss.
    exact = (near32 == target) | ~(span > 0) | ~jnp.isfinite(span)
    return jnp.where(exact, nearest, rounded)


def _stochastic_leaf(p: Any, u: Any, key: jax.Array) -> Any:
    target = p.astype(jnp.float32) + u.astype(jnp.float32)
    step, _ = _step_to(p, _stochastic_round(target, p.dtype, key))
    return step


def _to_float32(x: Any) -> Any:
    return x.astype(jnp.float32) if _is_half(x) else x


def _store_like(new: Any, old: Any, key: jax.Array) -> Any:
    """Casts the new inner state back to the dtypes of the old: half leaves
    stochastically rounded, others (counts, float32 moments) as they are."""
    new_leaves, treedef = jax.tree.flatten(new)
    old_leaves = treedef.flatten_up_to(old)
    keys = jax.random.split(key, max(len(new_leaves), 1))
    out = []
    for i, (n, o) in enumerate(zip(new_leaves, old_leaves)):
        if _is_half(o):
            n = _stochastic_round(n.astype(jnp.float32), o.dtype, keys[i])
        elif hasattr(n, "dtype") and hasattr(o, "dtype") and n.dtype != o.dtype:
            n = n.astype(o.dtype)
        out.append(n)
    return jax.tree.unflatten(treedef, out)


class HalfParamState(NamedTuple):
    """State of `half_param_updates`.

    Attributes:
      inner_state: the wrapped transformation's state.
      compensation: for "kahan", a tree shaped like the parameters: a buffer
        in the parameter's dtype for each half-precision leaf (what rounding
        lost, still to be applied), an `optax.MaskedNode` (no memory) for the
        others. For "stochastic", a single `optax.MaskedNode`.
      key: for "stochastic", the raw PRNG key data (uint32, from
        `jax.random.key_data`), split once per step; for "kahan", an
        `optax.MaskedNode`.
    """

    inner_state: Any
    compensation: Any
    key: Any


def half_param_updates(
    inner: optax.GradientTransformation,
    method: str = "kahan",
    seed: int = 0,
) -> optax.GradientTransformationExtraArgs:
    """Makes half-precision (bfloat16, float16) parameters learn like float32 ones.

    For each half-precision parameter `p`, with `u` the update of `inner`
    (any dtype), the float32 value `p + u` (plus the compensation, for
    "kahan") is rounded to `p`'s dtype, and the update returned is the half
    difference that makes `optax.apply_updates(params, updates)` land on that
    rounding exactly:

    * "kahan" rounds to nearest and keeps the rounding error in a half buffer
      that joins the next update. An update far below half an ulp of its
      weight adds up in the buffer until it moves the weight, so a bfloat16
      weight follows the float32 sum to about 16 significant bits (22 for
      float16). Below that the buffer rounds too: an update under about
      2**-16 of its weight (bfloat16) is lost, one near it is applied with
      the buffer's rounding error (a few percent). Extra memory: one half
      value per half parameter.
    * "stochastic" rounds up or down at random, so the expected parameter is
      the float32 result: small updates are applied on average. Extra
      memory: one PRNG key.

    Float32 and other non-half parameters get `inner`'s updates untouched,
    with no state and no extra work. The update landing exactly needs the new
    value within a factor 2 of the old (true of any ordinary step); a weight
    collapsing towards or across zero in one step may land up to half an ulp
    of the step off (for "kahan", the buffer takes up the difference).
    Values beyond the half dtype's range saturate at its largest finite
    value instead of overflowing (float16: 65504).

    The inner state keeps the dtypes `inner.init` gave it (optax computes
    moments of half parameters with float32 gradients in float32). With a
    loss scale, wrap this transformation in `loss_scaled`, not the other way
    round: a skipped step then leaves the buffer and the key bit-for-bit
    unchanged.

    Recipes (bfloat16 parameters; bytes per parameter of parameters plus
    optimizer state; float32 master weights with float32 moments: 12 for
    Adam):

    * Adam/AdamW: `half_param_updates(optax.adamw(lr))` keeps both moments
      in the parameters' dtype: 2 + 2 (buffer) + 4 = 8 bytes.
    * SGD with momentum: `optax.sgd(lr, momentum=0.9)`: 2 + 2 + 2 = 6 bytes.
    * Lion: `optax.lion(lr)`: 2 + 2 + 2 = 6 bytes.
    * Adafactor: factored second moments (a row and a column per matrix):
      about 4 bytes, plus `dtype_momentum` if `momentum` is set.
    With "stochastic", subtract the 2 bytes of the buffer.

    Args:
      inner: the optimizer whose updates to apply, e.g. `optax.adamw(1e-4)`.
      method: "kahan" (deterministic, one half buffer per half parameter) or
        "stochastic" (random, no buffer).
      seed: for "stochastic", seeds the PRNG key (a non-negative integer);
        ignored by "kahan".

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `HalfParamState`. Its `update` needs `params`.

    Raises:
      TypeError: if `inner` is not an optax transformation or `seed` is not an
        integer.
      ValueError: if `method` is not "kahan" or "stochastic", or `seed` is
        negative; from `update`, if `params` is None.

    References: Kahan, "Further remarks on reducing truncation errors" (1965);
    Zamirai et al., "Revisiting BFloat16 Training" (2020); optimi's Kahan
    summation; torchao's bfloat16 stochastic rounding.

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy as jmp
    >>> tx = jmp.half_param_updates(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": -jnp.ones(2, jnp.bfloat16)}  # updates of +1e-4
    >>> for _ in range(1000):
    ...     updates, state = tx.update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"]  # float32 gives 1.1; plain bfloat16 stays at 1
    Array([1.10156, 1.10156], dtype=bfloat16)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        hint = " (call it: e.g. optax.adam(1e-3))" if callable(inner) else ""
        raise TypeError(
            f"inner must be an optax GradientTransformation such as optax.adam(1e-3), "
            f"got {inner!r}{hint}."
        )
    if method not in _METHODS:
        raise ValueError(f"method must be 'kahan' or 'stochastic', got {method!r}.")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)):
        raise TypeError(f"seed must be a non-negative integer, got {seed!r}.")
    if seed < 0:
        raise ValueError(f"seed must be a non-negative integer, got {seed!r}.")
    seed = operator.index(seed)
    inner = optax.with_extra_args_support(inner)

    def init(params):
        if method == "kahan":
            compensation = jax.tree.map(
                lambda p: jnp.zeros_like(p) if _is_half(p) else optax.MaskedNode(), params
            )
        else:
            compensation = optax.MaskedNode()
        key = jax.random.key_data(jax.random.key(seed))
        return HalfParamState(inner.init(params), compensation, key)

    def update(updates, state, params=None, **extra_args):
        if params is None:
            raise ValueError(
                "half_param_updates needs the parameters: call "
                "tx.update(grads, opt_state, params) with params, got params=None."
            )
        key, params_key, state_key = jax.random.split(jax.random.wrap_key_data(state.key), 3)
        # `inner` computes in float32 for half parameters: their gradients,
        # the parameters themselves (weight decay) and half state leaves.
        updates = jax.tree.map(
            lambda g, p: g.astype(jnp.float32) if _is_half(p) and _is_half(g) else g,
            updates,
            params,
        )
        new_updates, inner_state = inner.update(
            updates, jax.tree.map(_to_float32, state.inner_state), jax.tree.map(_to_float32, params),
            **extra_args,
        )
        inner_state = _store_like(inner_state, state.inner_state, state_key)

        leaves, treedef = jax.tree.flatten(params)
        update_leaves = treedef.flatten_up_to(new_updates)
        if method == "kahan":
            comp_leaves = treedef.flatten_up_to(state.compensation)
            pairs = [_kahan_leaf(*leaf) for leaf in zip(comp_leaves, leaves, update_leaves)]
            new_updates = jax.tree.unflatten(treedef, [u for u, _ in pairs])
            compensation = jax.tree.unflatten(treedef, [c for _, c in pairs])
        else:
            keys = jax.random.split(params_key, max(len(leaves), 1))
            out = [
                _stochastic_leaf(p, u, keys[i]) if _is_half(p) else u
                for i, (p, u) in enumerate(zip(leaves, update_leaves))
            ]
            new_updates, compensation = jax.tree.unflatten(treedef, out), state.compensation
        return new_updates, HalfParamState(inner_state, compensation, jax.random.key_data(key))

    return optax.GradientTransformationExtraArgs(init, update)
