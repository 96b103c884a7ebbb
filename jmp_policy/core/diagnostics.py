"""Gradient diagnostics: would these gradients survive float16 or bfloat16?

`diagnose` measures, per gradient array, the share of values that a half
dtype cannot hold (flushed to zero, subnormal, overflowing), recommends a
policy and an initial loss scale, and lists the matrix products whose
dimensions are not multiples of 8 (NVIDIA Tensor Cores want multiples of 8
for half inputs). `jmp_policy.plot_histogram` draws the distribution of log2 gradient
magnitudes over the float16 and bfloat16 ranges.

Reference: Micikevicius et al., "Mixed Precision Training" (ICLR 2018),
Section 3.2 and Figure 3.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.core import jax_internals as ji

# Float16: subnormals from 2^-24, normals from 2^-14, largest 65504.
F16_TINIEST = 2.0**-24
F16_SMALLEST_NORMAL = 2.0**-14
F16_MAX = 65504.0
# Bfloat16: float32's exponent range with 8 bits of precision.
BF16_TINIEST = 2.0**-133
BF16_SMALLEST_NORMAL = 2.0**-126
BF16_MAX = float(jnp.finfo(jnp.bfloat16).max)

# log2 histogram: integer bins floor(log2 |g|) in [_LOG2_LO, _LOG2_HI).
_LOG2_LO, _LOG2_HI = -160, 140
# The recommended float16 scale keeps the largest value one factor of 2 below
# 65504, so a gradient that doubles does not overflow on the first step.
HEADROOM = 2.0
# float16 is called usable when at most this share of the values still
# underflows after loss scaling (the paper trained SSD with some flushed).
_FLOAT16_TOLERANCE = 0.01
# Keeps the scaled loss finite in float32 for any loss below 2^63.
_MAX_RECOMMENDED_SCALE = 2.0**64


@dataclasses.dataclass(frozen=True)
class GradientStats:
    """What float16 and bfloat16 would do to one gradient array (or to all of them).

    Shares are fractions of all `size` values. "Underflow" counts nonzero
    values below the dtype's smallest subnormal (float16: 2^-24, they round to
    zero or to 2^-24: the value is lost); "below normal" counts nonzero values
    below the smallest normal (float16: 2^-14), underflow included (they keep
    fewer bits of precision); "overflow" counts finite values above the
    largest finite value (float16: 65504).

    Attributes:
      path: the gradient's path in the pytree, e.g. "params/Dense_0/kernel".
      shape: the array's shape (`()` for the summary over all arrays).
      size: the number of values.
      zero: share of values that are exactly zero already.
      nonfinite: share of inf or nan values.
      f16_underflow, f16_below_normal, f16_overflow: float16 shares.
      bf16_underflow, bf16_below_normal, bf16_overflow: bfloat16 shares.
      max_abs: largest finite magnitude (0.0 if none).
      min_abs: smallest nonzero finite magnitude (nan if none).
    """

    path: str
    shape: tuple[int, ...]
    size: int
    zero: float
    nonfinite: float
    f16_underflow: float
    f16_below_normal: float
    f16_overflow: float
    bf16_underflow: float
    bf16_below_normal: float
    bf16_overflow: float
    max_abs: float
    min_abs: float


@dataclasses.dataclass(frozen=True)
class MatmulShape:
    """A matrix product (dot_general) of the traced program, with its sizes.

    Attributes:
      name: where it comes from (JAX's name stack, e.g.
        "transpose(jvp(MLP))/Dense_2").
      lhs_shape, rhs_shape: the operand shapes.
      m, n, k: rows, columns and contracted size of the product (batch
        dimensions excluded).
      count: how many products of this kind and shape the program has.
    """

    name: str
    lhs_shape: tuple[int, ...]
    rhs_shape: tuple[int, ...]
    m: int
    n: int
    k: int
    count: int = 1

    @property
    def misaligned(self) -> dict[str, int]:
        """The sizes among m, n, k that are not multiples of 8."""
        return {d: v for d, v in (("M", self.m), ("N", self.n), ("K", self.k)) if v % 8}


@dataclasses.dataclass(frozen=True)
class GradientReport:
    """The result of `diagnose`.

    Attributes:
      arrays: a `GradientStats` per gradient array, in pytree order.
      total: the same over all values.
      log2_counts: counts of nonzero finite values per integer bin
        floor(log2 |g|), bins `log2_edges[:-1]`.
      log2_edges: bin edges (integers).
      float16_loss_scale: largest power of two that keeps the largest
        gradient a factor of 2 below 65504 (at least 1, at most 2^64).
      f16_underflow_scaled: share of values still below 2^-24 after that scale.
      f16_overflow_scaled: share of values above 65504 after that scale.
      recommended_policy: "mixed_bfloat16", "mixed_float16" or "float32".
      recommended_loss_scale: initial `DynamicLossScale` value for
        "mixed_float16", None otherwise (no scaling needed).
      reason: why, in one sentence.
      matmuls: every distinct matrix product of the program (empty if
        `diagnose` got gradients, not a function).
    """

    arrays: tuple[GradientStats, ...]
    total: GradientStats
    log2_counts: np.ndarray
    log2_edges: np.ndarray
    float16_loss_scale: float
    f16_underflow_scaled: float
    f16_overflow_scaled: float
    recommended_policy: str
    recommended_loss_scale: float | None
    reason: str
    matmuls: tuple[MatmulShape, ...] = ()

    @property
    def misaligned_matmuls(self) -> tuple[MatmulShape, ...]:
        """The matrix products with a size (M, N or K) that is not a multiple of 8."""
        return tuple(m for m in self.matmuls if m.misaligned)


def _path_str(path: tuple[Any, ...]) -> str:
    return jax.tree_util.keystr(path, simple=True, separator="/") or "<root>"


def _as_float_array(x: Any) -> np.ndarray | None:
    a = np.asarray(x)
    if not np.issubdtype(a.dtype, np.floating) and a.dtype != np.dtype(jnp.bfloat16):
        return None  # Integer or boolean leaves have no gradient to check.
    return np.abs(a.astype(np.float64 if a.dtype.itemsize > 4 else np.float32))


def _counts(a: np.ndarray) -> dict[str, float]:
    finite = np.isfinite(a)
    nz = finite & (a > 0)
    values = a[nz]
    return {
        "size": a.size,
        "zero": int(np.count_nonzero(a == 0)),
        "nonfinite": int(a.size - np.count_nonzero(finite)),
        "f16_underflow": int(np.count_nonzero(values < F16_TINIEST)),
        "f16_below_normal": int(np.count_nonzero(values < F16_SMALLEST_NORMAL)),
        "f16_overflow": int(np.count_nonzero(values > F16_MAX)),
        "bf16_underflow": int(np.count_nonzero(values < BF16_TINIEST)),
        "bf16_below_normal": int(np.count_nonzero(values < BF16_SMALLEST_NORMAL)),
        "bf16_overflow": int(np.count_nonzero(values > BF16_MAX)),
        "max_abs": float(values.max()) if values.size else 0.0,
        "min_abs": float(values.min()) if values.size else math.nan,
    }


_SHARES = (
    "zero",
    "nonfinite",
    "f16_underflow",
    "f16_below_normal",
    "f16_overflow",
    "bf16_underflow",
    "bf16_below_normal",
    "bf16_overflow",
)


def _stats(path: str, shape: tuple[int, ...], c: dict[str, float]) -> GradientStats:
    size = int(c["size"])
    shares = {k: (c[k] / size if size else 0.0) for k in _SHARES}
    return GradientStats(
        path=path, shape=shape, size=size, max_abs=c["max_abs"], min_abs=c["min_abs"], **shares
    )


def _float16_scale(max_abs: float) -> float:
    """Largest power of two S with max_abs * S <= 65504 / headroom, in [1, 2^64]."""
    if max_abs <= 0:
        return 2.0**15  # All zero: any scale works; the usual start.
    exponent = math.floor(math.log2(F16_MAX / (HEADROOM * max_abs)))
    return float(2.0 ** min(max(exponent, 0), int(math.log2(_MAX_RECOMMENDED_SCALE))))


def _recommend(
    total: GradientStats, under_scaled: float, over_scaled: float, scale: float
) -> tuple[str, float | None, str]:
    if total.nonfinite:
        return (
            "float32",
            None,
            (
                "the gradients already hold inf or nan in their own precision: fix that first "
                "(a non-finite loss, a log of zero, a division by zero)"
            ),
        )
    if not (total.bf16_underflow or total.bf16_overflow):
        return (
            "mixed_bfloat16",
            None,
            (
                "bfloat16 has float32's exponent range: every gradient value fits, "
                "so no loss scaling is needed"
            ),
        )
    if not over_scaled and under_scaled <= _FLOAT16_TOLERANCE:
        return (
            "mixed_float16",
            scale,
            (
                "bfloat16 cannot hold all values, float16 with a loss scale of "
                f"2^{math.log2(scale):g} can"
            ),
        )
    return "float32", None, "neither half dtype holds these gradients, even with loss scaling"


def _matmul_of(eqn: ji.JaxprEqn) -> MatmulShape | None:
    if eqn.primitive.name not in ("dot_general", "conv_general_dilated"):
        return None
    lhs, rhs = (tuple(ji.shaped(v).shape) for v in eqn.invars[:2])
    if eqn.primitive.name == "dot_general":
        (lc, rc), (lb, rb) = ji.dot_params(eqn).dimension_numbers
        m = math.prod(s for i, s in enumerate(lhs) if i not in lc and i not in lb)
        n = math.prod(s for i, s in enumerate(rhs) if i not in rc and i not in rb)
        k = math.prod(lhs[i] for i in lc)
    else:
        # A convolution, as an implicit GEMM: M = batch x output pixels, N = output
        # channels, K = input channels per group x kernel window.
        _, rhs_spec, _ = ji.conv_dimension_numbers(eqn)
        out = tuple(ji.shaped(eqn.outvars[0]).shape)
        m = math.prod(out) // max(rhs[rhs_spec[0]], 1)
        n = rhs[rhs_spec[0]]
        k = math.prod(rhs) // max(n, 1)
    name = ji.name_stack(eqn) or eqn.primitive.name
    return MatmulShape(name=name, lhs_shape=lhs, rhs_shape=rhs, m=m, n=n, k=k)


def find_matmuls(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[MatmulShape, ...]:
    """Lists the distinct matrix products and convolutions `fn(*args, **kwargs)` runs.

    Traces `fn` (nothing is computed) and walks its program, nested jit,
    scan, cond and custom-derivative bodies included.

    >>> import jax.numpy as jnp
    >>> from jmp_policy.core.diagnostics import find_matmuls
    >>> [(m.m, m.n, m.k) for m in find_matmuls(jnp.dot, jnp.ones((4, 12)), jnp.ones((12, 10)))]
    [(4, 10, 12)]
    """
    closed = jax.make_jaxpr(fn)(*args, **kwargs)
    found: dict[tuple, MatmulShape] = {}

    def walk(jaxpr: ji.Jaxpr) -> None:
        for eqn in jaxpr.eqns:
            mm = _matmul_of(eqn)
            if mm is not None:
                key = (mm.name, mm.lhs_shape, mm.rhs_shape, mm.m, mm.n, mm.k)
                old = found.get(key)
                found[key] = dataclasses.replace(mm, count=old.count + 1) if old else mm
            for sub in ji.sub_jaxprs(eqn):
                walk(sub)

    walk(closed.jaxpr)
    return tuple(found.values())


def diagnose(grad_fn: Callable[..., Any] | Any, *args: Any, **kwargs: Any) -> GradientReport:
    """Measures which gradient values float16 and bfloat16 could not hold.

    Run it on float32 gradients (the policy you are about to choose is what
    it judges) taken in the middle of training, where gradients are small:
    Micikevicius et al. found most of SSD's activation gradients below
    float16's 2^-24. To see activation gradients as well as weight
    gradients, mark them with Flax's `self.perturb("name", x)` and
    differentiate with respect to the "perturbations" collection too.

    Args:
      grad_fn: a function returning a pytree of gradients, e.g.
        `jax.grad(loss_fn)`; or the gradient pytree itself (then no
        `args`, and no matmul check).
      *args: the positional arguments to call `grad_fn` with.
      **kwargs: its keyword arguments.

    Returns:
      A `GradientReport`: per-array shares of underflow, subnormal and
      overflow values in float16 and bfloat16, magnitudes, a recommended
      policy and float16 loss scale, and the matrix products of `grad_fn`
      whose sizes are not multiples of 8. `report.to_text()` prints it.

    Raises:
      TypeError: if gradients are given with arguments, or hold no
        floating-point array.

    >>> import jax.numpy as jnp
    >>> from jmp_policy import diagnose
    >>> grads = {"w": jnp.array([1e-9, 1e-9, 1e-3, 0.5])}  # 1e-9 ~ 2^-29.9: zero in float16
    >>> report = diagnose(grads)
    >>> report.total.f16_underflow, report.recommended_policy
    (0.5, 'mixed_bfloat16')
    >>> report.float16_loss_scale  # 0.5 * 2^15 stays below 65504 / 2
    32768.0
    """
    if callable(grad_fn):
        grads = grad_fn(*args, **kwargs)
        matmuls = find_matmuls(grad_fn, *args, **kwargs)
    else:
        if args or kwargs:
            raise TypeError(
                "diagnose got gradients (not a function) and arguments; pass either "
                "diagnose(grad_fn, *args) or diagnose(grads)."
            )
        grads, matmuls = grad_fn, ()

    arrays, totals, magnitudes = [], None, []
    for path, leaf in jax.tree_util.tree_flatten_with_path(grads)[0]:
        a = _as_float_array(leaf)
        if a is None:
            continue
        c = _counts(a)
        arrays.append(_stats(_path_str(path), tuple(np.shape(leaf)), c))
        magnitudes.append(a[np.isfinite(a) & (a > 0)].astype(np.float64))
        if totals is None:
            totals = dict(c)
        else:
            for key in c:
                if key == "max_abs":
                    totals[key] = max(totals[key], c[key])
                elif key == "min_abs":
                    totals[key] = float(np.fmin(totals[key], c[key]))
                else:
                    totals[key] += c[key]
    if totals is None:
        raise TypeError(f"diagnose found no floating-point gradients in {type(grads).__name__}.")
    total = _stats("all", (), totals)

    values = np.concatenate(magnitudes) if magnitudes else np.zeros([0])
    edges = np.arange(_LOG2_LO, _LOG2_HI + 1)
    bins = np.clip(np.floor(np.log2(values)), _LOG2_LO, _LOG2_HI - 1).astype(np.int64)
    counts = np.bincount(bins - _LOG2_LO, minlength=len(edges) - 1)

    scale = _float16_scale(total.max_abs)
    size = max(total.size, 1)
    under_scaled = float(np.count_nonzero(values * scale < F16_TINIEST)) / size
    over_scaled = float(np.count_nonzero(values * scale > F16_MAX)) / size
    policy, loss_scale, reason = _recommend(total, under_scaled, over_scaled, scale)
    return GradientReport(
        arrays=tuple(arrays),
        total=total,
        log2_counts=counts,
        log2_edges=edges,
        float16_loss_scale=scale,
        f16_underflow_scaled=float(under_scaled),
        f16_overflow_scaled=float(over_scaled),
        recommended_policy=policy,
        recommended_loss_scale=loss_scale,
        reason=reason,
        matmuls=matmuls,
    )


def saved_residuals(fn: Callable, *args: Any) -> list[tuple[jax.ShapeDtypeStruct, str]]:
    """The values JAX saves in the forward pass of `fn(*args)` for its backward pass.

    Each is `(shape and dtype, where it comes from)`, as
    `jax.ad_checkpoint.print_saved_residuals` prints them: the leaves of the
    function `jax.vjp` returns, traced, each named by the equation that
    made it or the argument it is.

    >>> import jax.numpy as jnp
    >>> from jmp_policy.core.diagnostics import saved_residuals
    >>> saved = saved_residuals(lambda x: jnp.sin(x).sum(), jnp.ones(3))
    >>> [(r.shape, str(r.dtype), where.split(" from ")[0]) for r, where in saved]
    [((3,), 'float32', 'output of cos')]
    """
    closed = jax.make_jaxpr(lambda *a: jax.tree.leaves(jax.vjp(fn, *a)[1]))(*args)
    jaxpr = closed.jaxpr
    names = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    made_by = {v: eqn for eqn in jaxpr.eqns for v in eqn.outvars}
    found = []
    for v in jaxpr.outvars:
        if isinstance(v, ji.Literal):
            where = "from a constant"
        elif v in made_by:
            where = f"output of {made_by[v].primitive.name} from {ji.origin(made_by[v])}"
        elif v in jaxpr.invars:
            where = f"from the argument {names[jaxpr.invars.index(v)]}"
        else:
            where = "from a constant"
        aval = ji.shaped(v)
        found.append((jax.ShapeDtypeStruct(aval.shape, aval.dtype), where))
    return found
