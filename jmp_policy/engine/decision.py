"""The decision: which precision each operation of a traced program runs in.

`Rules` name it: the primitive sets (`HALF_PRIMITIVES` take half operands and
accumulate in float32, `FLOAT32_PRIMITIVES` run in float32, `PROMOTE_PRIMITIVES`
in the widest floating dtype of their inputs, anything else as written), the
compute and matmul dtypes, the FP8 or FP4 scaling and whether `product_scope`
markers choose a product's own. `autocast` builds them from its arguments, the
linen and NNX front ends from a policy (`product_rules`); the interpreter
applies them.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any, NamedTuple

import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.dtypes import F32 as _F32
from jmp_policy.core.policy import Policy

# Every bilinear product JAX has: matmuls (grouped ones too: a mixture of
# experts' `ragged_dot`) and convolutions. Under a policy they take half
# operands and accumulate in float32, or the matmul dtype's product.
PRODUCT_PRIMITIVES: frozenset[str] = ji.PRODUCT_NAMES
HALF_PRIMITIVES: frozenset[str] = PRODUCT_PRIMITIVES

# Run in float32 (or wider): exponentials and logarithms overflow or lose
# everything in half precision, sums and products accumulate rounding error,
# squares and powers overflow float16. torch.autocast keeps the same in float32.
FLOAT32_PRIMITIVES: frozenset[str] = frozenset(
    {
        "exp", "exp2", "log", "log1p", "expm1", "pow", "integer_pow", "square",
        "sqrt", "rsqrt", "cbrt", "logistic", "erf", "erfc", "erf_inv", "lgamma",
        "digamma", "polygamma", "igamma", "igammac", "igamma_grad_a", "zeta",
        "bessel_i0e", "bessel_i1e", "regularized_incomplete_beta", "tan", "asin",
        "acos", "asinh", "acosh", "atanh", "sinh", "cosh",
        "reduce_sum", "reduce_prod", "reduce_window_sum", "cumsum", "cumprod",
        "cumlogsumexp",
    }
)  # fmt: skip

# Run in the widest floating dtype of their inputs: exact or well conditioned
# in any precision (max, min, argmax and comparisons are exact; tanh, sin and
# cos are bounded), or only moving data around.
PROMOTE_PRIMITIVES: frozenset[str] = frozenset(
    {
        "add", "add_any", "sub", "mul", "div", "rem", "max", "min", "neg", "abs",
        "sign", "floor", "ceil", "round", "nextafter", "atan2", "sin", "cos",
        "tanh", "atan", "is_finite", "eq", "ne", "lt", "le", "gt", "ge",
        "select_n", "clamp", "stop_gradient", "reduce_precision", "copy",
        "broadcast_in_dim", "reshape", "squeeze", "transpose", "rev", "slice",
        "dynamic_slice", "concatenate", "stack", "pad", "gather", "unstack",
        "split", "tile", "reduce_max", "reduce_min", "argmax", "argmin", "cummax",
        "cummin", "reduce_window_max", "reduce_window_min", "sharding_constraint",
        "name",  # `checkpoint_name`: the value, named for a remat policy.
        # Collectives between devices: a half activation is sent in half, as
        # the model's own half config sends it; one summed over devices (a
        # row-parallel layer's partial products) in the dtype it has, the
        # reduce dtype where it is a product's result.
        "all_gather", "all_to_all", "ppermute", "psum", "reduce_scatter", "pmax", "pmin",
    }
)  # fmt: skip


def known_primitive_names() -> frozenset[str]:
    return ji.primitive_names() | HALF_PRIMITIVES | FLOAT32_PRIMITIVES | PROMOTE_PRIMITIVES


@dataclasses.dataclass(frozen=True)
class Rules:
    """Which operations run in which precision."""

    compute_dtype: np.dtype
    half: frozenset[str]
    float32: frozenset[str]
    promote: frozenset[str]
    # "vjp": products through the custom VJP; "plain": lax products with
    # float32 accumulation (inside JVP rules, whose tangent products JAX must
    # transpose itself).
    products: str = "vjp"
    # The policy's matmul dtype: every dot_general takes its product (None:
    # the compute dtype, as above).
    matmul_dtype: np.dtype | None = None
    # Under an FP8 or FP4 matmul dtype: its scaling ("tensor", "rowwise", "mxfp8", "nvfp4").
    fp8_scaling: str = "tensor"
    # Whether `product_scope` markers in a product's name stack choose its
    # compute and matmul dtypes (the rules' own where there is none), and
    # whether one may name an FP8 or FP4 matmul dtype.
    scoped: bool = False
    scaled_scopes: bool = False
    # The dtype a rewritten product's results leave it in (what a sharded
    # program sums across devices); None: the compute dtype.
    reduce_dtype: np.dtype | None = None
    # The front ends: the program is traced with the policy's dtype fields
    # set, so what is half as traced is the model's own half config's doing:
    # a float32-set operation on it computes in float32 and rounds back.
    fields_set: bool = False
    # The dtype a model's config names for its computation, where the model
    # casts to it itself (MaxText's `cfg.dtype`): a cast of a half value to
    # it is the config's, a no-op in the model's own half config, and a
    # product of values so cast takes the policy.
    config_dtype: np.dtype | None = None
    # autocast's `rules=`: (a regex searched in an operation's named-scope
    # path, the rules there, None for as written), the first match winning.
    by_scope: tuple[tuple[str, Rules | None], ...] = ()

    def for_scope(self, stack: str) -> Rules | None:
        """The rules of an operation traced under the name stack `stack`."""
        return _first_scope_rule(self.by_scope, stack, self)

    @property
    def default_products(self) -> Products:
        """What decides a product outside every `product_scope`."""
        results = self.compute_dtype if self.reduce_dtype is None else self.reduce_dtype
        return Products(self.compute_dtype, self.matmul_dtype, self.fp8_scaling, results)

    @property
    def only_products(self) -> bool:
        """Only products are rewritten (`matmuls_in`); every other op runs as written."""
        return not (self.float32 or self.promote)


@functools.lru_cache(maxsize=4096)
def _first_scope_rule(by_scope: tuple, stack: str, default: Rules) -> Rules | None:
    for pattern, rules in by_scope:
        if re.search(pattern, stack):
            return rules
    return default


def matmul_rules(
    matmul_dtype: Any,
    fp8_scaling: str = "tensor",
    *,
    scoped: bool = False,
    scaled_scopes: bool = False,
    compute_dtype: Any = _F32,
    reduce_dtype: Any = None,
) -> Rules:
    """The `Rules` of `matmuls_in`: every `dot_general` takes `matmul_dtype`'s
    product; without one, a product whose operands are wider than
    `compute_dtype` takes them in it (float32 accumulation), the others run
    as written. Their results are in `reduce_dtype` (None: `compute_dtype`)."""
    return Rules(
        compute_dtype=np.dtype(compute_dtype),
        half=HALF_PRIMITIVES,
        float32=frozenset(),
        promote=frozenset(),
        matmul_dtype=None if matmul_dtype is None else np.dtype(matmul_dtype),
        fp8_scaling=fp8_scaling,
        scoped=scoped,
        scaled_scopes=scaled_scopes,
        reduce_dtype=None if reduce_dtype is None else np.dtype(reduce_dtype),
    )


class Products(NamedTuple):
    """What decides a product: the compute dtype its wider operands take, the
    matmul dtype whose product it takes (None: none), the FP8 or FP4 scaling
    and the dtype its results leave it in (the reduce dtype)."""

    compute: np.dtype
    matmul: np.dtype | None
    scaling: str
    results: np.dtype


def policy_products(policy: Policy) -> Products:
    """What decides a product under `policy`."""
    m = None if policy.matmul_dtype is None else np.dtype(policy.matmul_dtype)
    c = np.dtype(policy.compute_dtype)
    r = c if policy.reduce_dtype is None else np.dtype(policy.reduce_dtype)
    return Products(c, m, policy.fp8_scaling, r)


def product_rules(
    policy: Policy, *, scaled_scopes: bool, config_dtype: np.dtype | None = None
) -> Rules:
    """A front end's op-level rewrite under `policy`: every product takes its
    compute dtype (where its operands are wider) or its matmul dtype, except
    inside a `product_scope` (a module a rule gives other ones; with
    `scaled_scopes`, one may name an FP8 or FP4 matmul dtype). Under a
    bfloat16 compute dtype the values between products follow `autocast`'s
    lists too, so a layer no dtype field reaches stays in half as the
    model's own half config keeps it (`Rules.fields_set`); a cast to
    `config_dtype` of a half value leaves it half (`Rules.config_dtype`)."""
    c, m, scaling, r = policy_products(policy)
    rules = matmul_rules(
        m, scaling, scoped=True, scaled_scopes=scaled_scopes, compute_dtype=c, reduce_dtype=r
    )
    rules = dataclasses.replace(rules, config_dtype=config_dtype)
    if c.itemsize >= _F32.itemsize or np.finfo(c).maxexp < np.finfo(_F32).maxexp:
        # float32 and float16 compute: only the products, as the fields trace them.
        return rules
    return dataclasses.replace(
        rules, float32=FLOAT32_PRIMITIVES, promote=PROMOTE_PRIMITIVES, fields_set=True
    )
