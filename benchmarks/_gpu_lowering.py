"""What a GPU would run: train steps lowered for CUDA on any machine, and their structure.

JAX lowers a jitted function for a platform whose devices it does not have
(`jit(f).trace(...).lower(lowering_platforms=("cuda",))`): the StableHLO
that XLA's GPU compiler would receive. Read from it, per program: the
matrix products by operand and result types, ops of jmp_policy's CPU-only
form of half products (which must not be there), and the finiteness checks
and selects of `loss_scaled`. `check` states what each variant of the GPU
benchmark claims and returns what does not hold; `benchmarks/gpu.sh
--lower-only` prints the table.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import re
from typing import Any

import jax

from jmp_policy.engine.products.block_scaling import HADAMARD_SCOPE
from jmp_policy.engine.products.cpu_form import SCOPE as CPU_FORM_SCOPE

_DOT = re.compile(r"stablehlo\.dot_general.* : \((.*)\) -> (.*)$")
_FUNC = re.compile(r"func\.func (?:public |private )?@([\w.$-]+)\(")
_CALL = re.compile(r"\bcall @([\w.$-]+)\(")
# `jax.nn.scaled_matmul` for CUDA: (data, data, scales, scales) -> result.
_BLOCK_DOT = re.compile(r"custom_call @__op\$block_scaled_dot\(.* : \((.*)\) -> (.*?)(?: loc\(|$)")
_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*([a-zA-Z0-9]+)>")
_OP = re.compile(r"^\s*(?:%[^=]+=\s*)?\"?stablehlo\.([a-z_]+)")
# Debug locations: an op ends with `loc(#loc12)`, defined below the module as
# `#loc12 = loc("jit(step)/jmp_policy_all_finite/is_finite"(#loc9))`.
_LOC_USE = re.compile(r"loc\((#loc\d+)\)\s*$")
_LOC_DEF = re.compile(r"^(#loc\d+) = (.*)$")
E4M3, E5M2, E2M1, E8M0 = "f8E4M3FN", "f8E5M2", "f4E2M1FN", "f8E8M0FNU"


@dataclasses.dataclass(frozen=True)
class Structure:
    """The parts of a lowered program a GPU's performance and correctness depend on.

    Attributes:
      dots: `{(lhs, rhs, result) element types: count}` of its `dot_general`s,
        block-scaled products (`{(lhs, rhs, lhs scales, result): count}`) and
        the Hadamard transforms of NVFP4 (jmp_policy's own scope) aside.
      cpu_form: ops located in jmp_policy's CPU-only form of half products.
      finiteness_checks: `is_finite` ops of `all_finite` (`loss_scaled`
        checks each gradient leaf once).
      skip_selects: `select` ops of `loss_scaled`'s skipping (one per leaf of
        the updates and of the inner optimizer's state).
      highest: products at `precision=HIGHEST` (true float32, no TF32).
    """

    dots: collections.Counter[tuple[str, str, str]]
    block_dots: collections.Counter[tuple[str, str, str, str]]
    hadamards: int
    cpu_form: int
    finiteness_checks: int
    skip_selects: int
    highest: int

    def describe_dots(self) -> str:
        dots = [f"{n} {a} x {b} -> {r}" for (a, b, r), n in sorted(self.dots.items())]
        dots += [
            f"{n} {a} x {b} ({s} scales) -> {r}"
            for (a, b, s, r), n in sorted(self.block_dots.items())
        ]
        return ", ".join(dots) + (f"; {self.hadamards} Hadamard" if self.hadamards else "")


def lower(fn: Any, *args: Any, platform: str = "cuda") -> str:
    """The StableHLO text (with debug locations) of `jax.jit(fn)(*args)` for `platform`."""
    lowered = jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,))
    return lowered.as_text(debug_info=True)


def structure(text: str) -> Structure:
    """The `Structure` of a lowered program's text (`lower`)."""
    dots: collections.Counter[tuple[str, str, str]] = collections.Counter()
    lines = text.splitlines()
    locations: dict[str, str] = {}
    for line in lines:
        if m := _LOC_DEF.match(line):
            locations[m[1]] = m[2]
    cpu_form = checks = selects = highest = hadamards = 0
    for line in lines:
        op = _OP.match(line)
        if not op:
            continue
        use = _LOC_USE.search(line)
        where = locations.get(use[1], "") if use else line
        cpu_form += CPU_FORM_SCOPE in where
        checks += op[1] == "is_finite" and "jmp_policy_all_finite" in where
        selects += op[1] == "select" and "jmp_policy_skip_step" in where
        if (dot := _DOT.search(line)) and HADAMARD_SCOPE in where:
            hadamards += 1
        elif dot:
            lhs, rhs = _ELEMENT.findall(dot[1])
            (out,) = _ELEMENT.findall(dot[2])
            dots[lhs, rhs, out] += 1
            highest += "HIGHEST" in line
    return Structure(dots, _block_dots(lines), hadamards, cpu_form, checks, selects, highest)


def _block_dots(lines: list[str]) -> collections.Counter[tuple[str, str, str, str]]:
    """The block-scaled products `main` runs: `jax.nn.scaled_matmul` is a jitted
    function, lowered once per signature and called from each use."""
    own: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    calls: dict[str, list[str]] = collections.defaultdict(list)
    func = "main"
    for line in lines:
        if m := _FUNC.search(line):
            func = m[1]
        elif block := _BLOCK_DOT.search(line):
            lhs, rhs, lhs_scales, _ = _ELEMENT.findall(block[1])
            (out,) = _ELEMENT.findall(block[2])
            own[func][lhs, rhs, lhs_scales, out] += 1
        elif m := _CALL.search(line):
            calls[func].append(m[1])

    @functools.cache
    def total(func: str) -> collections.Counter:
        out = collections.Counter(own[func])
        for callee in calls[func]:
            out.update(total(callee))
        return out

    return total("main")


def check(claims: dict[str, Any], s: Structure) -> list[str]:
    """What of `claims` does not hold in `s`; empty if all do.

    Claims: `operands` (the set of element types every product's operands
    are in), `result` (every product's result type, or None for any),
    `fp8` (forward e4m3 x e4m3, backward e4m3 with e5m2: the combinations
    cuBLASLt's FP8 GEMM takes, never e5m2 x e5m2), `finiteness_checks` and
    `skip_selects` (their numbers), `highest` (every product at HIGHEST, or
    none), `block` (the element and scale types of a block format: every
    product block-scaled in them), and always: no op of the CPU-only form.
    """
    problems = []
    if s.cpu_form:
        problems.append(f"{s.cpu_form} ops of the CPU-only form")
    if not (s.dots or s.block_dots):
        problems.append("no matrix products")
    block = claims.get("block")  # (element, scale) types of a block format
    if block is not None:
        if s.dots:
            problems.append(f"{sum(s.dots.values())} products not block-scaled")
        for (lhs, rhs, scales, out), n in s.block_dots.items():
            if (lhs, rhs, scales) != (block[0], block[0], block[1]) or out != claims["result"]:
                problems.append(f"{n} block-scaled products on {lhs} x {rhs} ({scales}) -> {out}")
    elif s.block_dots:
        problems.append(f"{sum(s.block_dots.values())} block-scaled products")
    wanted = claims.get("operands")
    for (lhs, rhs, out), n in s.dots.items():
        if wanted is not None and not {lhs, rhs} <= wanted:
            problems.append(f"{n} products on {lhs} x {rhs} (expected {sorted(wanted)})")
        if claims.get("result") is not None and out != claims["result"]:
            problems.append(f"{n} products with {out} results (expected {claims['result']})")
        if claims.get("fp8") and (lhs, rhs) == (E5M2, E5M2):
            problems.append(f"{n} e5m2 x e5m2 products (no FP8 GEMM takes them)")
    if claims.get("fp8"):
        forward = _count(s, {E4M3})
        backward = _count(s, {E4M3, E5M2})
        if not forward or backward != 2 * forward:
            problems.append(f"{forward} e4m3 x e4m3 and {backward} e4m3/e5m2 products (1 : 2)")
    total = sum(s.dots.values())
    if s.highest != (total if claims.get("highest") else 0):
        problems.append(f"{s.highest} of {total} products at precision HIGHEST")
    for key in ("finiteness_checks", "skip_selects"):
        if claims.get(key) is not None and getattr(s, key) != claims[key]:
            problems.append(f"{getattr(s, key)} {key} (expected {claims[key]})")
    return problems


def _count(s: Structure, operand_types: set[str]) -> int:
    return sum(n for (lhs, rhs, _), n in s.dots.items() if {lhs, rhs} == operand_types)
