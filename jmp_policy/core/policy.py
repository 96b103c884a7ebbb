"""Mixed precision policies and the casting of pytrees.

A superset of jmp 0.0.4's ``policy.py``: the same names, grammar and results.
Dtypes are normalised on construction to JAX's scalar types (`jnp.float32`,
what jmp's `get_policy` stores), so that identity tests, dict keys, ``str``,
hashing and equality work for any dtype spelling.
"""

from __future__ import annotations

import dataclasses
import difflib
import sys
import typing
from typing import Any, TypeVar

import jax
import jax.numpy as jnp
import numpy as np

from jmp_policy.core.dtypes import is_float

T = TypeVar("T")

# The first name of each dtype is the one `str(policy)` prints (as jmp does).
_DTYPE_NAMES = {
    np.dtype(jnp.bfloat16): ("bf16", "bfloat16"),
    np.dtype(np.float16): ("f16", "float16"),
    np.dtype(np.float32): ("full", "f32", "float32"),
    np.dtype(np.float64): ("f64", "float64"),
}
_NAME_TO_DTYPE = {n: d for d, names in _DTYPE_NAMES.items() for n in names}
# What a policy's fields hold: JAX's scalar types, as jmp's do (`jnp.float32`
# is what jmp code compares with `is` and uses as a dict key).
DType = type[Any]
_SCALAR_TYPES: dict[np.dtype, DType] = {
    np.dtype(t): typing.cast(DType, t)
    for t in (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float64, jnp.float8_e4m3fn,
              jnp.float4_e2m1fn)
}  # fmt: skip
_KEYS = {
    "p": "param_dtype",
    "params": "param_dtype",
    "c": "compute_dtype",
    "compute": "compute_dtype",
    "o": "output_dtype",
    "output": "output_dtype",
    "m": "matmul_dtype",
    "matmul": "matmul_dtype",
    "r": "reduce_dtype",
    "reduce": "reduce_dtype",
}
_PRESETS = {
    "mixed_bfloat16": "p=f32,c=bf16,o=f32",
    "mixed_float16": "p=f32,c=f16,o=f32",
    "mixed_float8": "p=f32,c=bf16,o=f32,m=f8",
    "mixed_float8_rowwise": "p=f32,c=bf16,o=f32,m=f8_rowwise",
    "mixed_mxfp8": "p=f32,c=bf16,o=f32,m=mxfp8",
    "mixed_nvfp4": "p=f32,c=bf16,o=f32,m=nvfp4",
}
_FP8 = np.dtype(jnp.float8_e4m3fn)
_FP4 = np.dtype(jnp.float4_e2m1fn)
# How a low-precision matmul dtype is scaled: FP8 with current scaling per
# tensor or per row, or one scale per block of the contraction (the block
# formats MXFP8 and NVFP4). The scalings each dtype takes, its default first.
SCALINGS = ("tensor", "rowwise", "mxfp8", "nvfp4")
_SCALINGS_OF = {_FP8: ("tensor", "rowwise", "mxfp8"), _FP4: ("nvfp4",)}
# The matmul dtype (`m=`) with its scaling, by name: half operands with float32
# accumulation, FP8 (e4m3 forward, e5m2 output gradients) or a block format.
# Names only the `m` key accepts; the first of each is what `str` prints.
_MATMUL_NAMES = {
    (np.dtype(jnp.bfloat16), "tensor"): ("bf16", "bfloat16"),
    (np.dtype(np.float16), "tensor"): ("f16", "float16"),
    (_FP8, "tensor"): ("f8", "float8", "float8_e4m3fn"),
    (_FP8, "rowwise"): ("f8_rowwise", "float8_rowwise", "float8_e4m3fn_rowwise"),
    (_FP8, "mxfp8"): ("mxfp8",),
    (_FP4, "nvfp4"): ("nvfp4",),
}
_NAME_TO_MATMUL = {n: key for key, names in _MATMUL_NAMES.items() for n in names}
_MATMUL_DTYPES = {dtype for dtype, _ in _MATMUL_NAMES}
_ACCEPTED_MATMUL = ", ".join([*_NAME_TO_MATMUL, "half"])
_ACCEPTED_DTYPES = ", ".join([*_NAME_TO_DTYPE, "half"])
_ACCEPTED_KEYS = ", ".join(_KEYS)


def check_scaling(scaling: Any, name: str = "scaling") -> str:
    """`scaling` if it is one of `SCALINGS`.

    Raises:
      ValueError: naming `name`, the value and the accepted ones.
    """
    if not (isinstance(scaling, str) and scaling in SCALINGS):
        raise ValueError(
            f"{name} must be one of {', '.join(map(repr, SCALINGS))} (FP8 with one scale "
            "per tensor, or one per row along the non-contracting dimensions; the block "
            f"formats MXFP8 and NVFP4), got {scaling!r}."
        )
    return scaling


def scalings_of(matmul_dtype: Any) -> tuple[str, ...]:
    """The scalings a matmul dtype takes, its default first."""
    if matmul_dtype is None:
        return ("tensor",)
    return _SCALINGS_OF.get(np.dtype(matmul_dtype), ("tensor",))


def half_dtype() -> type[Any]:
    """Returns the half precision scalar type of the default backend.

    `jnp.bfloat16` on TPU, `jnp.float16` elsewhere: the scalar type, as jmp
    returns it, so it can be called to build a value (`half_dtype()(2**15)`,
    as in jmp's README) and used wherever a dtype is expected.

    Returns:
      `jnp.bfloat16` or `jnp.float16`.

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> jmp.half_dtype() is jnp.float16  # on CPU and GPU
    True
    >>> jmp.half_dtype()(2**15).dtype
    dtype('float16')
    """
    on_tpu = jax.local_devices()[0].platform == "tpu"
    # A class at run time; JAX's stubs call it a protocol.
    return typing.cast(type[Any], jnp.bfloat16 if on_tpu else jnp.float16)


def to_float_dtype(value: Any, name: str) -> np.dtype:
    """Normalises a dtype-like (or a spec name such as 'bf16') to `np.dtype`;
    a `TypeError` naming the argument `name` for anything else."""
    if isinstance(value, str) and (value in _NAME_TO_DTYPE or value == "half"):
        return _parse_dtype(value)
    dtype = None
    if value is not None and not isinstance(value, (jax.Array, np.ndarray)):
        try:
            dtype = np.dtype(value)
        except Exception:  # numpy raises TypeError, ValueError, even SyntaxError.
            pass
    # Only the dtypes the spec grammar can name, so that `str` round-trips.
    if dtype is None or dtype not in _DTYPE_NAMES:
        raise TypeError(
            f"{name} must be float16, bfloat16, float32 or float64 (a dtype "
            f"or one of the names {_ACCEPTED_DTYPES}), got {value!r}."
        )
    return dtype


def _to_matmul_dtype(value: Any) -> tuple[np.dtype | None, str | None]:
    """`(dtype, the scaling its name implies or None)` of a matmul dtype-like or spec
    name ('f8', 'mxfp8'); None stays None."""
    if value is None:
        return None, None
    if isinstance(value, str) and (value in _NAME_TO_MATMUL or value == "half"):
        named, scaling = _parse_matmul(value)
        # A name of a dtype alone ('f8') leaves the scaling to the field.
        alone = value == "half" or value in _MATMUL_NAMES.get((named, "tensor"), ())
        return named, None if alone else scaling
    dtype: np.dtype | None = None
    if not isinstance(value, (jax.Array, np.ndarray)):
        try:
            dtype = np.dtype(value)
        except Exception:  # numpy raises TypeError, ValueError, even SyntaxError.
            pass
    if dtype not in _MATMUL_DTYPES:
        raise TypeError(
            "Policy.matmul_dtype must be None, bfloat16, float16, float8_e4m3fn or "
            f"float4_e2m1fn (a dtype or one of the names {_ACCEPTED_MATMUL}), got {value!r}."
        )
    return dtype, None


def _check_matmul_scaling(dtype: np.dtype | None, scaling: str) -> str:
    """`scaling` if `dtype` takes it; the dtype's own where it takes only one (FP4)."""
    accepted = scalings_of(dtype)
    if scaling in accepted:
        return scaling
    if scaling == "tensor" and len(accepted) == 1:
        return accepted[0]  # float4_e2m1fn has one recipe, NVFP4's block scaling.
    needed = next(d for d, names in _SCALINGS_OF.items() if scaling in names)
    name = _MATMUL_NAMES[needed, scaling][0]
    raise ValueError(
        f"Policy.fp8_scaling={scaling!r} needs the matmul dtype {needed.name} (spec "
        f"m={name}), got matmul_dtype={dtype}; with this matmul dtype fp8_scaling must be "
        f"one of {', '.join(map(repr, accepted))}."
    )


def _refuse_haiku(policy: Policy) -> None:
    """Haiku's `hk.mixed_precision` casts a module's inputs and parameters but
    runs its products as written: a matmul or reduce dtype would be dropped silently.

    Haiku says, by its public `current_policy()`, that it applies this very
    policy now (it makes it current before casting). A user's own cast inside
    such a module is refused too: loudly, never silently wrong. Haiku is not
    imported here: unless loaded, it applies no policy."""
    haiku = sys.modules.get("haiku.mixed_precision")
    if haiku is None or haiku.current_policy() is not policy:
        return
    words = [
        f"{what} dtype ({key}={np.dtype(d).name})"
        for what, key, d in (
            ("matmul", "m", policy.matmul_dtype),
            ("reduce", "r", policy.reduce_dtype),
        )
        if d is not None
    ]
    raise ValueError(
        f"hk.mixed_precision got the policy {policy}, whose {' and '.join(words)} "
        "Haiku cannot apply: it casts inputs and parameters, and runs every product "
        "as written. Give Haiku the policy without them "
        "(policy.with_matmul_dtype(None).with_reduce_dtype(None)) and run the "
        "transformed function under jmp_policy.autocast(apply, policy), which applies "
        "them to every product."
    )


def _is_float_array(x: Any) -> bool:
    # As jmp: jax arrays (tracers included) and numpy arrays. Numpy scalars
    # (`np.float32(3.0)`) and Python floats are left alone, as jmp leaves them.
    return isinstance(x, (jax.Array, np.ndarray)) and is_float(x)


def _is_weak(x: Any) -> bool:
    return isinstance(x, jax.Array) and jax.typeof(x).weak_type


def _cast_floating_to(tree: T, dtype: jax.typing.DTypeLike) -> T:
    dtype = np.dtype(dtype)  # Once: a scalar type would be converted at every leaf.

    def cast(x):
        if not _is_float_array(x):
            return x
        if x.dtype == dtype and not _is_weak(x) and not isinstance(x, np.ndarray):
            # Already right: no convert op in the traced program. (A numpy
            # array is mutable: the caller gets a copy, as from jmp's `astype`.)
            return x
        # jmp's `astype`: a weakly typed leaf comes back strongly typed even in
        # its own dtype, so `bf16_array * leaf` promotes as it does with jmp.
        return x.astype(dtype)

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True, init=False)
class Policy:
    """Which dtype parameters are stored in, computation runs in, and results take.

    Frozen, hashable and equal by value, so it can be a static argument of
    `jax.jit`. Dtypes are normalised on construction to JAX's scalar types,
    as jmp's `get_policy` gives them: `policy.compute_dtype is jnp.bfloat16`,
    whichever spelling (`"bf16"`, `np.dtype("bfloat16")`) built it.

    It can be subclassed as jmp's can: `matmul_dtype`, `fp8_scaling` and
    `reduce_dtype` are keyword-only in a subclass, so that its own fields may
    be required ones (`@dataclasses.dataclass(frozen=True) class P(Policy):
    buffer_dtype: Any`).

    What each word changes, read from the lowered program of one `nn.Dense`
    (every product accumulates in float32; `r` is the dtype its result is
    rounded to; products the program shows to be the author's float32 run
    as written):

    | spec | what the word changes | a `Dense`'s product, forward / backward |
    |---|---|---|
    | `p=f32,c=bf16,o=f32` | `c`: activations, and the operands of every product | `bf16 x bf16 -> bf16` / `bf16 x bf16 -> bf16` |
    | `p=f32,c=bf16,o=f32,r=f32` | `r`: the dtype products give their results in, so what devices sum | `bf16 x bf16 -> f32` / `bf16 x bf16 -> f32` |
    | `p=f32,c=bf16,o=f32,m=bf16` | `m`: the operands of products only; here `c`'s already | `bf16 x bf16 -> bf16` / `bf16 x bf16 -> bf16` |
    | `p=f32,c=f32,o=f32,m=bf16` | `m` between float32 activations: half products, results in `r`, which follows `c` | `bf16 x bf16 -> f32` / `bf16 x bf16 -> f32` |
    | `p=f32,c=bf16,o=f32,m=f8` | `m=f8`: FP8 operands with scales, e5m2 output gradients | `f8e4m3 x f8e4m3 -> bf16` / `f8e5m2 x f8e4m3 -> bf16` |

    Args:
      param_dtype: dtype parameters are stored and updated in.
      compute_dtype: dtype of activations and of the matmul inputs.
      output_dtype: dtype of the function's result.
      matmul_dtype: dtype of the operands of matrix products, or None (the
        default, as in jmp): products take the compute dtype's.
        bfloat16/float16: half operands (`half_dot_general`), also between
        activations of a wider compute dtype, results in `reduce_dtype`.
        float8_e4m3fn: FP8 products, float32 accumulation, scaled as
        `fp8_scaling` says (`fp8_dot_general`). float4_e2m1fn: NVFP4's
        block-scaled FP4 products. A name with its scaling is accepted too
        (`"mxfp8"`, `"nvfp4"`, `"f8_rowwise"`). Convolutions run in the
        compute dtype under these policies.
      fp8_scaling: under an FP8 `matmul_dtype`, `"tensor"` (the default:
        current scaling, one scale per operand; e5m2 output gradients),
        `"rowwise"` (one per row along the dimensions a product does not
        contract, so an outlier only coarsens its own row; spec
        `m=f8_rowwise`) or `"mxfp8"` (OCP MXFP8: a power-of-two scale per
        block of 32 along the contraction, e4m3 everywhere; spec `m=mxfp8`).
        float4_e2m1fn takes `"nvfp4"` only (and gets it): a float8 scale per
        block of 16 and one per tensor (spec `m=nvfp4`).
      reduce_dtype: the dtype every product's results leave it in, forward
        and backward: what a sharded program sums across devices (gradients reduced under data
        parallelism and FSDP, row-parallel results under tensor
        parallelism), as PyTorch FSDP's `reduce_dtype`. None (the default,
        FSDP's): the compute dtype, so that no policy sends more bytes than
        its compute dtype does; float32 (spec `r=f32`) keeps float32
        results and sums. A product accumulates in float32 whichever it is.

    Raises:
      TypeError: if a dtype is not a floating dtype, or `matmul_dtype` is not
        None or one of the matmul dtypes above.
      ValueError: if `fp8_scaling` is not one of those, or is one the
        `matmul_dtype` does not take.

    >>> import jax.numpy as jnp
    >>> import jmp_policy as jmp
    >>> policy = jmp.Policy(jnp.float32, "bf16", jnp.float32)
    >>> str(policy), policy.compute_dtype is jnp.bfloat16
    ('p=full,c=bf16,o=full', True)
    >>> policy.cast_to_compute({"x": jnp.ones(2), "step": 3})["x"].dtype
    dtype(bfloat16)
    """  # noqa: E501 (the table of the words: one row a line)

    param_dtype: DType
    compute_dtype: DType
    output_dtype: DType
    matmul_dtype: DType | None = dataclasses.field(default=None, kw_only=True)
    fp8_scaling: str = dataclasses.field(default="tensor", kw_only=True)
    reduce_dtype: DType | None = dataclasses.field(default=None, kw_only=True)

    # The first five positional here (`Policy(p, c, o, "mxfp8")`); a subclass's
    # generated `__init__` takes the keyword-only fields by keyword.
    def __init__(
        self,
        param_dtype: Any,
        compute_dtype: Any,
        output_dtype: Any,
        matmul_dtype: Any = None,
        fp8_scaling: str = "tensor",
        *,
        reduce_dtype: Any = None,
    ) -> None:
        for name, value in (
            ("param_dtype", param_dtype),
            ("compute_dtype", compute_dtype),
            ("output_dtype", output_dtype),
            ("matmul_dtype", matmul_dtype),
            ("fp8_scaling", fp8_scaling),
            ("reduce_dtype", reduce_dtype),
        ):
            object.__setattr__(self, name, value)
        self.__post_init__()

    def __post_init__(self):
        for field in ("param_dtype", "compute_dtype", "output_dtype"):
            dtype = to_float_dtype(getattr(self, field), f"Policy.{field}")
            object.__setattr__(self, field, _SCALAR_TYPES[dtype])
        matmul, implied = _to_matmul_dtype(self.matmul_dtype)
        scaling = check_scaling(self.fp8_scaling, "Policy.fp8_scaling")
        if implied is not None and scaling != implied:
            if scaling != "tensor":
                raise ValueError(
                    f"Policy.matmul_dtype={self.matmul_dtype!r} has the scaling {implied!r}, "
                    f"but fp8_scaling={scaling!r} was given: give one of them."
                )
            scaling = implied
        scaling = _check_matmul_scaling(matmul, scaling)
        object.__setattr__(self, "matmul_dtype", None if matmul is None else _SCALAR_TYPES[matmul])
        object.__setattr__(self, "fp8_scaling", scaling)
        reduce: Any = None
        if self.reduce_dtype is not None:
            reduce = to_float_dtype(self.reduce_dtype, "Policy.reduce_dtype")
        # The compute dtype is the default: one policy, one spelling.
        if reduce is not None and reduce != np.dtype(self.compute_dtype):
            reduce = _SCALAR_TYPES[reduce]
        else:
            reduce = None
        object.__setattr__(self, "reduce_dtype", reduce)

    def cast_to_param(self, x: T) -> T:
        """Casts the floating point arrays of a pytree to the param dtype."""
        return _cast_floating_to(x, self.param_dtype)

    def cast_to_compute(self, x: T) -> T:
        """Casts the floating point arrays of a pytree to the compute dtype.

        Raises:
          ValueError: if Haiku's `hk.mixed_precision` calls it on a policy
            with a matmul or reduce dtype, which Haiku would silently drop.
        """
        if self.matmul_dtype is not None or self.reduce_dtype is not None:
            _refuse_haiku(self)
        return _cast_floating_to(x, self.compute_dtype)

    def cast_to_output(self, x: T) -> T:
        """Casts the floating point arrays of a pytree to the output dtype."""
        return _cast_floating_to(x, self.output_dtype)

    def with_param_dtype(self, param_dtype: Any) -> Policy:
        """Returns a copy of this policy with another param dtype."""
        return dataclasses.replace(self, param_dtype=param_dtype)

    def with_compute_dtype(self, compute_dtype: Any) -> Policy:
        """Returns a copy of this policy with another compute dtype."""
        return dataclasses.replace(self, compute_dtype=compute_dtype)

    def with_output_dtype(self, output_dtype: Any) -> Policy:
        """Returns a copy of this policy with another output dtype."""
        return dataclasses.replace(self, output_dtype=output_dtype)

    def with_matmul_dtype(self, matmul_dtype: Any) -> Policy:
        """Returns a copy of this policy with another matmul dtype (None: the compute dtype).

        A name with a scaling (`"mxfp8"`, `"f8_rowwise"`) sets it; otherwise the
        scaling is kept where the new dtype takes it, else the dtype's own.

        >>> import jmp_policy as jmp
        >>> str(jmp.get_policy("mixed_bfloat16").with_matmul_dtype("f8"))
        'p=full,c=bf16,o=full,m=f8'
        >>> str(jmp.get_policy("mixed_float8").with_matmul_dtype("nvfp4"))
        'p=full,c=bf16,o=full,m=nvfp4'
        """
        dtype, implied = _to_matmul_dtype(matmul_dtype)
        scaling = implied or (
            self.fp8_scaling if self.fp8_scaling in scalings_of(dtype) else scalings_of(dtype)[0]
        )
        matmul: Any = dtype  # Normalised to a scalar type by __post_init__.
        return dataclasses.replace(self, matmul_dtype=matmul, fp8_scaling=scaling)

    def with_reduce_dtype(self, reduce_dtype: Any) -> Policy:
        """Returns a copy of this policy with another reduce dtype (None: the compute dtype).

        >>> import jmp_policy as jmp
        >>> str(jmp.get_policy("p=f32,c=bf16,o=f32,m=bf16").with_reduce_dtype("f32"))
        'p=full,c=bf16,o=full,m=bf16,r=full'
        """
        return dataclasses.replace(self, reduce_dtype=reduce_dtype)

    def with_fp8_scaling(self, fp8_scaling: str) -> Policy:
        """Returns a copy of this policy with another scaling of its FP8 matmul dtype
        (`"tensor"`, `"rowwise"`, `"mxfp8"`).

        >>> import jmp_policy as jmp
        >>> str(jmp.get_policy("mixed_float8").with_fp8_scaling("rowwise"))
        'p=full,c=bf16,o=full,m=f8_rowwise'

        Raises:
          ValueError: if the matmul dtype does not take `fp8_scaling` (FP4
            takes only `"nvfp4"`; `with_matmul_dtype("f8")` changes the dtype).
        """
        accepted = scalings_of(self.matmul_dtype)
        # The constructor reads "tensor" as not given (FP4's own recipe then): asked for, it is.
        if fp8_scaling == "tensor" and "tensor" not in accepted:
            raise ValueError(
                f"fp8_scaling='tensor': the matmul dtype {np.dtype(self.matmul_dtype).name} "
                f"takes only {', '.join(map(repr, accepted))}; for FP8 per tensor, "
                "with_matmul_dtype('f8')."
            )
        return dataclasses.replace(self, fp8_scaling=fp8_scaling)

    def __str__(self) -> str:
        p, c, o = (
            _DTYPE_NAMES[np.dtype(d)][0]
            for d in (self.param_dtype, self.compute_dtype, self.output_dtype)
        )
        text = f"p={p},c={c},o={o}"  # jmp's form, for every jmp policy.
        if self.matmul_dtype is not None:
            text += f",m={_MATMUL_NAMES[np.dtype(self.matmul_dtype), self.fp8_scaling][0]}"
        if self.reduce_dtype is not None:
            text += f",r={_DTYPE_NAMES[np.dtype(self.reduce_dtype)][0]}"
        return text


def _parse_dtype(value: str) -> np.dtype:
    if value == "half":
        return np.dtype(half_dtype())
    try:
        return _NAME_TO_DTYPE[value]
    except KeyError:
        raise ValueError(
            f"Unknown dtype {value!r}: accepted dtype names are {_ACCEPTED_DTYPES}."
        ) from None


def _parse_matmul(value: str) -> tuple[np.dtype, str]:
    """`(matmul dtype, its scaling)` of an `m=` value such as 'bf16' or 'mxfp8'."""
    if value == "half":
        return np.dtype(half_dtype()), "tensor"
    try:
        return _NAME_TO_MATMUL[value]
    except KeyError:
        raise ValueError(
            f"Unknown matmul dtype {value!r}: accepted names for m=/matmul= are {_ACCEPTED_MATMUL}."
        ) from None


def policy_argument(value: Any, name: str = "policy") -> str | Policy:
    """`value` if it is a spec string or a `Policy`; a `TypeError` naming `name` otherwise
    (DeepMind jmp's `Policy`, which Haiku takes, named as such, with the way over)."""
    if isinstance(value, (str, Policy)):
        return value
    foreign = ""
    if all(hasattr(value, f"{k}_dtype") for k in ("param", "compute", "output")):
        of = f"{type(value).__module__.split('.')[0]}.{type(value).__qualname__}"
        foreign = (
            f" (a {of}, another library's class; jmp_policy.Policy(p.param_dtype, "
            "p.compute_dtype, p.output_dtype) is the same policy)"
        )
    raise TypeError(
        f"{name} must be a policy spec string such as 'mixed_bfloat16' or a "
        f"jmp_policy.Policy, got {value!r}{foreign}."
    )


def get_policy(policy_name: str | Policy) -> Policy:
    """Parses a policy from a spec string (jmp's grammar, plus presets).

    A spec is a dtype name (all three dtypes), a preset (`mixed_bfloat16`,
    `mixed_float16`) or comma-separated `key=dtype` parts with keys
    `p`/`params`, `c`/`compute`, `o`/`output`, `m`/`matmul`, `r`/`reduce`.
    Params default to float32, compute follows params and output follows
    compute; the matmul dtype (`bf16`, `f16`, `f8` = float8_e4m3fn,
    `f8_rowwise` for FP8 with row-wise scaling, and the block formats `mxfp8`
    and `nvfp4`) is None unless given; the reduce dtype (what products'
    results, and so the sums across devices, are in) follows compute.
    Presets: `mixed_float8` is `p=f32,c=bf16,o=f32,m=f8`, and
    `mixed_float8_rowwise`, `mixed_mxfp8`, `mixed_nvfp4` the same with
    `m=f8_rowwise`, `m=mxfp8`, `m=nvfp4`. A preset may be followed by
    key=dtype parts, which replace its own (`"mixed_bfloat16,r=f32"`).
    White space around `,` and `=` is ignored. A `Policy` is returned
    unchanged.

    Args:
      policy_name: the spec string, e.g. `"p=f32,c=bf16,o=f32"`, or a
        `Policy` (jmp's name for the argument).

    Returns:
      The `Policy`.

    Raises:
      ValueError: quoting the bad part, if the spec cannot be parsed or
        gives a dtype twice (`"p=f32,params=bf16"`).
      TypeError: if `policy_name` is neither a string nor a `Policy`.

    >>> import jmp_policy as jmp
    >>> str(jmp.get_policy("c=bf16"))
    'p=full,c=bf16,o=bf16'
    >>> jmp.get_policy("mixed_float16") == jmp.get_policy("p = f32, c = f16, o = f32")
    True
    >>> str(jmp.get_policy("mixed_float8"))
    'p=full,c=bf16,o=full,m=f8'
    >>> jmp.get_policy("mixed_float8_rowwise").fp8_scaling
    'rowwise'
    >>> policy = jmp.get_policy("mixed_nvfp4")
    >>> policy.matmul_dtype, policy.fp8_scaling
    (<class 'jax.numpy.float4_e2m1fn'>, 'nvfp4')
    >>> str(jmp.get_policy("p=f32,c=bf16,o=f32,m=bf16,r=f32"))
    'p=full,c=bf16,o=full,m=bf16,r=full'
    """
    spec = policy_argument(policy_name, "policy_name")
    if isinstance(spec, Policy):
        return spec
    text = _PRESETS.get(spec.strip(), spec)
    head, _, tail = text.partition(",")
    if head.strip() in _PRESETS:
        # A preset and key=dtype parts ("mixed_bfloat16,r=f32"): the parts win.
        replaced = {_KEYS.get(part.partition("=")[0].strip()) for part in tail.split(",")}
        own = _PRESETS[head.strip()].split(",")
        text = ",".join([*(p for p in own if _KEYS[p.split("=")[0]] not in replaced), tail])
    if "=" not in text:
        name = text.strip()
        if name not in _NAME_TO_DTYPE and name != "half":
            # A bare word may be a misspelt preset as well as a misspelt dtype.
            close = difflib.get_close_matches(name, [*_PRESETS, *_NAME_TO_DTYPE, "half"], 1)
            raise ValueError(
                f"Unknown dtype {name!r} in policy spec {spec!r}"
                + (f" (did you mean {close[0]!r}?)" if close else "")
                + f": accepted are a dtype name ({_ACCEPTED_DTYPES}), a preset "
                f"({', '.join(_PRESETS)}) or key=dtype parts with key one of {_ACCEPTED_KEYS}."
            )
        dtype = _parse_dtype(name)
        return Policy(dtype, dtype, dtype)
    dtypes: dict[str, np.dtype] = {}
    given: dict[str, str] = {}
    scaling = "tensor"
    for part in text.split(","):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or "=" in value or not key or not value:
            raise ValueError(
                f"Bad part {part.strip()!r} in policy spec {spec!r}: each part must be "
                f"key=dtype with key one of {_ACCEPTED_KEYS} and dtype one of "
                f"{_ACCEPTED_DTYPES} (or the whole spec a dtype name or one of "
                f"{', '.join(_PRESETS)})."
            )
        if key not in _KEYS:
            raise ValueError(
                f"Unknown key {key!r} in policy spec {spec!r}: accepted keys are {_ACCEPTED_KEYS}."
            )
        field = _KEYS[key]
        if field in given:
            # jmp lets the last one win silently; one of the two is a mistake.
            raise ValueError(
                f"Duplicate key {key!r} in policy spec {spec!r}: {field} is already set by "
                f"{given[field]!r}; give each of param (p/params), compute (c/compute), "
                "output (o/output), matmul (m/matmul) and reduce (r/reduce) at most once."
            )
        given[field] = part.strip()
        if field == "matmul_dtype":
            dtypes[field], scaling = _parse_matmul(value)
        else:
            dtypes[field] = _parse_dtype(value)
    param = dtypes.get("param_dtype", np.dtype(np.float32))
    compute = dtypes.get("compute_dtype", param)
    output = dtypes.get("output_dtype", compute)
    return Policy(
        param, compute, output, dtypes.get("matmul_dtype"), scaling,
        reduce_dtype=dtypes.get("reduce_dtype"),
    )  # fmt: skip


def cast_to_full(tree: T) -> T:
    """Casts the floating point arrays of a pytree to float32."""
    return _cast_floating_to(tree, np.dtype(np.float32))


def cast_to_half(tree: T) -> T:
    """Casts the floating point arrays of a pytree to `half_dtype()`."""
    return _cast_floating_to(tree, np.dtype(half_dtype()))
