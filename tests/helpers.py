"""Helpers shared by the test files: reading lowered programs, comparing bits, loading scripts.

Import them as `from helpers import ...` (pytest puts `tests/` on `sys.path`).
"""

from __future__ import annotations

import functools
import importlib.util
import pathlib
import re
import sys
import types
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# --------------------------------------------------------------------------
# XLA:CPU options that compile the suite's small programs about 3x faster (the
# zoo and the layout tests are compile-bound; results are the same to the bit
# on the models measured): no LLVM optimisation, and the older loop emitters
# where this XLA still has them. Only those XLA accepts are passed.
FAST_COMPILE = {"xla_backend_optimization_level": 0, "xla_cpu_use_fusion_emitters": False}


@functools.cache
def _xla_accepts(name: str, value: Any) -> bool:
    """Whether this XLA compiles with the option `name=value` (it rejects unknown ones)."""
    try:
        jax.jit(lambda x: x + 1).lower(np.float32(0)).compile({name: value})
    except jax.errors.JaxRuntimeError:  # "No such compile option"
        return False
    return True


def compiler_options(options: dict[str, Any] = FAST_COMPILE) -> dict[str, Any]:
    """`options` less those the installed XLA does not know."""
    return {k: v for k, v in options.items() if _xla_accepts(k, v)}


# --------------------------------------------------------------------------
# Reading the ops of lowered StableHLO text (`jax.jit(f).lower(...).as_text()`).

# MLIR element type names -> numpy dtypes.
MLIR_DTYPES = {
    "bf16": np.dtype(jnp.bfloat16),
    "f16": np.dtype(np.float16),
    "f32": np.dtype(np.float32),
    "f64": np.dtype(np.float64),
}
CONTRACTIONS = ("dot_general", "dot", "convolution")

# An op's line: `%3 = stablehlo.add ...`, `stablehlo.return ...` or the
# generic form `%0 = "stablehlo.while"(...)`.
_OP = re.compile(r"^\s*(?:%[^=]+=\s*)?\"?stablehlo\.([a-z_]+)")
_TENSOR = re.compile(r"tensor<([^>]*)>")
_CONTRACTION_ANYWHERE = re.compile(r"stablehlo\.(dot_general|dot|convolution)\b")


class HloOp(NamedTuple):
    """One StableHLO op: its name and the types of its operands and results.

    A type is the text inside `tensor<...>`, e.g. "2x8x16xbf16" or "f32".
    """

    name: str
    operands: tuple[str, ...]
    results: tuple[str, ...]
    line: str

    @property
    def operand_types(self) -> tuple[str, ...]:
        """The element types of the operands, e.g. ("bf16", "bf16")."""
        return tuple(t.split("x")[-1] for t in self.operands)

    @property
    def result_types(self) -> tuple[str, ...]:
        return tuple(t.split("x")[-1] for t in self.results)

    @property
    def operand_dtypes(self) -> tuple[np.dtype, ...]:
        return tuple(_dtype(t) for t in self.operand_types)

    @property
    def result_dtype(self) -> np.dtype:
        (result,) = self.result_types
        return _dtype(result)

    def has_dim(self, size: int) -> bool:
        """Whether an operand or result has a dimension of `size`."""
        return any(str(size) in t.split("x")[:-1] for t in (*self.operands, *self.results))


def _dtype(name: str) -> np.dtype:
    if name not in MLIR_DTYPES:
        raise ValueError(f"unexpected element type {name!r}")
    return MLIR_DTYPES[name]


def hlo_ops(text: str, names: tuple[str, ...] | None = None) -> list[HloOp]:
    """Every op of a StableHLO module (or those named in `names`), in order.

    MLIR prints an op on one line with its signature last, `: (operands) ->
    results`, or `: type` when operands and result share one type. A matmul or
    convolution whose types cannot be read raises, so none is silently missed.

    >>> text = ("%3 = stablehlo.dot_general %1, %2, contracting_dims = [1] x [0] : "
    ...         "(tensor<2x16xbf16>, tensor<16x8xbf16>) -> tensor<2x8xf32>\\n"
    ...         "%4 = stablehlo.add %3, %3 : tensor<2x8xf32>")
    >>> [(op.name, op.operand_types, op.result_types) for op in hlo_ops(text)]
    [('dot_general', ('bf16', 'bf16'), ('f32',)), ('add', ('f32',), ('f32',))]
    """
    found = []
    for line in text.splitlines():
        match = _OP.match(line)
        if match is None or (names is not None and match[1] not in names):
            continue
        if " : " not in line:
            if match[1] in CONTRACTIONS:
                raise ValueError(f"cannot read the operand types of: {line.strip()}")
            continue
        signature = line.rsplit(" : ", 1)[1]
        ins, outs = signature.split("->", 1) if "->" in signature else (signature, signature)
        found.append(
            HloOp(match[1], tuple(_TENSOR.findall(ins)), tuple(_TENSOR.findall(outs)), line)
        )
    wanted = CONTRACTIONS if names is None else tuple(n for n in names if n in CONTRACTIONS)
    seen = sum(op.name in wanted for op in found)
    in_text = sum(m[1] in wanted for m in _CONTRACTION_ANYWHERE.finditer(text))
    if seen != in_text:  # A contraction printed in a form the pattern missed.
        raise ValueError(f"read {seen} of the {in_text} contractions {wanted} in the text")
    return found


def contractions(text: str) -> list[HloOp]:
    """Every `dot_general`, `dot` and `convolution` of a StableHLO module, in order."""
    return hlo_ops(text, CONTRACTIONS)


def lowered_ops(fn: Any, *args: Any, platform: str | None = None) -> list[HloOp]:
    """The ops of `jax.jit(fn)` lowered for this machine, or for `platform` (e.g.
    "cuda": no GPU needed)."""
    if platform is None:
        text = jax.jit(fn).lower(*args).as_text()
    else:
        text = jax.export.export(jax.jit(fn), platforms=[platform])(*args).mlir_module()
    return hlo_ops(text)


# --------------------------------------------------------------------------
# Bit-for-bit comparison.


def bits(x: Any) -> tuple[np.dtype, tuple[int, ...], bytes]:
    """A leaf's dtype, shape and bytes: equal iff the arrays are identical bit for
    bit (NaN payloads and the sign of zero included)."""
    x = np.asarray(x)
    return x.dtype, x.shape, x.tobytes()


def assert_bitwise_equal(a: Any, b: Any) -> None:
    """Asserts two pytrees have the same structure and bit-identical leaves."""
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb, (ta, tb)
    for i, (x, y) in enumerate(zip(la, lb, strict=True)):
        assert bits(x) == bits(y), f"leaf {i} of {ta} differs: {x!r} != {y!r}"


# --------------------------------------------------------------------------
# Files.

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: pathlib.Path) -> None:
    """Asserts `path` holds a PNG image with a header and some content."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert len(data) > 1000
    assert data[12:16] == b"IHDR"


ROOT = pathlib.Path(__file__).resolve().parent.parent


def load_script(relative_path: str, name: str) -> types.ModuleType:
    """Imports a script of the checkout (`examples/...`, `tests/...`) as `name`, once."""
    path = ROOT / relative_path
    module = sys.modules.get(name)
    if module is not None and pathlib.Path(getattr(module, "__file__", "")).resolve() == path:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # linen modules are dataclasses: they look it up
    spec.loader.exec_module(module)
    return module


BENCHMARKS = ROOT / "benchmarks"


def import_benchmark(name: str) -> types.ModuleType:
    """Imports `benchmarks/<name>.py` as its sibling scripts do (`import name`): run as
    `python benchmarks/x.py`, a script has `benchmarks/` on `sys.path`."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.append(str(BENCHMARKS))
    module = importlib.import_module(name)
    assert pathlib.Path(module.__file__ or "").parent == BENCHMARKS, module  # not a namesake
    return module


# --------------------------------------------------------------------------
# The Python examples of the README and the documentation pages.

_PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", flags=re.S | re.M)


def python_blocks(path: pathlib.Path) -> list[tuple[int, str]]:
    """The ```python blocks of a Markdown file: (line number of the fence, code)."""
    text = path.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in _PYTHON_BLOCK.finditer(text)]


def run_python_blocks(path: pathlib.Path) -> dict[str, Any]:
    """Runs a Markdown file's ```python blocks in order, in one namespace, as a script.

    Under JAX's default (standard) dtype promotion, as users run them. Tracebacks
    point at the file's own lines. Returns the namespace.
    """
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no Python example"
    namespace: dict[str, Any] = {}
    with jax.numpy_dtype_promotion("standard"):
        for line, code in blocks:
            exec(compile("\n" * line + code, str(path), "exec"), namespace)
    return namespace


def saved_bytes_by_dtype(loss: Any, *args: Any) -> dict[np.dtype, int]:
    """The bytes `jax.grad(loss)` saves for its backward pass, arguments left
    out, by dtype."""
    from jmp_policy.core.diagnostics import saved_residuals

    by_dtype: dict[np.dtype, int] = {}
    for aval, origin in saved_residuals(loss, *args):
        if not origin.startswith("from the argument"):
            dtype = np.dtype(aval.dtype)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + int(aval.size) * dtype.itemsize
    return by_dtype
