"""The optax wrapper: unscale, check, skip non-finite steps, adjust the scale."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from jmp_policy.core.loss_scale import LossScale, all_finite, select_tree, unscale_exactly


class LossScaledState(NamedTuple):
    """State of `loss_scaled`.

    Which counter counts what: every `update` call is one step; a skipped
    (non-finite) step adds 1 to `total_notfinite` and leaves `inner_state`
    bit for bit unchanged, so the inner optimizer's own step count (e.g.
    `count` in `optax.adam`'s state) counts applied steps only, and a
    schedule given to the inner optimizer does not advance on a skipped step.
    A counter outside the optimizer that advances on every call (flax
    `TrainState.step`, `nnx.Optimizer.step`) counts all steps: applied steps
    are that counter minus `total_notfinite` (see "Which counter counts
    applied steps" in docs/guides/policies.md for a `TrainState` kept at
    applied steps).

    Both counters are int32 and saturate at 2**31 - 1 (as optax's
    `safe_increment`), they do not wrap around.

    Attributes:
      loss_scale: the current `LossScale` (find it with `get_loss_scale`).
      inner_state: the wrapped transformation's state.
      notfinite_count: non-finite steps in a row (0 after a finite step).
      total_notfinite: non-finite (skipped) steps since `init`.

    >>> import jax.numpy as jnp, optax
    >>> import jmp_policy as jmp
    >>> schedule = lambda count: -0.1  # any optax schedule reads the same count
    >>> tx = jmp.loss_scaled(optax.scale_by_schedule(schedule), jmp.NoOpLossScale())
    >>> state = tx.init({"w": jnp.ones(2)})
    >>> for g in (1.0, jnp.nan, 1.0):  # the second step is skipped
    ...     _, state = tx.update({"w": jnp.full(2, g)}, state)
    >>> int(state.total_notfinite), int(state.inner_state.count)  # skipped, applied
    (1, 2)
    """

    loss_scale: LossScale
    inner_state: Any
    notfinite_count: jax.Array
    total_notfinite: jax.Array


def loss_scaled(
    inner: optax.GradientTransformation,
    loss_scale: LossScale,
    *,
    axis_name: Any = None,
) -> optax.GradientTransformationExtraArgs:
    """Wraps an optimizer for gradients of a loss scaled by a `LossScale`.

    `update` receives the gradients of `loss_scale.scale(loss)`. It divides
    them by the scale (in float32; the updates leave in the dtypes plain
    optax gives, the inner state in its own), checks they are all finite and only then
    lets `inner` see them, so clipping, weight decay, accumulation and
    schedules inside `inner` work on true gradients. On a non-finite step it
    returns zero updates and keeps `inner`'s state bit for bit (schedules do
    not advance); unlike `optax.apply_if_finite` it never gives up and applies
    a non-finite update. Last, the loss scale is adjusted. The inner
    optimizer's step count is thus the count of applied steps (see
    `LossScaledState` for which counter counts what).

    With `NoOpLossScale` (bfloat16, float32) the wrapper adds only the
    finiteness check and the skip to the step.

    Args:
      inner: the optimizer to wrap, e.g. `optax.adamw(1e-3)`.
      loss_scale: the initial `NoOpLossScale`, `StaticLossScale` or
        `DynamicLossScale`.
      axis_name: inside `shard_map`/`pmap` with per-device gradients, the
        axis to agree on finiteness over, so all devices skip together.

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `LossScaledState`.

    Raises:
      TypeError: if `inner` is not an optax transformation or `loss_scale`
        is not a `LossScale`; from `update`, if its `state` is not a
        `LossScaledState` (e.g. the inner optimizer's own state).

    References: Micikevicius et al., "Mixed Precision Training" (2018);
    PyTorch's `GradScaler.step`/`update`; Keras' `LossScaleOptimizer`.

    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_policy as jmp
    >>> tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(2.0**15))
    >>> params = {"w": jnp.ones(2)}
    >>> state = tx.init(params)
    >>> grads = {"w": jnp.array([jnp.inf, 1.0])}  # an overflow: skipped
    >>> updates, state = tx.update(grads, state, params)
    >>> updates["w"], float(jmp.get_loss_scale(state).loss_scale)
    (Array([-0., -0.], dtype=float32), 16384.0)
    """
    if not (callable(getattr(inner, "init", None)) and callable(getattr(inner, "update", None))):
        hint = " (call it: e.g. optax.adam(1e-3))" if callable(inner) else ""
        raise TypeError(
            f"inner must be an optax GradientTransformation such as optax.adam(1e-3), "
            f"got {inner!r}{hint}."
        )
    if not isinstance(loss_scale, LossScale):
        # DeepMind's jmp has classes of the same names: say whose they are.
        of = type(loss_scale).__module__.split(".")[0]
        raise TypeError(
            "loss_scale must be jmp_policy's NoOpLossScale, StaticLossScale or "
            f"DynamicLossScale, got {loss_scale!r} (a {of}.{type(loss_scale).__qualname__})."
        )
    inner = optax.with_extra_args_support(inner)

    def init(params):
        return LossScaledState(
            loss_scale=loss_scale,
            inner_state=inner.init(params),
            notfinite_count=jnp.zeros([], jnp.int32),
            total_notfinite=jnp.zeros([], jnp.int32),
        )

    def update(grads, state, params=None, **extra_args):
        if not isinstance(state, LossScaledState):
            # A state from another optimizer (e.g. the inner one's `init`)
            # would otherwise fail deep inside with an AttributeError.
            raise TypeError(
                "loss_scaled(...).update: state must be the LossScaledState returned by "
                f"this transformation's init (or a previous update), got a "
                f"{type(state).__name__}: {_short_repr(state)}."
            )
        given = grads
        grads = unscale_exactly(state.loss_scale, grads)
        finite = all_finite(grads, axis_name=axis_name)
        updates, inner_state = inner.update(grads, state.inner_state, params, **extra_args)
        # Half gradients are unscaled to float32, from which optax computes
        # float32 moments and updates: both leave in the dtypes they would
        # have without the wrapper (`eqx.apply_updates` would promote half parameters).
        inner_state = jax.tree.map(_as_dtype_of, inner_state, state.inner_state)
        updates = _as_dtypes_of(updates, given, params)
        # -0.0, not 0.0: p + (-0.0) == p bit for bit, signed zeros included.
        with jax.named_scope("jmp_policy_skip_step"):
            skip_updates = jax.tree.map(lambda u: jnp.full_like(u, -0.0), updates)
            updates = select_tree(finite, updates, skip_updates)
            inner_state = select_tree(finite, inner_state, state.inner_state)
        notfinite = (~finite).astype(jnp.int32)
        return updates, LossScaledState(
            loss_scale=state.loss_scale.adjust(finite),
            inner_state=inner_state,
            notfinite_count=_saturating_add(state.notfinite_count, notfinite) * notfinite,
            total_notfinite=_saturating_add(state.total_notfinite, notfinite),
        )

    return optax.GradientTransformationExtraArgs(init, update)


def _saturating_add(count: jax.Array, inc: jax.Array) -> jax.Array:
    # Like optax.safe_increment: stays at int32's maximum instead of wrapping
    # to -2**31 (after 2**31 - 1 skipped steps, e.g. a run stuck on NaNs).
    # XLA's integer add wraps, so for inc >= 0 a wrapped sum is below `count`
    # and the max keeps `count` (one op, no comparison against the limit).
    return jax.lax.max(count, count + inc)


def _short_repr(x: Any, limit: int = 120) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _as_dtype_of(new: Any, old: Any) -> Any:
    if hasattr(new, "dtype") and hasattr(old, "dtype") and new.dtype != old.dtype:
        return new.astype(old.dtype)
    return new


def _as_dtypes_of(updates: Any, grads: Any, params: Any) -> Any:
    """`updates` in the dtypes optax gives without the wrapper: the gradients'
    floating dtypes, promoted with the parameters' where they are given (an
    optimizer's state is made in theirs). Trees of other structures as they are."""
    if params is None:
        params = grads

    def as_plain(u: Any, g: Any, p: Any) -> Any:
        if not (_is_float(u) and _is_float(g) and _is_float(p)):
            return u
        return u.astype(jnp.promote_types(g.dtype, p.dtype)) if u.dtype != g.dtype else u

    try:
        return jax.tree.map(as_plain, updates, grads, params)
    except ValueError:  # An inner optimizer's own structure: as it is.
        return updates


def _is_float(x: Any) -> bool:
    return hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating)


def get_loss_scale(opt_state: Any) -> LossScale:
    """Returns the current `LossScale` found anywhere in an optax state.

    Works through any nesting: `optax.chain`, `optax.named_chain`,
    `optax.MultiSteps`, `optax.inject_hyperparams`, tuples and dicts.

    Raises:
      ValueError: if the state holds no `LossScaledState`, or more than one.

    >>> import optax, jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> inner = optax.chain(optax.clip(1.0), optax.sgd(0.1))  # Clips the true gradients.
    >>> tx = optax.named_chain(("mixed", jmp.loss_scaled(inner, jmp.StaticLossScale(8.0))))
    >>> jmp.get_loss_scale(tx.init({"w": jnp.ones(2)}))
    StaticLossScale(loss_scale=8.0)
    """
    found = []
    pending = [opt_state]
    while pending:  # A LossScaledState's inner state may hold another (a wrapper wrapped).
        for s in jax.tree.leaves(pending.pop(), is_leaf=lambda x: isinstance(x, LossScaledState)):
            if isinstance(s, LossScaledState):
                found.append(s.loss_scale)
                pending.append(s.inner_state)
    if len(found) != 1:
        raise ValueError(
            f"get_loss_scale expects an optimizer state holding exactly one "
            f"LossScaledState (from `loss_scaled`), found {len(found)}."
        )
    return found[0]
