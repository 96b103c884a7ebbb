"""The GPU benchmark's train steps compiled for an H100 and an H200, without a GPU.

XLA compiles for an NVIDIA GPU on a machine with none ("deviceless" ahead-of-
time compilation, as JAX's `tests/deviceless_aot_test.py` does): a CUDA
topology made from a target config (`gpu_targets/*.txtpb`, one per GPU), the
arguments as `ShapeDtypeStruct`s on its device, then
`jax.jit(step).trace(...).lower().compile()`. What comes back is the real
executable's plan: its memory (`memory_analysis()`: temporary, argument and
output bytes) and its kernels (the optimised HLO: `_compiled_hlo`). Not a
timing, and not quite the real GPU's choices: without a GPU there is no
autotuning, so the GEMM back end (Triton or cuBLAS) is XLA's default guess;
each variant is also compiled with Triton GEMMs off, which gives the cuBLAS
path. It needs the CUDA plugin built for the installed jaxlib (`pip install
--no-deps jax-cuda12-plugin==V jax-cuda12-pjrt==V`, V the jaxlib version);
no CUDA toolkit or driver.

Variants: those of `gpu_transformer` (the same model, step and size) that
the targets compare: float32, Flax's hand-written bf16, `with_policy`
mixed_bfloat16, `+ loss_scaled`, `m=bf16`, `mixed_float8` (saving its FP8
operands for the backward pass, and with `fp8_residuals("operands")` saving
the bf16 ones), Flax's own FP8 (`flax fp8_ops (delayed)`: delayed scaling
in the Dense layers and attention projections of its bf16 layers),
`mixed_float8_rowwise`, `mixed_mxfp8`, `mixed_nvfp4` (H100
and H200 have no block-scaled Tensor Cores: XLA expands these products, and
their figures are an emulation's). Targets, each printed as holds / falls
short: mixed_bfloat16's temporary memory at most the hand-written config's
and half float32's; `loss_scaled` adds under 1% and no GEMM; every product of
`m=bf16` a bf16 x bf16 -> f32 GEMM; every product of the FP8 variants a GEMM
on FP8 operands (no FP8 upcast before a GEMM, no product outside one; XLA
may merge two products into one GEMM); saving the FP8 copies takes less
temporary memory than saving the operands, and than mixed_bfloat16; row-wise
FP8 reads its GEMMs' results no more often than `m=bf16` does (its scales
ride in the epilogue or in passes the program makes anyway).

What a step's kernels move (`_compiled_hlo.traffic`): each kernel launch's
operand and result bytes, a loop body's times its trip count, GEMMs apart
from the rest, printed as ratios to `mixed_bfloat16`: FP8's GEMMs read half
bf16's bytes, and what its scaling adds (amax reductions, scaled casts,
transposes of the FP8 copies) must not give that back. Targets: FP8's
non-GEMM bytes at most bf16's, its total at most 0.9x, its launches at
most 1.15x. A figure of the memory traffic, not a timing. The same targets
for `mixed_float8 (scales known)`, the bound of a scaling whose scales are
known before the casts (delayed scaling, from an amax history): mixed_float8
compiled with every scale 1 (in a process of its own), so that no amax pass
runs before a cast; its kernels count, its numbers are not a model's.

Usage::

    benchmarks/gpu.sh --compile-only                 # both GPUs, every variant
    benchmarks/gpu.sh --compile-only --size wide --targets h200_sxm \
        --variants "with_policy mixed_bfloat16,policy mixed_float8"   # width 4096
    PYTHONPATH=. python benchmarks/gpu_compile.py --targets h200_sxm
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

import _compiled_hlo
import gpu_transformer as bench

TARGETS_DIR = Path(__file__).with_name("gpu_targets")
# GEMM back ends: XLA's default, and with Triton GEMMs off (cuBLAS / cuBLASLt).
BACKENDS: dict[str, dict[str, Any]] = {
    "default": {},
    "triton-off": {"xla_gpu_enable_triton_gemm": False},
}
M_BF16, ROWWISE = "policy m=bf16", "policy mixed_float8_rowwise"
MXFP8, NVFP4 = "policy mixed_mxfp8", "policy mixed_nvfp4"
# mixed_float8 with every scale 1: the bound of delayed scaling (see above).
FP8_SCALES_KNOWN = "mixed_float8 (scales known)"
VARIANTS = (
    bench.REFERENCE, bench.BY_HAND, bench.WITH_POLICY, bench.LOSS_SCALED, M_BF16, bench.FP8,
    FP8_SCALES_KNOWN, bench.FLAX_FP8.name, ROWWISE, bench.FP8_OPERANDS, MXFP8, NVFP4,
)  # fmt: skip
JSON_NAME = "gpu_compile.json"


def target_configs() -> dict[str, str]:
    """The GPU target configs of `gpu_targets/`, by name (e.g. "h200_sxm")."""
    return {p.stem: p.read_text() for p in sorted(TARGETS_DIR.glob("*.txtpb"))}


@functools.cache
def cuda_device(target_config: str) -> Any:
    """The device of a one-GPU CUDA topology made from `target_config` (no GPU needed).

    Raises:
      RuntimeError: if JAX cannot make a CUDA topology (no CUDA plugin for this jaxlib).
    """
    return cuda_devices(target_config, 1)[0]


def cuda_devices(target_config: str, count: int) -> list[Any]:
    """The devices of a CUDA topology of `count` GPUs in one host, as `cuda_device`."""
    from jax.experimental import topologies

    try:
        topology = topologies.get_topology_desc(
            platform="cuda", target_config=target_config, topology=f"1x1x{count}"
        )
    except Exception as e:  # JAX's error for a platform without a plugin.
        version = jax.__version__
        raise RuntimeError(
            f"compiling for a GPU needs the CUDA plugin built for jaxlib {version}: pip install "
            f"--no-deps jax-cuda12-plugin=={version} jax-cuda12-pjrt=={version} "
            f"(./run puts them in .venv/cuda-plugin). JAX said: {e}"
        ) from e
    return list(topology.devices)


@dataclasses.dataclass(frozen=True)
class Row:
    """One variant compiled for one GPU with one GEMM back end."""

    variant: str
    temp_bytes: int
    argument_bytes: int
    output_bytes: int
    program: _compiled_hlo.Program
    traffic: _compiled_hlo.Traffic
    compile_s: float


def compile_variant(name: str, cfg: bench.Config, target: str, options: dict[str, Any]) -> Row:
    """Compiles the train step of the variant called `name` for the GPU `target`
    (a target config's text)."""
    if name == FP8_SCALES_KNOWN:
        return _with_scales_known(cfg, target, options)
    device = cuda_device(target)
    (variant,) = [v for v in (*bench.VARIANTS, *bench.COMPILED_ONLY) if v.name == name]
    model, _, tx, step = bench._build(variant, cfg)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def on_device(x: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    inputs = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), inputs)
    state = jax.tree.map(on_device, jax.eval_shape(tx.init, bench.trainable(params)))
    params = jax.tree.map(on_device, params)
    tokens = on_device(jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32))
    start = time.perf_counter()
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32
        compiled = jax.jit(step).trace(params, state, tokens).lower().compile(options)
    seconds = time.perf_counter() - start
    memory = compiled.memory_analysis()
    text = compiled.as_text()
    return Row(
        name,
        int(memory.temp_size_in_bytes),
        int(memory.argument_size_in_bytes),
        int(memory.output_size_in_bytes),
        _compiled_hlo.read(text),
        _compiled_hlo.traffic(text),
        seconds,
    )


def _with_scales_known(cfg: bench.Config, target: str, options: dict[str, Any]) -> Row:
    """`FP8_SCALES_KNOWN`'s row: mixed_float8 compiled in a process of its own
    (jmp_policy keeps its traces), where every FP8 scale is 1."""
    with tempfile.TemporaryDirectory() as tmp:
        row = Path(tmp) / "row.pickle"
        child = subprocess.run(
            [sys.executable, __file__, _SCALES_KNOWN_CHILD, str(row)],
            input=pickle.dumps((cfg, target, options)), capture_output=True, check=False,
        )  # fmt: skip
        if child.returncode:
            raise RuntimeError(child.stderr.decode(errors="replace")[-2000:])
        return Row(FP8_SCALES_KNOWN, *pickle.loads(row.read_bytes()))


_SCALES_KNOWN_CHILD = "--scales-known-child"


def _scales_known_child(out: str) -> None:
    """Reads `(cfg, target, options)` on stdin; writes mixed_float8's row, its
    scales 1, but for its name, to the file `out`."""
    from jmp_policy.engine.products import fp8_format

    calls = []

    def known(x: Any, fp8_max: float, axes: Any = None, mesh_axes: Any = ()) -> jax.Array:
        del fp8_max, mesh_axes
        calls.append(x.shape)
        shape = () if axes is None else tuple(1 if a in axes else n for a, n in enumerate(x.shape))
        return jnp.ones(shape, jnp.float32)

    fp8_format.fp8_scale = known
    jax.config.update("jax_platforms", "cpu")
    cfg, target, options = pickle.loads(sys.stdin.buffer.read())
    row = compile_variant(bench.FP8, cfg, target, options)
    if not calls:  # The products no longer scale through it: no bound.
        raise RuntimeError("mixed_float8's scales did not come from fp8_format.fp8_scale")
    fields = [getattr(row, f.name) for f in dataclasses.fields(row)][1:]  # All but the name.
    Path(out).write_bytes(pickle.dumps(fields))


def _fp8(t: str) -> bool:
    return t.startswith("f8")


def verdicts(rows: dict[str, Row]) -> list[tuple[str, bool | None]]:
    """Each target of one GPU and back end, with whether it holds (None: a variant missing)."""
    out: list[tuple[str, bool | None]] = []

    def target(text: str, names: Sequence[str], test: Any) -> None:
        if all(n in rows for n in names):
            out.append((text, bool(test(*(rows[n] for n in names)))))
        else:
            out.append((text, None))

    target(
        "mixed_bfloat16 temp memory <= the hand-written bf16 config's",
        (bench.WITH_POLICY, bench.BY_HAND),
        lambda p, h: p.temp_bytes <= h.temp_bytes,
    )
    target(
        "mixed_bfloat16 temp memory <= 0.5 x float32's",
        (bench.WITH_POLICY, bench.REFERENCE),
        lambda p, f: p.temp_bytes <= 0.5 * f.temp_bytes,
    )
    target(
        "loss_scaled adds < 1% temp memory and no GEMM",
        (bench.LOSS_SCALED, bench.WITH_POLICY),
        lambda s, p: (
            s.temp_bytes < 1.01 * p.temp_bytes and len(s.program.gemms) == len(p.program.gemms)
        ),
    )
    target(
        "every product of m=bf16 a bf16 x bf16 -> f32 GEMM",
        (M_BF16,),
        lambda m: (
            m.program.gemms
            and not m.program.other_dots
            and all((g.lhs, g.rhs, g.out) == ("bf16", "bf16", "f32") for g in m.program.gemms)
        ),
    )
    for name in (bench.FP8, ROWWISE):
        target(
            f"every product of {name.split()[-1]} an FP8 GEMM (no upcast before one)",
            (name,),
            lambda f: (
                f.program.gemms
                and not f.program.other_dots
                and all(_fp8(g.lhs) and _fp8(g.rhs) for g in f.program.gemms)
            ),
        )
    target(
        "mixed_float8 saves FP8 copies: temp memory < with its operands saved",
        (bench.FP8, bench.FP8_OPERANDS),
        lambda q, o: q.temp_bytes < o.temp_bytes,
    )
    target(
        "mixed_float8 temp memory < mixed_bfloat16's",
        (bench.FP8, bench.WITH_POLICY),
        lambda f, b: f.temp_bytes < b.temp_bytes,
    )
    # What FP8 must save to pay: its scaling no more traffic than bf16's
    # non-GEMM kernels, the whole step 10% less, few extra launches. The
    # same for the bound with its scales known (what delayed scaling could
    # reach) and for Flax's own delayed scaling.
    for name, label in (
        (bench.FP8, "mixed_float8"),
        (FP8_SCALES_KNOWN, f"bound: {FP8_SCALES_KNOWN}"),
        (bench.FLAX_FP8.name, f"peer: {bench.FLAX_FP8.name}"),
    ):
        target(
            f"{label} non-GEMM kernel bytes <= 1.0 x mixed_bfloat16's",
            (name, bench.WITH_POLICY),
            lambda f, b: f.traffic.other_bytes <= b.traffic.other_bytes,
        )
        target(
            f"{label} kernel bytes <= 0.9 x mixed_bfloat16's",
            (name, bench.WITH_POLICY),
            lambda f, b: f.traffic.total_bytes <= 0.9 * b.traffic.total_bytes,
        )
        target(
            f"{label} kernel launches <= 1.15 x mixed_bfloat16's",
            (name, bench.WITH_POLICY),
            lambda f, b: f.traffic.kernels <= 1.15 * b.traffic.kernels,
        )
    target(
        "rowwise FP8 scales in the epilogue or a fused pass (GEMM-result reads <= m=bf16's)",
        (ROWWISE, M_BF16),
        lambda r, m: r.program.gemm_result_readers <= m.program.gemm_result_readers,
    )
    return out


def _gemm_text(program: _compiled_hlo.Program) -> str:
    table = program.gemm_table()
    parts = [f"{n} {kind} {a} x {b} -> {o}" for (kind, a, b, o), n in sorted(table.items())]
    scales = sum(g.scale_operands for g in program.gemms)
    return ", ".join(parts) + (f"; {scales} f32 scale operands" if scales else "")


def print_table(gpu: str, backend: str, rows: dict[str, Row], log: Any) -> list[tuple[str, Any]]:
    """Prints one GPU's and back end's table and its verdicts; returns the verdicts."""
    log(f"{gpu}, GEMM back end: {backend}")
    big = max((r.temp_bytes for r in rows.values()), default=0) >= 1e9
    unit, per = ("GB", 1e9) if big else ("MB", 1e6)
    log(
        f"{'variant':<29} {'temp ' + unit:>8} {'args ' + unit:>8} {'out ' + unit:>7} "
        f"{'fusions':>7} {'GEMM reads':>10} {'other dots':>10} {'compile s':>9}  "
        "GEMMs (kernel: operands -> result)"
    )
    for r in rows.values():
        log(
            f"{r.variant:<29} {r.temp_bytes / per:>8.2f} {r.argument_bytes / per:>8.2f} "
            f"{r.output_bytes / per:>7.2f} {r.program.fusions:>7} "
            f"{r.program.gemm_result_readers:>10} {r.program.other_dots:>10} "
            f"{r.compile_s:>9.1f}  {_gemm_text(r.program)}"
        )
    _print_traffic(rows, unit, per, log)
    found = verdicts(rows)
    log_verdicts(found, log)
    return found


def _print_traffic(rows: dict[str, Row], unit: str, per: float, log: Any) -> None:
    """What each variant's kernels move in one step, and as ratios to mixed_bfloat16's."""
    base = rows.get(bench.WITH_POLICY)
    log(
        f"{'kernel traffic per step':<29} {'launches':>8} {'GEMM ' + unit:>8} "
        f"{'other ' + unit:>8} {'total ' + unit:>8}   x {bench.WITH_POLICY}: "
        "launches, GEMM, other, total"
    )
    for r in rows.values():
        t = r.traffic
        ratios = ""
        if base is not None:
            b = base.traffic
            ratios = (
                f"{t.kernels / b.kernels:.2f} {t.gemm_bytes / b.gemm_bytes:.2f} "
                f"{t.other_bytes / b.other_bytes:.2f} {t.total_bytes / b.total_bytes:.2f}"
            )
        log(
            f"{r.variant:<29} {t.kernels:>8} {t.gemm_bytes / per:>8.2f} "
            f"{t.other_bytes / per:>8.2f} {t.total_bytes / per:>8.2f}   {ratios}"
        )


def log_verdicts(found: list[tuple[str, bool | None]], log: Any) -> None:
    """Each target as `holds`, `FALLS SHORT` or `n/a` (a variant missing), then a blank line."""
    for text, holds in found:
        log(f"  {'n/a' if holds is None else 'holds' if holds else 'FALLS SHORT'}: {text}")
    log()


def write_json(out: Path | None, name: str, figures: dict[str, Any], log: Any) -> None:
    """Writes `figures` as `name` in `out` (else `$OUT`, else ./results)."""
    out = out or Path(os.environ.get("OUT") or "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / name).write_text(json.dumps(figures, indent=1) + "\n")
    log(f"wrote {out / name}")


def _row_json(r: Row) -> dict[str, Any]:
    table = r.program.gemm_table()
    return {
        "temp_bytes": r.temp_bytes,
        "argument_bytes": r.argument_bytes,
        "output_bytes": r.output_bytes,
        "fusions": r.program.fusions,
        "gemm_result_readers": r.program.gemm_result_readers,
        "other_dots": r.program.other_dots,
        "kernel_launches": r.traffic.kernels,
        "gemm_kernel_bytes": r.traffic.gemm_bytes,
        "other_kernel_bytes": r.traffic.other_bytes,
        "fp8_scale_operands": sum(g.scale_operands for g in r.program.gemms),
        "gemms": [{"kernel": k, "lhs": a, "rhs": b, "out": o, "count": n}
                  for (k, a, b, o), n in sorted(table.items())],
        "compile_s": round(r.compile_s, 2),
    }  # fmt: skip


def _names(text: str, accepted: Sequence[str], what: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in accepted]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown {what} {unknown[0] if unknown else text!r}; accepted: {', '.join(accepted)}"
        )
    return names


def main(argv: Sequence[str] | None = None) -> int:
    """Compiles the variants for each GPU and back end, prints the tables, writes the JSON.

    Args:
      argv: `--size gpu|wide|tiny` (default gpu; `--quick`: tiny, the H200, the
        default back end), `--targets` and `--backends` (comma-separated),
        `--variants` (comma-separated names of `VARIANTS`), `--out DIR`
        (default `$OUT`, else ./results), `--require-cuda-plugin` (exit 1,
        not 0, where the CUDA plugin is missing).

    Returns:
      0 if every variant compiled (or the plugin is missing and not required), else 1.
    """
    targets = target_configs()
    parser = argparse.ArgumentParser(prog="gpu_compile", description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=("gpu", "wide", "tiny"), default=None)
    parser.add_argument("--quick", action="store_true", help="tiny size, H200, default back end")
    parser.add_argument(
        "--targets", type=lambda t: _names(t, list(targets), "target"), default=None
    )
    parser.add_argument(
        "--backends", type=lambda t: _names(t, list(BACKENDS), "back end"), default=None
    )
    parser.add_argument(
        "--variants", type=lambda t: _names(t, VARIANTS, "variant"), default=list(VARIANTS)
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--require-cuda-plugin", action="store_true")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # Compile for the GPU; run nothing.
    size = args.size or ("tiny" if args.quick else "gpu")
    cfg = bench.CONFIGS[size]
    chosen = args.targets or (["h200_sxm"] if args.quick else list(targets))
    backends = args.backends or (["default"] if args.quick else list(BACKENDS))
    log = bench._Log()
    try:
        devices = {t: cuda_device(targets[t]) for t in chosen}
    except RuntimeError as e:
        log(f"gpu_compile: not run: {e}")
        return 1 if args.require_cuda_plugin else 0
    log(
        f"train steps compiled for a GPU without one (not a timing), jax {jax.__version__}: "
        f"size {size} (width {cfg.width}, {cfg.layers} layers, seq {cfg.seq}, batch {cfg.batch})"
    )
    figures: dict[str, Any] = {"jax": jax.__version__, "size": size, "targets": {}}
    failed = 0
    for name in chosen:
        gpu = f"{devices[name].device_kind} ({name}.txtpb)"
        for backend in backends:
            rows = {}
            for variant in args.variants:
                try:
                    rows[variant] = compile_variant(variant, cfg, targets[name], BACKENDS[backend])
                except Exception as e:  # Reported in the table's place; the others go on.
                    failed += 1
                    log(f"{variant}: did not compile: {type(e).__name__}: {str(e)[:300]}")
            found = print_table(gpu, backend, rows, log)
            figures["targets"].setdefault(name, {})[backend] = {
                "device_kind": devices[name].device_kind,
                "variants": {v: _row_json(r) for v, r in rows.items()},
                "verdicts": {text: holds for text, holds in found},
            }
    write_json(args.out, JSON_NAME, figures, log)
    return 1 if failed else 0


if __name__ == "__main__":
    if sys.argv[1:2] == [_SCALES_KNOWN_CHILD]:
        _scales_known_child(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
