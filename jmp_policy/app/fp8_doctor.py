"""`jmp-policy doctor --fp8`: which modules of a linen model an FP8 recipe should leave in bf16.

FP8 (and FP4) products cost accuracy unevenly: a logits head or an attention
score product may lose more than all the MLPs together. Transformer Engine
and torchao leave the choice to the user; NVIDIA's NVFP4 recipe keeps some
layers in bf16 by hand. `recommend_fp8_rules` measures it on one batch:

1. The model's output under float32 (the reference), under the fallback
   policy (`mixed_bfloat16`) and under each recipe.
2. Per module that runs products itself (its own `dot_general`s, found in
   the traced program by their module paths): the output's error when only
   that module takes the recipe and every other product the fallback: its
   sensitivity.
3. The most sensitive modules go to the fallback, as few as keep the
   output's error within the tolerance (a search over how many, each count
   measured, not assumed; several configurations share one compiled program).

The rules it prints paste into `with_policy(..., rules=...)` as they are.
Errors are relative Frobenius norms over the output's floating leaves.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import numpy as np

from jmp_policy.core import jax_internals as ji
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.integrations.linen import with_policy

RECIPES = ("mixed_float8", "mixed_float8_rowwise", "mixed_mxfp8", "mixed_nvfp4")
_CONFIGS_PER_PROGRAM = 8
_PRODUCTS = frozenset({"dot_general", "conv_general_dilated"})


@dataclasses.dataclass(frozen=True)
class RecipeReport:
    """One recipe on the model: its error, each module's sensitivity, the rules."""

    recipe: str
    error: float  # every product in the recipe
    sensitivity: dict[str, float]  # module path -> error with only it in the recipe
    kept: tuple[str, ...]  # the modules given the fallback, most sensitive first
    rules: dict[str, str]  # `with_policy` rules that keep them ({} if none needed)
    error_with_rules: float
    products_in_recipe: int  # with the rules
    within: bool  # whether the rules bring the error within the tolerance


@dataclasses.dataclass(frozen=True)
class Fp8Report:
    """What `recommend_fp8_rules` found; `str()` is the doctor's table."""

    tolerance: float
    fallback: str
    fallback_error: float
    products: dict[str, int]  # module path -> the products it runs itself
    recipes: list[RecipeReport]

    def __str__(self) -> str:
        total = sum(self.products.values())
        lines = [
            f"FP8 recipes on one batch: output error against float32 (relative norm), "
            f"tolerance {self.tolerance:.4g}; {self.fallback}: {self.fallback_error:.4g}. "
            f"{total} products in {len(self.products)} modules.",
            "",
            f"{'recipe':<22}{'error':>9}{'with rules':>12}{'products in recipe':>20}",
        ]
        for r in self.recipes:
            lines.append(
                f"{r.recipe:<22}{r.error:>9.4f}{r.error_with_rules:>12.4f}"
                f"{f'{r.products_in_recipe}/{total}':>20}"
                + ("" if r.within else "  not within: the fallback's own error is above it")
            )
        for r in self.recipes:
            lines += ["", f"{r.recipe}: error with only this module in the recipe"]
            for path, err in sorted(r.sensitivity.items(), key=lambda kv: -kv[1]):
                kept = "  -> fallback" if path in r.kept else ""
                lines.append(f"  {path:<44}{err:>9.4f}{kept}")
            if r.products_in_recipe == 0:  # The rules would turn it off everywhere.
                lines.append(
                    f"  no module stays in {r.recipe} within the tolerance: "
                    f"with_policy(apply, {self.fallback!r})"
                )
            else:
                lines.append(f"  with_policy(apply, {r.recipe!r}, rules={format_rules(r.rules)})")
        return "\n".join(lines)


def format_rules(rules: dict[str, str]) -> str:
    """`rules` as a Python literal, one rule a line, to paste into `with_policy`."""
    if not rules:
        return "{}"
    return "{\n" + "".join(f"      {k!r}: {v!r},\n" for k, v in rules.items()) + "  }"


def checked_recipes(recipes: Sequence[str | Policy] | str | Policy) -> dict[str, Policy]:
    """Each recipe's policy by its name.

    Raises:
      ValueError: if a policy spec is malformed, `recipes` is empty or one has
        no FP8 or FP4 matmul dtype.
    """
    if isinstance(recipes, (str, Policy)):
        recipes = (recipes,)  # One recipe.
    if not recipes:
        raise ValueError(
            f"recipes must name at least one FP8 or FP4 policy, such as {', '.join(RECIPES)}."
        )
    policies = {(r if isinstance(r, str) else str(r)): get_policy(r) for r in recipes}
    for name, policy in policies.items():
        if policy.matmul_dtype is None or np.dtype(policy.matmul_dtype).itemsize != 1:
            raise ValueError(
                f"recipes: {name!r} has no FP8 or FP4 matmul dtype (m=f8, f8_rowwise, mxfp8 "
                f"or nvfp4); accepted are policies such as {', '.join(RECIPES)}."
            )
    return policies


def recommend_fp8_rules(
    apply: Callable[..., Any],
    variables: Any,
    *args: Any,
    tolerance: float,
    recipes: Sequence[str | Policy] | str | Policy = RECIPES,
    fallback: str | Policy = "mixed_bfloat16",
    **kwargs: Any,
) -> Fp8Report:
    """Measures FP8 recipes on one batch and picks the modules each should leave in bf16.

    For a linen `apply` (`model.apply`): the output of `apply(variables,
    *args, **kwargs)` under float32 is the reference. Under each recipe, the
    modules running products are ranked by the error each causes alone, and
    the fewest most sensitive ones are given `fallback` until the output's
    error is within `tolerance`. The rules are module path patterns, ready
    for `with_policy(apply, recipe, rules=...)`. Products the root module
    runs itself (not in a submodule) have no path and stay in the recipe.

    Args:
      apply: a linen model's `apply`.
      variables: its variables (float32 parameters).
      *args: one batch of its inputs; `**kwargs` go to `apply` too.
      recipes: the FP8/FP4 policies to try, or one (default: per tensor,
        row-wise, MXFP8, NVFP4).
      tolerance: the largest relative error of the output against float32
        allowed (for scale: bfloat16's own error is typically 0.002 to 0.01,
        FP8's 10 to 20 times that).
      fallback: the policy the kept modules take.

    Returns:
      An `Fp8Report`: `str(report)` is the doctor's table; `report.recipes[i].rules`
      the rules of recipe i.

    Raises:
      ValueError: if a policy spec is malformed, `recipes` is empty or one has
        no FP8 or FP4 matmul dtype, `tolerance` is not positive, or no
        submodule of the model runs a product.
      TypeError: if `tolerance` is not a number.
    """
    policies = checked_recipes(recipes)
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise TypeError(f"tolerance must be a positive number, got {tolerance!r}.")
    if not tolerance > 0:
        raise ValueError(f"tolerance must be a positive number, got {tolerance!r}.")
    fallback = str(get_policy(fallback)) if isinstance(fallback, Policy) else fallback
    call = functools.partial(apply, **kwargs)
    products = {p: n for p, n in product_modules(call, variables, *args).items() if p}
    if not products:
        raise ValueError("no submodule of the model runs a matrix product: nothing to choose.")
    reference = jax.jit(with_policy(call, "float32"))(variables, *args)

    def errors(configs: Sequence[tuple[str, dict[str, str]]]) -> list[float]:
        """The output's error under each `(policy, rules)`, a few configs to a program
        (XLA compiles one program of several forward passes faster than each apart)."""
        out: list[float] = []
        for i in range(0, len(configs), _CONFIGS_PER_PROGRAM):
            chunk = configs[i : i + _CONFIGS_PER_PROGRAM]

            def run(variables, *args, chunk=chunk):
                return [with_policy(call, p, rules=r or None)(variables, *args) for p, r in chunk]

            out += [_relative_error(o, reference) for o in jax.jit(run)(variables, *args)]
        return out

    (fallback_error,) = errors([(fallback, {})])
    tol = float(tolerance)
    owners = sorted(products)

    def report(name: str) -> RecipeReport:
        n = len(owners)
        # One batch: each module alone in the recipe, then the recipe everywhere
        # and nowhere (all kept).
        first = errors(
            [(fallback, _alone(p, owners, name, fallback)) for p in owners]
            + [(name, {}), (name, _keep(owners, owners, name, fallback))]
        )
        sensitivity = dict(zip(owners, first[:n]))
        ranked = sorted(owners, key=lambda p: -sensitivity[p])
        k, err = _fewest(
            lambda ks: errors([(name, _keep(ranked[:k], owners, name, fallback)) for k in ks]),
            {0: first[n], n: first[n + 1]},
            tol,
        )
        return RecipeReport(
            recipe=name,
            error=first[n],
            sensitivity=sensitivity,
            kept=tuple(ranked[:k]),
            rules=_keep(ranked[:k], owners, name, fallback),
            error_with_rules=err,
            products_in_recipe=sum(products[p] for p in ranked[k:]),
            within=err <= tol,
        )

    reports = [report(name) for name in policies]
    return Fp8Report(tol, fallback, fallback_error, products, reports)


def _fewest(
    errors_of: Callable[[list[int]], list[float]], known: dict[int, float], tol: float
) -> tuple[int, float]:
    """`(k, its error)`: the fewest modules kept, k in [0, n], whose error is within
    `tol` (n if none is).

    `known` holds the errors of k = 0 and k = n. A search over the counts
    between (the error falls as more modules are kept), measuring up to
    `_CONFIGS_PER_PROGRAM` counts at once: eight times fewer candidates a round.
    """
    measured = dict(known)
    low, high = min(known), max(known)
    if measured[low] <= tol or measured[high] > tol:
        k = low if measured[low] <= tol else high
        return k, measured[k]
    while high - low > 1:
        step = max(1, (high - low) // (_CONFIGS_PER_PROGRAM + 1))
        ks = list(range(low + step, high, step))[:_CONFIGS_PER_PROGRAM]
        measured.update(zip(ks, errors_of(ks)))
        new_high = min((k for k in ks if measured[k] <= tol), default=high)
        low = max((k for k in ks if k < new_high), default=low)
        high = new_high
    return high, measured[high]


def _below(path: str, owners: Sequence[str]) -> list[str]:
    return [o for o in owners if o.startswith(f"{path}/")]


def _alone(path: str, owners: Sequence[str], recipe: str, fallback: str) -> dict[str, str]:
    """Rules over `fallback` putting only `path`'s own products in `recipe`."""
    rules = {path: recipe}
    if _below(path, owners):
        rules[f"{path}/*"] = fallback  # The longer pattern wins below it.
    return rules


def _keep(kept: Sequence[str], owners: Sequence[str], recipe: str, fallback: str) -> dict:
    """Rules over `recipe` putting the `kept` modules' own products in `fallback`."""
    rules = {}
    for path in kept:
        rules[path] = fallback
        if any(o not in kept for o in _below(path, owners)):
            rules[f"{path}/*"] = recipe  # Its submodules stay, unless kept themselves.
    return rules


def product_modules(apply: Callable[..., Any], variables: Any, *args: Any) -> dict[str, int]:
    """`{module path: the products it runs itself}` of a linen `apply`.

    The module paths are those the model calls (`nn.intercept_methods`); a
    product belongs to the deepest of them whose names its name stack (the
    module scopes JAX records) holds in order.
    """
    paths: set[str] = set()

    def record(next_fun, a, k, context):
        paths.add("/".join(context.module.path))
        return next_fun(*a, **k)

    with nn.intercept_methods(record):
        closed = jax.make_jaxpr(apply)(variables, *args)
    split = {p: tuple(p.split("/")) if p else () for p in paths}
    counts: dict[str, int] = {}
    for stack in _product_stacks(closed.jaxpr, ()):
        owner = max(
            (p for p, names in split.items() if _in_order(names, stack)),
            key=lambda p: len(split[p]),
            default=None,
        )
        if owner is not None:
            counts[owner] = counts.get(owner, 0) + 1
    return counts


def _product_stacks(jaxpr: ji.Jaxpr, outer: tuple[str, ...]) -> list[tuple[str, ...]]:
    stacks = []
    for eqn in jaxpr.eqns:
        stack = outer + tuple(s for s in ji.name_stack(eqn).split("/") if s)
        if eqn.primitive.name in _PRODUCTS:
            stacks.append(stack)
        for sub in ji.sub_jaxprs(eqn):
            stacks += _product_stacks(sub, stack)
    return stacks


def _in_order(names: tuple[str, ...], stack: tuple[str, ...]) -> bool:
    it = iter(stack)
    return all(name in it for name in names)


def _relative_error(got: Any, want: Any) -> float:
    """The relative Frobenius norm of `got - want` over their floating leaves."""
    pairs = [
        (np.asarray(a, np.float64), np.asarray(b, np.float64))
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        if np.issubdtype(np.asarray(b).dtype, np.floating)
    ]
    num = sum(float(np.sum((a - b) ** 2)) for a, b in pairs)
    den = sum(float(np.sum(b**2)) for _, b in pairs)
    return float(np.sqrt(num / den)) if den else float(np.sqrt(num))
