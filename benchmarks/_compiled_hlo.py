"""What XLA's GPU compiler built: the GEMMs and kernels of an optimised HLO module.

Reads the text of `jax.jit(f).lower(...).compile().as_text()` for a CUDA
target. A GEMM is a Triton GEMM fusion (`__triton_gemm`, or the nested form
`__triton_nested_gemm_fusion`), a cuBLASLt call (`__cublas$lt$matmul`, FP8:
`__cublas$lt$matmul$f8`, whose operands after the two matrices are its
float32 scales), a cuBLAS call (`__cublas$gemm`), or a cuDNN fusion. Its
operand types are those the Tensor Cores multiply: for a fusion, those of the
`dot` inside it, so an FP8 operand upcast to bf16 before the product shows
as bf16. Counted in the scheduled computations (the entry and the loop
bodies; a `nn.scan` body once, not once per layer), not in fused ones.
`residuals_read` compiles a backward pass for the default (CPU) device and
reads which of its saved values it uses.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from typing import Any

_HEADER = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%?([\w.\-]+) = (.*)$")
_CALLS = re.compile(r"calls=%?([\w.\-]+)")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
_ELEMENT = re.compile(r"^\(?([a-z][a-z0-9]*)\[")
_FUSION_KIND = re.compile(r'"kind":"([^"]+)"')
GEMM_TARGETS = {
    "__cublas$lt$matmul": "cuBLASLt",
    "__cublas$lt$matmul$f8": "cuBLASLt FP8",
    "__cublas$gemm": "cuBLAS",
}
TRITON_GEMM_KINDS = ("__triton_gemm", "__triton_nested_gemm_fusion", "__triton_scaled_dot_fusion")
# Ops that only rename a value: a reader behind them reads the GEMM's result.
_VIEWS = ("get-tuple-element", "bitcast")


@dataclasses.dataclass(frozen=True)
class Instruction:
    name: str
    type: str  # The result's shape, e.g. `f32[8,16]{1,0}` or a tuple `(f32[..], s8[..])`.
    opcode: str
    operands: tuple[str, ...]
    attributes: str
    arguments: str = ""  # What is between the parentheses: `0` for `parameter(0)`.

    @property
    def element_type(self) -> str:
        """The element type of the result (of its first element, for a tuple)."""
        m = _ELEMENT.match(self.type)
        return m[1] if m else "?"


@dataclasses.dataclass(frozen=True)
class Gemm:
    """One GEMM kernel: its back end and the element types it multiplies into."""

    kind: str  # "Triton", "cuBLASLt", "cuBLASLt FP8", "cuBLAS" or "cuDNN".
    lhs: str
    rhs: str
    out: str
    scale_operands: int  # Float32 scalars a cuBLASLt FP8 call applies in its epilogue.


@dataclasses.dataclass(frozen=True)
class Program:
    """The kernels of a compiled program.

    Attributes:
      gemms: every GEMM, in program order.
      fusions: the fused kernels (`fusion` instructions, GEMM fusions included).
      gemm_result_readers: how many instructions read a GEMM's result,
        summed over the GEMMs: each is a pass over that result, unless it
        is a GEMM epilogue.
      other_dots: `dot`s that are no GEMM's (fused into an elementwise
        kernel or left alone): products that miss the Tensor Cores' GEMMs.
    """

    gemms: tuple[Gemm, ...]
    fusions: int
    gemm_result_readers: int
    other_dots: int

    def gemm_table(self) -> collections.Counter[tuple[str, str, str, str]]:
        """`{(kind, lhs, rhs, out): count}`."""
        return collections.Counter((g.kind, g.lhs, g.rhs, g.out) for g in self.gemms)


def _closing(text: str, depth: int = 0) -> int:
    """The index in `text` where the parentheses opened before and in it close."""
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return i
    return len(text)


def _split_instruction(name: str, rest: str) -> Instruction | None:
    """`type opcode(operands), attributes` -> an `Instruction`."""
    if rest.startswith("("):  # A tuple type: up to its closing parenthesis.
        end = _closing(rest)
        type_, rest = rest[: end + 1], rest[end + 2 :]
    else:
        type_, _, rest = rest.partition(" ")
    opcode, paren, rest = rest.partition("(")
    if not paren:
        return None
    end = _closing(rest, depth=1)
    operands = tuple(re.findall(r"%([\w.\-]+)", rest[:end]))
    return Instruction(name, type_, opcode.strip(), operands, rest[end + 1 :], rest[:end])


def computations(text: str) -> dict[str, list[Instruction]]:
    """The module's computations by name, each its instructions in order."""
    out: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        if header := _HEADER.match(line):
            current = out.setdefault(header[1], [])
        elif line.strip() == "}":
            current = None
        elif current is not None and (m := _INSTRUCTION.match(line)):
            instruction = _split_instruction(m[1], m[2])
            if instruction is not None:
                current.append(instruction)
    return out


def _dot_in(name: str, comps: dict[str, list[Instruction]]) -> tuple[str, str, str] | None:
    """`(lhs, rhs, out)` element types of the `dot` in a fused computation (or one it calls)."""
    body = comps.get(name, [])
    types = {i.name: i.element_type for i in body}
    for i in body:
        if i.opcode == "dot" and len(i.operands) >= 2:
            return types.get(i.operands[0], "?"), types.get(i.operands[1], "?"), i.element_type
    for i in body:
        for called in _CALLS.findall(i.attributes):
            if found := _dot_in(called, comps):
                return found
    return None


def _library_call_in(name: str, comps: dict[str, list[Instruction]]) -> Gemm | None:
    """The cuBLAS GEMM a fused computation wraps, if any."""
    body = comps.get(name, [])
    types = {i.name: i.element_type for i in body}
    for i in body:
        if i.opcode == "custom-call" and (gemm := _gemm(i, types, comps)) is not None:
            return gemm
    return None


def _gemm(
    i: Instruction, types: dict[str, str], comps: dict[str, list[Instruction]]
) -> Gemm | None:
    if i.opcode == "custom-call":
        target = _TARGET.search(i.attributes)
        kind = GEMM_TARGETS.get(target[1]) if target else None
        if kind is None:
            return None
        lhs, rhs = (types.get(o, "?") for o in i.operands[:2])
        scales = sum(types.get(o) == "f32" for o in i.operands[2:]) if "FP8" in kind else 0
        return Gemm(kind, lhs, rhs, i.element_type, scales)
    if i.opcode == "fusion":
        fusion_kind = _FUSION_KIND.search(i.attributes)
        fusion_kind_name = fusion_kind[1] if fusion_kind else ""
        called = _CALLS.search(i.attributes)
        if fusion_kind_name in TRITON_GEMM_KINDS:
            kind = "Triton"
        elif fusion_kind_name.startswith("__cudnn"):
            kind = "cuDNN"
        else:
            # A custom fusion around a cuBLAS call (e.g. one whose operand is a
            # dynamic slice of a scanned layer's weights): the call inside.
            return _library_call_in(called[1], comps) if called else None
        dot = _dot_in(called[1], comps) if called else None
        lhs, rhs, out = dot or ("?", "?", i.element_type)
        return Gemm(kind, lhs, rhs, out, 0)
    return None


def read(text: str) -> Program:
    """The `Program` of an optimised HLO module's text."""
    comps = computations(text)
    fused = {
        name
        for body in comps.values()
        for i in body
        if i.opcode == "fusion"
        for name in _CALLS.findall(i.attributes)
    }
    gemms: list[Gemm] = []
    fusions = readers = 0
    in_gemms: set[str] = set()  # The computations GEMM fusions run.
    for name, body in comps.items():
        if name in fused:
            continue
        types = {i.name: i.element_type for i in body}
        by_operand: dict[str, list[Instruction]] = collections.defaultdict(list)
        for i in body:
            for o in set(i.operands):
                by_operand[o].append(i)
        for i in body:
            fusions += i.opcode == "fusion"
            gemm = _gemm(i, types, comps)
            if gemm is None:
                continue
            gemms.append(gemm)
            readers += _readers(i.name, by_operand)
            if i.opcode == "fusion":
                in_gemms |= _reachable(_CALLS.findall(i.attributes), comps)
    other_dots = sum(
        i.opcode == "dot" for name, body in comps.items() if name not in in_gemms for i in body
    )
    return Program(tuple(gemms), fusions, readers, other_dots)


def _reachable(names: list[str], comps: dict[str, list[Instruction]]) -> set[str]:
    """`names` and every computation they call."""
    seen: set[str] = set()
    while names:
        name = names.pop()
        if name not in seen:
            seen.add(name)
            names.extend(c for i in comps.get(name, []) for c in _CALLS.findall(i.attributes))
    return seen


def _readers(name: str, by_operand: dict[str, list[Instruction]]) -> int:
    """The instructions that read `name`, looking through views of it."""
    count = 0
    for reader in by_operand.get(name, []):
        if reader.opcode in _VIEWS:
            count += _readers(reader.name, by_operand)
        else:
            count += 1
    return count


ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")  # An array type's element and dims.
# Scheduled instructions that launch no kernel: names, views, control flow.
_NO_KERNEL = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "call",
    "conditional", "after-all", "add-dependency", "opt-barrier", "partition-id", "replica-id",
}  # fmt: skip
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
# The computations a scheduled instruction runs, and how often: a loop's
# body its trip count, its condition once more.
_RUNS = re.compile(r"(body|condition|to_apply|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_SLICES = ("dynamic-slice", "slice")


def element_bytes(hlo_type: str) -> float:
    """The bytes of one element of an HLO element type: `pred` 1, else its bit
    width over 8 (`f32` 4, `bf16` 2, `f8e4m3fn` 1, `f4e2m1fn` 0.5)."""
    if hlo_type == "pred":
        return 1.0
    bits = re.match(r"[a-z]+?(\d+)", hlo_type)
    if bits is None:
        raise ValueError(f"no bit width in the HLO element type {hlo_type!r}")
    return int(bits[1]) / 8


def type_bytes(type_: str) -> float:
    """The bytes of every array in an HLO type (`f32[8,16]{1,0}`, a tuple of them)."""
    return sum(
        element_bytes(element) * math.prod(int(d) for d in dims.split(",") if d)
        for element, dims in ARRAY.findall(type_)
        if element != "token"  # An ordering, no data.
    )


@dataclasses.dataclass(frozen=True)
class Traffic:
    """What a compiled program's kernels move in one run: launches, and bytes
    read and written (operands and results), GEMMs apart from the rest."""

    kernels: int
    gemm_bytes: float
    other_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.gemm_bytes + self.other_bytes


def traffic(text: str) -> Traffic:
    """The `Traffic` of an optimised HLO module: every kernel its schedule
    launches (the entry's, and a loop body's times its trip count), with the
    bytes of its operands and results. A fused computation that reads a
    parameter only through slices (a scanned layer's weights) counts the
    slices; one whose result is a `dynamic-update-slice` of a parameter
    writes in place: the update, not the buffer. A cuBLAS call's workspace
    is not counted."""
    comps = computations(text)
    entry = next(line for line in text.splitlines() if line.startswith("ENTRY"))
    kernels, moved = 0, {"gemm": 0.0, "other": 0.0}
    pending = [(_HEADER.match(entry)[1], 1)]  # type: ignore[index]
    while pending:
        name, times = pending.pop()
        body = comps.get(name, [])
        types = {i.name: i.type for i in body}
        elements = {i.name: i.element_type for i in body}
        for i in body:
            trips = int(m[1]) if (m := _TRIP_COUNT.search(i.attributes)) else 1
            if i.opcode in ("while", "call", "conditional"):
                for part, called in _RUNS.findall(i.attributes):
                    pending.append((called, times * (trips + (part == "condition"))))
            for branches in _BRANCHES.findall(i.attributes):
                pending += [(b.strip().lstrip("%"), times) for b in branches.split(",")]
            if i.opcode in _NO_KERNEL or i.opcode.endswith("-done"):
                continue  # An asynchronous kernel is counted at its `-start`.
            gemm = _gemm(i, elements, comps)
            kernels += times
            moved["gemm" if gemm else "other"] += times * _kernel_bytes(i, types, comps, gemm)
    return Traffic(kernels, moved["gemm"], moved["other"])


def _kernel_bytes(
    i: Instruction, types: dict[str, str], comps: dict[str, list[Instruction]], gemm: Gemm | None
) -> float:
    """The bytes one launch of the kernel `i` reads and writes."""
    called = _CALLS.search(i.attributes)
    if called:
        fused = comps.get(called[1], [])
    else:  # A lone instruction reads its operands as a fused one its parameters.
        fused = [Instruction(o, types.get(o, ""), "parameter", (), "", str(n))
                 for n, o in enumerate(i.operands)] + [i]  # fmt: skip
    params = {int(p.arguments): p.name for p in fused if p.opcode == "parameter"}
    by_name = {p.name: p for p in fused}
    root, in_place = fused[-1], None
    written = root.type  # A `fusion-start`'s own type holds its operands too.
    if gemm is not None and written.startswith("("):
        written = ARRAY.search(written)[0]  # type: ignore[index]  # Not the workspace.
    if root.opcode == "dynamic-update-slice":  # In place: the buffer is neither read nor copied.
        in_place = _through_views(root.operands[0], by_name)
        written = by_name[root.operands[1]].type
    total = type_bytes(written)
    for n, operand in enumerate(i.operands):
        param = params.get(n)
        if param is None:
            total += type_bytes(types.get(operand, ""))
        elif param != in_place:
            total += _read_bytes(param, fused, by_name)
    return total


def _through_views(name: str, by_name: dict[str, Instruction]) -> str:
    """The value `name` is a view (bitcast) of."""
    while name in by_name and by_name[name].opcode == "bitcast":
        name = by_name[name].operands[0]
    return name


def _read_bytes(param: str, fused: list[Instruction], by_name: dict[str, Instruction]) -> float:
    """The bytes a fused computation reads of its parameter `param`: the
    slices it takes, where it reads it only through slices (or views of them)."""
    readers = [
        r for r in fused
        if r.opcode != "bitcast" and any(_through_views(o, by_name) == param for o in r.operands)
    ]  # fmt: skip
    if readers and all(
        r.opcode in _SLICES and _through_views(r.operands[0], by_name) == param for r in readers
    ):
        return sum(type_bytes(r.type) for r in readers)
    return type_bytes(by_name[param].type)


def unread_parameters(text: str) -> list[int]:
    """The numbers of the entry computation's parameters that none of its instructions reads."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ENTRY"))
    parameters: dict[str, int] = {}
    read: set[str] = set()
    for line in lines[start + 1 :]:
        if line.strip() == "}":
            break
        m = _INSTRUCTION.match(line)
        instruction = _split_instruction(m[1], m[2]) if m else None
        if instruction is None:
            continue
        if instruction.opcode == "parameter":
            parameters[instruction.name] = int(line.split("parameter(", 1)[1].split(")", 1)[0])
        read.update(instruction.operands)
    return sorted(n for name, n in parameters.items() if name not in read)


def read_residuals(vjp: Any, out: Any) -> list[int]:
    """The places, among the leaves of `vjp` (a function `jax.vjp` returned,
    with its primal result `out`), of the values its backward pass, compiled
    for one device, reads: XLA drops the others (an FP8 product saves copies
    for a program that is not partitioned and its operands for one that is)."""
    import jax

    compiled = jax.jit(lambda v, g: v(g), keep_unused=True).lower(vjp, out).compile()
    unread = set(unread_parameters(compiled.as_text() or ""))
    return [i for i in range(len(jax.tree.leaves(vjp))) if i not in unread]


def residuals_read(fn: Any, *args: Any) -> list[Any]:
    """The values saved for `fn(*args)`'s backward pass that it reads, compiled
    for one device (`read_residuals`)."""
    import jax

    out, vjp = jax.vjp(fn, *args)
    leaves = jax.tree.leaves(vjp)
    return [leaves[i] for i in read_residuals(vjp, out)]
