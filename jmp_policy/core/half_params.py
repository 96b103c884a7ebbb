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
  Zamirai et al., "Revisiting BFloat16 Training", 2020). No buffer.

The wrapped optimizer computes in float32 for half parameters, and its
half-precision state (Adam's moments, which optax keeps in the parameters'
dtype) is stored stochastically rounded, with both methods: a moving average
whose per-step change is below half an ulp (Adam's second moment moves by
0.1% a step at b2 = 0.999, bfloat16 resolves 0.4%) still moves on average,
where rounding to nearest would freeze it. Float32 (and any non-half)
parameters pass through untouched, with no state.
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


# All rounding below is done on float32 values with explicit operations
# (`lax.reduce_precision`, integer floors), never by a float32 -> half -> float32
# round trip: XLA may drop such a pair of converts inside a fusion
# (`xla_allow_excess_precision`, on by default), and the wrapper must know
# bit for bit where each half update lands.


def _saturate(x: jax.Array, dtype: Any) -> jax.Array:
    """Clips float32 `x` to `dtype`'s finite range, so rounding cannot overflow
    to infinity (float16's range ends at 65504); NaN stays NaN."""
    big = float(jnp.finfo(dtype).max)
    return jnp.clip(x, -big, big)


def _round_nearest(x: jax.Array, dtype: Any) -> jax.Array:
    """Float32 `x` rounded to the nearest `dtype` value (ties to even), kept in
    float32. `x` must be within `dtype`'s finite range."""
    info = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if np.dtype(dtype) == np.dtype(jnp.float16):
        # reduce_precision flushes float16's subnormals (below 2**-14) to zero;
        # there the grid is uniform, steps of 2**-24: round on it directly.
        tiny = float(info.smallest_normal)
        sub = float(info.smallest_subnormal)
        rounded = jnp.where(jnp.abs(x) < tiny, jnp.round(x / sub) * sub, rounded)
    return rounded


def _spacing(x: jax.Array, dtype: Any) -> jax.Array:
    """The distance between neighbouring `dtype` values in float32 `x`'s binade:
    |x| in [2**(e-1), 2**e) holds 2**nmant of them (uniform below the
    smallest normal)."""
    info = jnp.finfo(dtype)
    _, e = jnp.frexp(x)
    spacing = jnp.ldexp(jnp.ones_like(x), e - 1 - info.nmant)
    return jnp.maximum(spacing, float(info.smallest_subnormal))


def _step_to(p: jax.Array, new32: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The half-precision update from `p` to the half value `new32` (held in
    float32), and where `optax.apply_updates` makes it land (float32).

    `apply_updates` computes `p + u` in the parameters' dtype: the exact sum,
    rounded. The difference of two half values is exact in float32 and,
    whenever `new32` is within a factor 2 of `p` (Sterbenz), also in the half
    dtype, so `p + u` is exactly `new32`. Otherwise (a weight collapsing
    towards or crossing zero in one step) `u` is rounded, and the landing
    point, computed here as `apply_updates` computes it, is off by at most
    half an ulp of `u`.
    """
    info = jnp.finfo(p.dtype)
    p32 = p.astype(jnp.float32)
    u32 = _round_nearest(_saturate(new32 - p32, p.dtype), p.dtype)
    # A rounded-up `u` could carry `p + u` past the largest finite value
    # (float16: to 65520 and beyond, which rounds to infinity): one step
    # less, towards zero, stays inside.
    overflow = float(info.max) + 0.5 * 2.0 ** (info.maxexp - 1 - info.nmant)
    over = jnp.abs(p32 + u32) >= overflow
    u32 = jnp.where(over, u32 - jnp.sign(u32) * _spacing(u32, p.dtype), u32)
    landed = _round_nearest(_saturate(p32 + u32, p.dtype), p.dtype)
    return u32.astype(p.dtype), landed


def _kahan_leaf(comp: Any, p: Any, u: Any) -> tuple[Any, Any]:
    if _is_masked(comp):
        return u, comp
    # The float32 accumulation the half weight and its buffer stand for. The
    # two small terms first: their sum is exact more often.
    target = p.astype(jnp.float32) + (comp.astype(jnp.float32) + u.astype(jnp.float32))
    step, landed = _step_to(p, _round_nearest(_saturate(target, p.dtype), p.dtype))
    # What rounding (and, rarely, an inexact step) left out, carried forward.
    new_comp = _round_nearest(_saturate(target - landed, p.dtype), p.dtype)
    return step, new_comp.astype(p.dtype)


def _uniform_like(key: jax.Array, arrays: list[Any]) -> list[jax.Array]:
    """Uniform float32 draws in [0, 1) shaped like each of `arrays`, from one
    draw of the PRNG: one generator in the program, not one per leaf (each
    compiles to the full Threefry rounds)."""
    sizes = [int(np.prod(a.shape)) for a in arrays]
    flat = jax.random.uniform(key, (sum(sizes),), jnp.float32)
    ends = np.cumsum(sizes)
    return [flat[e - n : e].reshape(a.shape) for a, n, e in zip(arrays, sizes, ends)]


def _stochastic_round(target: jax.Array, dtype: Any, draw: jax.Array) -> jax.Array:
    """Rounds float32 `target` to one of its two neighbours in `dtype`, up
    with probability (target - down) / (up - down): unbiased (`draw` is
    uniform in [0, 1), shaped like `target`). Float32 out."""
    target = _saturate(target, dtype)
    spacing = _spacing(target, dtype)
    # All exact in float32: a multiple of a power of two, and a difference
    # within one binade.
    down = jnp.floor(target / spacing) * spacing
    prob_up = (target - down) / spacing
    rounded = jnp.where(draw < prob_up, down + spacing, down)
    # Non-finite (NaN passes), or a spacing flushed to zero (bfloat16 values
    # below 2**-126, on hardware without float32 subnormals): to nearest.
    usable = jnp.isfinite(target) & (spacing > 0)
    return jnp.where(usable, rounded, _round_nearest(target, dtype))


def _stochastic_leaf(p: Any, u: Any, draw: jax.Array) -> Any:
    target = p.astype(jnp.float32) + u.astype(jnp.float32)
    step, _ = _step_to(p, _stochastic_round(target, p.dtype, draw))
    return step


def _to_float32(x: Any) -> Any:
    return x.astype(jnp.float32) if _is_half(x) else x


def _flatten_up_to(treedef: Any, tree: Any) -> list[Any]:
    """The subtrees of `tree` at the leaves of `treedef` (MaskedNodes included)."""
    return treedef.flatten_up_to(tree)  # A PyTreeDef method the type stubs omit.


def _store_like(new: Any, old: Any, key: jax.Array) -> Any:
    """Casts the new inner state back to the dtypes of the old: half leaves
    stochastically rounded, others (counts, float32 moments) as they are."""
    new_leaves, treedef = jax.tree.flatten(new)
    old_leaves = _flatten_up_to(treedef, old)
    draws = iter(_uniform_like(key, [o for o in old_leaves if _is_half(o)]))
    out = []
    for n, o in zip(new_leaves, old_leaves):
        if _is_half(o):
            n = _stochastic_round(n.astype(jnp.float32), o.dtype, next(draws)).astype(o.dtype)
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
      key: the raw PRNG key data (uint32[2], from `jax.random.key_data`: it
        checkpoints as a plain array), split once per step for the
        stochastic rounding of the half inner state (and, for "stochastic",
        of the parameters).
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
      float16). The buffer rounds too: it keeps adding an update `u` only
      while it holds less than about 256 `u` (its own 8 bits), and empties
      into the weight at half the weight's ulp, so updates of at least
      2**-16 of the weight get through, near that size with the buffer's
      rounding error (1,000 updates of 1e-4 onto 1.0 add 0.1028, not 0.1),
      and smaller ones stall (2**-18 onto 1.0 stops adding at 2**-10).
      Extra memory: one half value per half parameter.
    * "stochastic" rounds up or down at random, so the expected parameter is
      the float32 result: small updates are applied on average. No extra
      memory.

    `inner` sees float32 gradients, parameters and state for half
    parameters; its half-precision state leaves (those of float32
    parameters with `mu_dtype=jnp.bfloat16` too) are stored back
    stochastically rounded, unbiased, so Adam's moments can stay in
    bfloat16. Float32 and other non-half parameters get `inner`'s updates
    untouched, with no buffer and no per-parameter work.

    The update lands exactly when the new value is within a factor 2 of the
    old (any ordinary step); a weight collapsing towards or across zero in
    one step may land up to half an ulp of the step off (for "kahan", the
    buffer takes up the difference). Values beyond the half dtype's range
    saturate at its largest finite value instead of overflowing (float16:
    65504), and a single step larger than the range is cut to fit.

    The inner state keeps the dtypes `inner.init` gave it. With a loss
    scale, wrap this transformation in `loss_scaled`, not the other way
    round: a skipped step then leaves the buffer and the key bit-for-bit
    unchanged.

    Recipes (bfloat16 parameters; bytes per parameter of parameters plus
    optimizer state; float32 master weights with float32 moments: 12 for
    Adam):

    * Adam/AdamW: `half_param_updates(optax.adamw(lr))`; optax keeps both
      moments in the parameters' dtype: 2 + 2 (buffer) + 2 + 2 = 8 bytes.
      (`mu_dtype` matters for float32 parameters only.)
    * SGD with momentum: `optax.sgd(lr, momentum=0.9)`: 2 + 2 + 2 = 6 bytes.
    * Lion: `optax.lion(lr)`: 2 + 2 + 2 = 6 bytes.
    * Adafactor: `optax.adafactor(lr)`: 2 + 2 plus its second moments, in
      the parameters' dtype: factored (a row and a column, close to 0 bytes
      per parameter) for matrices of at least 128 x 128, full (2 bytes)
      otherwise; `momentum` adds a float32 first moment unless
      `dtype_momentum=jnp.bfloat16`.
    With "stochastic", subtract the 2 bytes of the buffer.

    Args:
      inner: the optimizer whose updates to apply, e.g. `optax.adamw(1e-4)`.
      method: "kahan" (deterministic, one half buffer per half parameter) or
        "stochastic" (random, no buffer).
      seed: seeds the PRNG key of the stochastic rounding (an integer in
        [0, 2**63), as `jax.random.key` takes).

    Returns:
      An `optax.GradientTransformationExtraArgs` whose state is a
      `HalfParamState`. Its `update` needs `params`.

    Raises:
      TypeError: if `inner` is not an optax transformation or `seed` is not an
        integer.
      ValueError: if `method` is not "kahan" or "stochastic", or `seed` is
        outside [0, 2**63); from `update`, if `params` is None.

    References: Kahan, "Further remarks on reducing truncation errors" (1965);
    Zamirai et al., "Revisiting BFloat16 Training" (2020); optimi's Kahan
    summation; torchao's bfloat16 stochastic rounding.

    >>> import jax, jax.numpy as jnp, optax
    >>> import jmp_policy as jmp
    >>> tx = jmp.half_param_updates(optax.sgd(1e-4))
    >>> params = {"w": jnp.ones(2, jnp.bfloat16)}
    >>> state = tx.init(params)
    >>> grads = {"w": -jnp.ones(2, jnp.bfloat16)}  # updates of +1e-4
    >>> update = jax.jit(tx.update)
    >>> for _ in range(1000):
    ...     updates, state = update(grads, state, params)
    ...     params = optax.apply_updates(params, updates)
    >>> params["w"]  # float32 gives 1.1; plain bfloat16 stays at 1
    Array([1.10156, 1.10156], dtype=bfloat16)
    """
    inner, seed = _checked(inner, method, seed)

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
            updates,
            jax.tree.map(_to_float32, state.inner_state),
            jax.tree.map(_to_float32, params),
            **extra_args,
        )
        inner_state = _store_like(inner_state, state.inner_state, state_key)

        new_updates, compensation = _landing(
            method, params, new_updates, state.compensation, params_key
        )
        return new_updates, HalfParamState(inner_state, compensation, jax.random.key_data(key))

    return optax.GradientTransformationExtraArgs(init, update)


def _checked(
    inner: Any, method: str, seed: Any
) -> tuple[optax.GradientTransformationExtraArgs, int]:
    """`half_param_updates`' arguments checked: `inner` with extra args, `seed` an int."""
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
    if not 0 <= seed < 2**63:  # What `jax.random.key` takes.
        raise ValueError(f"seed must be an integer in [0, 2**63), got {seed!r}.")
    return optax.with_extra_args_support(inner), operator.index(seed)


def _landing(method: str, params: Any, updates: Any, compensation: Any, key: jax.Array) -> tuple:
    """The half updates that land each half parameter on its rounded float32
    sum, and the new compensation (kept as it is for "stochastic")."""
    leaves, treedef = jax.tree.flatten(params)
    update_leaves = _flatten_up_to(treedef, updates)
    if method == "kahan":
        comp_leaves = _flatten_up_to(treedef, compensation)
        pairs = [_kahan_leaf(*leaf) for leaf in zip(comp_leaves, leaves, update_leaves)]
        return (
            jax.tree.unflatten(treedef, [u for u, _ in pairs]),
            jax.tree.unflatten(treedef, [c for _, c in pairs]),
        )
    draws = iter(_uniform_like(key, [p for p in leaves if _is_half(p)]))
    out = [
        _stochastic_leaf(p, u, next(draws)) if _is_half(p) else u
        for p, u in zip(leaves, update_leaves)
    ]
    return jax.tree.unflatten(treedef, out), compensation
