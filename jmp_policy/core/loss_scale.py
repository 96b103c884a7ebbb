"""Loss scales as functional pytree state, and finiteness helpers.

A superset of jmp 0.0.4's ``loss_scale.py``. Every loss scale is a pytree built
from its dataclass fields: hyperparameters are static fields, the
scale and its counters are array leaves, so the state survives `jax.jit`,
`jax.tree.map`, `lax.scan` and checkpointing unchanged.

References: Micikevicius et al., "Mixed Precision Training" (ICLR 2018);
PyTorch's `torch.amp.GradScaler`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import warnings
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

T = TypeVar("T")
C = TypeVar("C", bound=type)

# Smallest normal float32: the dynamic scale never goes below it (no subnormals).
_TINY = float(np.finfo(np.float32).tiny)
_F32_MAX = float(np.finfo(np.float32).max)
_INT32_MAX = int(np.iinfo(np.int32).max)
_INT32_MIN = int(np.iinfo(np.int32).min)


def _is_inexact(x: Any) -> bool:
    # Python floats count (as in jmp): `scale(1.0)` must not silently skip the
    # loss. Complex values count too; ints and bools are never scaled.
    if isinstance(x, (float, complex)):
        return True
    return isinstance(x, (jax.Array, np.ndarray, np.generic)) and jnp.issubdtype(
        x.dtype, jnp.inexact
    )


def _at_least_float32(x: jax.Array) -> jax.Array:
    # Half types widen to float32, float64 stays (works under strict promotion).
    return x if x.dtype.itemsize >= 4 else x.astype(np.float32)


def _scale_tree(
    tree: T, multiply: bool, loss_scale: jax.typing.ArrayLike, exact: bool = False
) -> T:
    # In float32 (or wider): a half value times 2**15 would overflow, and half
    # gradients divided back in half precision would be rounded twice.
    # Unscaling multiplies by the reciprocal, as jmp and PyTorch's GradScaler
    # do, or divides (`exact`): the same values for a power-of-two scale, but
    # XLA compiles what reads them (an optimizer's update, a norm's sum of
    # squares) to other bits in the last place after one than after the
    # other. The reciprocal gives a jmp loop's bits, the division the
    # unscaled run's (tests/test_jmp_compat.py, tests/test_reliability.py).
    def apply(x):
        if not _is_inexact(x):
            return x
        x = _at_least_float32(jnp.asarray(x))
        s = jnp.asarray(loss_scale, x.dtype)
        if multiply:
            return x * s
        return x / s if exact else x * (1 / s)

    return jax.tree.map(apply, tree)


def unscale_exactly(loss_scale: LossScale, tree: T) -> T:
    """`loss_scale.unscale(tree)` by a division, for `loss_scaled`: where the optimizer's
    arithmetic allows, training gives the unscaled run's bits (see `_scale_tree`)."""
    if isinstance(loss_scale, (StaticLossScale, DynamicLossScale)):
        return _scale_tree(tree, False, loss_scale.loss_scale, exact=True)
    return loss_scale.unscale(tree)  # NoOpLossScale: the gradients as they are.


def _is_array_like(x: Any) -> bool:
    return isinstance(x, (numbers.Number, np.ndarray, np.generic, jax.Array))


def _is_concrete_scalar(x: Any) -> bool:
    # A value built inside `jax.jit` (a tracer) cannot be checked.
    return _is_array_like(x) and not isinstance(x, jax.core.Tracer) and np.ndim(x) == 0


def _dtype_of(x: Any) -> np.dtype:
    return np.dtype(x.dtype) if hasattr(x, "dtype") else np.result_type(x)


def _as_float32_scale(x: Any, name: str, warn_if_int: bool) -> Any:
    """Converts a user's scale to a float32 array leaf, validating concrete values.

    Called from `__post_init__`: a warning's `stacklevel=4` names the user's call.
    """
    if not _is_array_like(x) or isinstance(x, complex):
        raise TypeError(f"{name} must be a number or a scalar array, got {x!r}.")
    if np.ndim(x) != 0:  # Shapes are known without waiting for the device.
        raise ValueError(f"{name} must be a scalar, got shape {np.shape(x)}.")
    dtype = _dtype_of(x)
    if warn_if_int and not jnp.issubdtype(dtype, jnp.floating):
        # jmp's warning, kept for compatibility; the value is converted and works.
        warnings.warn(f"Expected floating type for {name}, got {dtype}", stacklevel=4)
    if _is_concrete_scalar(x):
        value = _float_or_inf(x)
        if not (math.isfinite(value) and 0 < value <= _F32_MAX):
            raise ValueError(f"{name} must be a positive finite float32 number, got {x!r}.")
    if dtype != np.float32:
        x = jnp.asarray(x, jnp.float32)
    return x


def _as_int32_scalar(x: Any, name: str) -> Any:
    """Converts a user's counter to an int32 scalar leaf."""
    if isinstance(x, int) and not isinstance(x, bool) and not _INT32_MIN <= x <= _INT32_MAX:
        raise ValueError(f"{name} must fit int32 (it is an int32 leaf), got {x!r}.")
    if not (_is_array_like(x) and jnp.issubdtype(_dtype_of(x), jnp.integer) and np.ndim(x) == 0):
        raise TypeError(f"{name} must be an integer scalar, got {x!r}.")
    if _dtype_of(x) == np.int32:
        return x
    if not isinstance(x, jax.Array) and not _INT32_MIN <= int(np.asarray(x)) <= _INT32_MAX:
        raise ValueError(f"{name} must fit int32 (it is an int32 leaf), got {x!r}.")
    return jnp.asarray(x, jnp.int32)


def _static_float(x: Any, name: str, warn_if_int: bool = False) -> float:
    if isinstance(x, (str, bytes, bool, np.bool_)):
        # float("3") and float(True) would pass silently.
        raise TypeError(f"{name} must be a number, got {x!r}.")
    if isinstance(x, jax.core.Tracer):
        raise TypeError(
            f"{name} is a static hyperparameter and must be a concrete number, "
            "not a traced value; create the loss scale outside `jax.jit`."
        )
    if warn_if_int and _is_array_like(x) and not jnp.issubdtype(_dtype_of(x), jnp.floating):
        warnings.warn(f"Expected floating type for {name}, got {_dtype_of(x)}", stacklevel=4)
    try:
        return _float_or_inf(x)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {x!r}.") from None


def _float_or_inf(x: Any) -> float:
    """`float(x)`, an int too large for a float as +-inf (for the range checks to name)."""
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def _register_state(*data_fields: str) -> Callable[[C], C]:
    """Registers a frozen dataclass as a pytree: `data_fields` are leaves, the
    other fields static.

    Like `jax.tree_util.register_dataclass`, the field lists come from the
    class itself, so no field can be dropped (jmp lost `min_loss_scale`). Unlike
    it, unflattening does not call `__init__`: `jax.tree.map(lambda x: 0, s)`
    or `tree.map(np.zeros_like, s)` must rebuild the tree as is, not validate
    and convert its leaves as a user's call does.
    """

    def register(cls: C) -> C:
        names = [f.name for f in dataclasses.fields(cls)]
        meta_fields = [n for n in names if n not in data_fields]

        def flatten_with_keys(obj: Any) -> tuple[list[tuple[Any, Any]], tuple[Any, ...]]:
            children = [(jax.tree_util.GetAttrKey(n), getattr(obj, n)) for n in data_fields]
            return children, tuple(getattr(obj, n) for n in meta_fields)

        def unflatten(meta: tuple[Any, ...], children: Iterable[Any]) -> Any:
            obj: Any = object.__new__(cls)
            for name, value in (*zip(meta_fields, meta), *zip(data_fields, children)):
                object.__setattr__(obj, name, value)
            return obj

        jax.tree_util.register_pytree_with_keys(cls, flatten_with_keys, unflatten)
        return cls

    return register


class LossScale:
    """The protocol shared by `NoOpLossScale`, `StaticLossScale`, `DynamicLossScale`.

    `loss_scale` is the current value, `scale(tree)` multiplies (the loss),
    `unscale(tree)` multiplies by the reciprocal (the gradients, in float32), and
    `adjust(grads_finite)` returns the next state.
    """

    loss_scale: Any

    def scale(self, tree: T) -> T:
        raise NotImplementedError

    def unscale(self, tree: T) -> T:
        raise NotImplementedError

    def adjust(self, grads_finite: jax.Array) -> LossScale:
        raise NotImplementedError


@_register_state()
@dataclasses.dataclass(frozen=True)
class NoOpLossScale(LossScale):
    """A loss scale that does nothing: for float32 and bfloat16 training.

    >>> import jmp_policy as jmp
    >>> jmp.NoOpLossScale().scale(3.0)
    3.0
    """

    @property
    def loss_scale(self) -> np.float32:
        return np.float32(1.0)

    def scale(self, tree: T) -> T:
        return tree

    def unscale(self, tree: T) -> T:
        return tree

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        _check_bool_scalar(grads_finite, "grads_finite")
        return self


@_register_state()
@dataclasses.dataclass(frozen=True)
class StaticLossScale(LossScale):
    """Scales and unscales by a fixed constant (a compile-time constant: no leaves).

    Args:
      loss_scale: the constant, kept as a float (float32 when used).

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> jmp.StaticLossScale(128.0).unscale(jnp.float16(256.0))
    Array(2., dtype=float32)
    """

    loss_scale: float

    def __post_init__(self):
        value = _static_float(self.loss_scale, "loss_scale")
        # Used in float32: beyond its range the scale would be inf or 0, and
        # every step skipped or every gradient zero.
        if not (value == 0 or _TINY <= value <= _F32_MAX):
            raise ValueError(
                f"loss_scale must be 0 or a positive float32 number in [{_TINY:g}, "
                f"{_F32_MAX:g}], got {value}."
            )
        if value == 0:
            # jmp accepts it (its own tests build one).
            warnings.warn(
                "StaticLossScale(0) scales every loss to zero, and unscaling divides by "
                "zero: every gradient is non-finite, and loss_scaled skips every step.",
                stacklevel=3,
            )
        object.__setattr__(self, "loss_scale", value)

    def scale(self, tree: T) -> T:
        return _scale_tree(tree, True, np.float32(self.loss_scale))

    def unscale(self, tree: T) -> T:
        return _scale_tree(tree, False, np.float32(self.loss_scale))

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        _check_bool_scalar(grads_finite, "grads_finite")
        return self


@_register_state("loss_scale", "counter", "overflows")
@dataclasses.dataclass(frozen=True)
class DynamicLossScale(LossScale):
    """A loss scale that grows while gradients are finite and backs off on overflow.

    The rule, applied by `adjust(grads_finite)` once per step:

    * finite step: `counter += 1`; when `counter` reaches `period` (that is, on
      the `period`-th finite step in a row, as in jmp and PyTorch) the scale is
      multiplied by `factor` if the result is finite and at most
      `max_loss_scale` (otherwise it stays), and `counter` restarts at 0.
    * non-finite step: `counter` restarts at 0 and the step counts as an
      overflow; on the `hysteresis`-th overflow since the scale last grew or
      backed off, the scale is divided by `factor`, floored at
      `min_loss_scale` (and at float32's smallest normal number). With the
      default `hysteresis=1` every overflow backs off, as in jmp.

    The scale is a float32 leaf whatever dtype it was given in, `counter` an
    int32 leaf; `overflows` (int32) exists only when `hysteresis > 1`, so a
    default instance has exactly the leaves `[loss_scale, counter]`.

    Args:
      loss_scale: the initial scale (2**15 is a common choice).
      counter: finite steps in a row so far.
      period: finite steps in a row before the scale grows (1 to 2**31 - 1).
      factor: growth and back-off factor (> 1).
      min_loss_scale: the scale never backs off below this.
      max_loss_scale: the scale never grows above this.
      hysteresis: overflows needed before the scale backs off (>= 1).
      overflows: overflows since the scale last changed (only if hysteresis > 1).

    Raises:
      TypeError: for a scale that is not a number, a counter that is not an
        integer scalar, or a hyperparameter given as a string or a bool.
      ValueError: for a non-positive, non-finite or non-scalar scale,
        `period` outside `[1, 2**31 - 1]`, `factor <= 1`, `hysteresis < 1`, a counter outside
        `[0, period)`, `overflows` outside `[0, hysteresis)` or without
        `hysteresis > 1`, or bounds that
        do not hold the scale.
        The scale's value is checked when it is concrete (a number or an
        array); a traced value (built inside `jax.jit`) is taken as is.

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> s = jmp.DynamicLossScale(2.0**15, period=2)
    >>> s = s.adjust(jnp.bool_(True)).adjust(jnp.bool_(True))
    >>> float(s.loss_scale), int(s.counter)
    (65536.0, 0)
    >>> float(s.adjust(jnp.bool_(False)).loss_scale)
    32768.0
    """

    loss_scale: jax.typing.ArrayLike  # a float32 jax.Array once constructed
    counter: jax.typing.ArrayLike = dataclasses.field(
        default_factory=lambda: np.zeros([], np.int32)
    )
    period: int = 2000
    factor: float = 2
    min_loss_scale: float = 1.0
    max_loss_scale: float = float(np.finfo(np.float32).max)
    hysteresis: int = 1
    overflows: jax.typing.ArrayLike | None = None

    def __post_init__(self):
        set_ = functools.partial(object.__setattr__, self)
        given_scale, given_counter = self.loss_scale, self.counter
        set_("loss_scale", _as_float32_scale(self.loss_scale, "loss_scale", True))
        set_("counter", _as_int32_scalar(self.counter, "counter"))
        period = _static_float(self.period, "period")
        # The counter is an int32 leaf: a longer period could never be reached
        # and would overflow int32 in the first `adjust`.
        if not (math.isfinite(period) and 1 <= period <= _INT32_MAX and period == int(period)):
            raise ValueError(
                f"period must be an integer in [1, {_INT32_MAX}] (the counter is int32), "
                f"got {self.period!r}."
            )
        set_("period", int(period))
        # A jax.Array counter (e.g. from an eager `adjust`) is not read back.
        counter_value = (
            None if isinstance(given_counter, jax.Array) else int(np.asarray(given_counter))
        )
        if counter_value is not None and not 0 <= counter_value < period:
            raise ValueError(
                f"counter must be in [0, period) = [0, {int(period)}), got {given_counter!r}."
            )
        factor = _static_float(self.factor, "factor")
        # `adjust` multiplies and divides in float32: there it must be > 1 and finite.
        with np.errstate(over="ignore"):
            factor32 = np.float32(factor)
        if not (factor32 > 1 and math.isfinite(factor32)):
            raise ValueError(f"factor must be a finite number > 1 in float32, got {self.factor!r}.")
        set_("factor", self.factor if isinstance(self.factor, int) else factor)
        lo = _static_float(self.min_loss_scale, "min_loss_scale", True)
        hi = _static_float(self.max_loss_scale, "max_loss_scale")
        if not (0 <= lo <= hi):
            raise ValueError(
                "Expected 0 <= min_loss_scale <= max_loss_scale, got "
                f"min_loss_scale={lo}, max_loss_scale={hi}."
            )
        set_("min_loss_scale", lo)
        # The scale is float32: a larger cap is float32's largest number.
        set_("max_loss_scale", min(hi, _F32_MAX))
        self._set_hysteresis_and_overflows()
        self._check_scale_in_bounds(given_scale, lo, hi)

    def _set_hysteresis_and_overflows(self) -> None:
        set_ = functools.partial(object.__setattr__, self)
        hysteresis = self.hysteresis
        if not isinstance(hysteresis, numbers.Integral) or isinstance(hysteresis, (bool, np.bool_)):
            raise TypeError(f"hysteresis must be an integer >= 1, got {hysteresis!r}.")
        if not 1 <= hysteresis <= _INT32_MAX:  # Overflows are counted in int32.
            raise ValueError(
                f"hysteresis must be an integer in [1, {_INT32_MAX}], got {hysteresis!r}."
            )
        hysteresis = int(hysteresis)
        set_("hysteresis", hysteresis)
        if self.overflows is None:
            if hysteresis > 1:
                set_("overflows", np.zeros([], np.int32))
        elif hysteresis == 1:
            # A leaf that `adjust` drops would change the pytree (a scan carry) per step.
            raise ValueError(
                f"overflows is only kept with hysteresis > 1, got overflows={self.overflows!r} "
                "with hysteresis=1."
            )
        else:
            given_overflows = self.overflows
            set_("overflows", _as_int32_scalar(given_overflows, "overflows"))
            if not isinstance(given_overflows, jax.Array) and not (
                0 <= int(given_overflows) < hysteresis
            ):
                raise ValueError(
                    f"overflows must be in [0, hysteresis) = [0, {hysteresis}), "
                    f"got {given_overflows!r}."
                )

    def _check_scale_in_bounds(self, given_scale: Any, lo: float, hi: float) -> None:
        """A concrete `loss_scale` given is within `[lo, hi]`, as `adjust` keeps it."""
        if _is_concrete_scalar(given_scale):
            scale = float(given_scale)
            # `adjust` never takes the scale below float32's smallest normal
            # number: below it, unscaling would overflow every gradient.
            if scale < _TINY:
                raise ValueError(
                    f"loss_scale must be at least float32's smallest normal number "
                    f"{_TINY:g}, got {scale}."
                )
            # In float32, as `adjust` floors and caps it (0.7 is 0.69999999 there).
            if not np.float32(lo) <= np.float32(scale) <= np.float32(self.max_loss_scale):
                raise ValueError(
                    f"loss_scale={scale} is outside [min_loss_scale, "
                    f"max_loss_scale] = [{lo}, {hi}]."
                )

    def scale(self, tree: T) -> T:
        return _scale_tree(tree, True, self.loss_scale)

    def unscale(self, tree: T) -> T:
        return _scale_tree(tree, False, self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        """Returns the next state, given whether this step's gradients were finite."""
        _check_bool_scalar(grads_finite, "grads_finite")
        grads_finite = jnp.asarray(grads_finite)
        scale = self.loss_scale
        grown = scale * np.float32(self.factor)
        can_grow = jnp.isfinite(grown) & (grown <= self.max_loss_scale)
        grow = grads_finite & (self.counter == self.period - 1) & can_grow
        floor = np.float32(max(self.min_loss_scale, _TINY))
        backed_off = jnp.maximum(scale / np.float32(self.factor), floor)

        if self.hysteresis == 1 or self.overflows is None:  # None iff hysteresis == 1
            back_off, overflows = ~grads_finite, None
        else:
            seen = self.overflows + (~grads_finite).astype(jnp.int32)
            back_off = ~grads_finite & (seen >= self.hysteresis)
            overflows = jnp.where(back_off | grow, 0, seen).astype(jnp.int32)

        new_scale = jnp.where(grow, grown, jnp.where(back_off, backed_off, scale))
        counter = jnp.where(grads_finite, (jnp.asarray(self.counter) + 1) % self.period, 0)
        return dataclasses.replace(
            self,
            loss_scale=new_scale,
            counter=counter.astype(jnp.int32),
            overflows=overflows,
        )


class ExpectedScalarError(ValueError, AssertionError):
    """A predicate was not a boolean scalar (an `AssertionError` too, as in jmp)."""


def _check_bool_scalar(pred: Any, name: str) -> None:
    scalar = False
    try:
        got = f"shape {np.shape(pred)} dtype {_dtype_of(pred)}"
        scalar = np.shape(pred) == ()
        ok = scalar and _dtype_of(pred) == np.bool_
    except Exception:  # Not array-like at all: a string, an object.
        got, ok = repr(pred), False
    if not ok:
        hint = (
            " Pass a boolean, e.g. `all_finite(grads)`."
            if scalar
            else " Reduce it first, e.g. with `all_finite(grads)`."
        )
        raise ExpectedScalarError(f"{name}: expected boolean scalar, got {got}.{hint}")


def all_finite(tree: Any, axis_name: Any = None) -> jax.Array:
    """Returns a boolean scalar: whether every floating value in the tree is finite.

    Args:
      tree: a pytree of arrays and numbers (integer and boolean leaves are
        always finite).
      axis_name: inside `shard_map` or `pmap`, the mapped axis (or tuple of
        axes) to agree over: the result is then True on every device only if
        every device's values are finite.

    Returns:
      A boolean scalar array.

    Raises:
      TypeError: if a leaf of `tree` is not an array or a number (a string,
        an object): it cannot be checked, and reading it as finite would let
        a mistake through.

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> bool(jmp.all_finite({"a": jnp.ones(2), "b": jnp.array([1.0, jnp.inf])}))
    False
    """
    leaves_with_paths = jax.tree_util.tree_leaves_with_path(tree)
    for path, x in leaves_with_paths:
        if not _is_array_like(x) or isinstance(x, (str, bytes)):
            where = f" at {jax.tree_util.keystr(path)}" if path else ""
            raise TypeError(
                f"all_finite: every leaf of tree must be an array or a number, got "
                f"{x!r}{where} (a {type(x).__name__})."
            )
    # A named scope: profiles and lowered programs show where the check is.
    with jax.named_scope("jmp_policy_all_finite"):
        leaves = [jnp.isfinite(x).all() for _, x in leaves_with_paths if _is_inexact(x)]
        finite = jnp.stack(leaves).all() if leaves else jnp.array(True)
        if axis_name is not None:
            finite = jax.lax.pmin(finite.astype(jnp.int32), axis_name).astype(jnp.bool_)
    return finite


_ARRAYS = (jax.Array, np.ndarray, np.generic)


def _same(x: Any, y: Any) -> bool:
    if x is y:
        return True
    try:
        return type(x) is type(y) and bool(x == y)
    except Exception:  # An object whose `==` is not a bool.
        return False


def select_tree(pred: jax.Array, a: T, b: T) -> T:
    """Selects pytree `a` where the boolean scalar `pred` is True, else `b`.

    Array leaves are selected (`lax.select`). A leaf that is the same in `a`
    and `b` (the same object, or an equal Python scalar, function or string,
    such as an Equinox module's activation or its `Dropout`'s `inference`
    flag) comes back unchanged.

    Args:
      pred: a boolean scalar (traced or concrete).
      a: the pytree to return where `pred` is True.
      b: a pytree of the same structure, returned where `pred` is False.

    Returns:
      A pytree of the structure of `a`.

    Raises:
      ExpectedScalarError: (a `ValueError` and an `AssertionError`) if `pred`
        is not a boolean scalar.
      TypeError: if `a` and `b` differ in a leaf that is no array or number
        (it cannot be chosen by a traced `pred`).

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> jmp.select_tree(jnp.bool_(False), {"w": jnp.ones(2)}, {"w": jnp.zeros(2)})
    {'w': Array([0., 0.], dtype=float32)}
    >>> w, act = jmp.select_tree(jnp.bool_(True), (jnp.ones(1), jnp.tanh), (jnp.zeros(1), jnp.tanh))
    >>> w, act is jnp.tanh
    (Array([1.], dtype=float32), True)
    """
    _check_bool_scalar(pred, "pred")

    def select(path: Any, x: Any, y: Any) -> Any:
        # Arrays first: `==` on a tracer would add an op to the program.
        arrays = isinstance(x, _ARRAYS) or isinstance(y, _ARRAYS)
        if not arrays and _same(x, y):
            return x  # A Python scalar, function, string...: nothing to select.
        if _is_array_like(x) and _is_array_like(y):
            return jax.lax.select(pred, x, y)
        raise TypeError(
            f"select_tree: a and b differ at {jax.tree_util.keystr(path)} in a leaf that "
            f"is not an array ({x!r} and {y!r}): only arrays and numbers can be selected "
            "by a traced predicate. Select the arrays only (e.g. "
            "eqx.filter(tree, eqx.is_array)) and combine them with the rest."
        )

    return jax.tree_util.tree_map_with_path(select, a, b)
