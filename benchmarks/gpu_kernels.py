"""Where a train step's GPU time goes: its kernels by kind, per variant.

    PYTHONPATH=. python benchmarks/gpu_kernels.py [--variants NAME ...] [--size tiny|gpu]

For the variants of the GPU benchmark (`benchmarks/gpu_transformer.py`;
default `mixed_bfloat16` and the FP8 recipes), it compiles the train step,
runs two steps, then profiles three (`jax.profiler.trace` with a Perfetto
trace) and sums the GPU kernels' time per step by kind: matrix products
(cuBLAS, cuBLASLt and CUTLASS GEMMs), collectives, copies, and the rest
(XLA's fusions: elementwise work, reductions, the FP8 recipes' amax and
casts). It prints one row per variant and writes `gpu_kernels.json` to
$OUT (or ./results). Without a GPU it runs, and says it saw no GPU kernels.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

import jax

import gpu_transformer as bench

DEFAULT_VARIANTS = (
    bench.WITH_POLICY,
    bench.FP8,
    "policy mixed_float8_rowwise",
)
KINDS = ("gemm", "collective", "copy", "other")


def kind_of(kernel: str) -> str:
    """The kind of a GPU kernel, from the name CUDA gives it."""
    name = kernel.lower()
    if any(k in name for k in ("gemm", "cublas", "cutlass", "xmma", "matmul", "sm90_", "nvjet")):
        return "gemm"
    if "nccl" in name:
        return "collective"
    if "memcpy" in name or "memset" in name:
        return "copy"
    return "other"


def gpu_kernel_times(trace: dict[str, Any]) -> dict[str, float]:
    """Microseconds per kernel name, over the trace's GPU processes."""
    names = {
        e["pid"]: e["args"]["name"]
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "M" and e.get("name") == "process_name"
    }
    gpu = {pid for pid, name in names.items() if "GPU" in name.upper()}
    if not gpu and names:
        print(f"no GPU process among the trace's: {sorted(set(names.values()))[:20]}")
    times: dict[str, float] = collections.defaultdict(float)
    for e in trace.get("traceEvents", []):
        if e.get("ph") == "X" and e.get("pid") in gpu:
            times[e["name"]] += float(e.get("dur", 0.0))
    return dict(times)


def _perfetto_trace(log_dir: pathlib.Path) -> dict[str, Any]:
    (path,) = sorted(log_dir.rglob("perfetto_trace.json.gz"))[-1:]
    with gzip.open(path, "rt") as f:
        return json.load(f)


def profile(variant: bench.Variant, cfg: bench.Config, steps: int = 3) -> dict[str, Any]:
    """Per step: milliseconds of GPU kernels by kind, and the ten longest kernels."""
    _, _, tx, step = bench._build(variant, cfg)
    tokens = jax.random.randint(jax.random.key(1), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    params = jax.jit(bench.TransformerLM(cfg).init)(jax.random.key(0), tokens[:, :-1])
    opt_state = jax.jit(tx.init)(params)
    fn = jax.jit(step).lower(params, opt_state, tokens).compile()
    for _ in range(2):
        jax.block_until_ready(fn(params, opt_state, tokens))
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(steps):
                jax.block_until_ready(fn(params, opt_state, tokens))
        times = gpu_kernel_times(_perfetto_trace(pathlib.Path(tmp)))
    by_kind = dict.fromkeys(KINDS, 0.0)
    for name, us in times.items():
        by_kind[kind_of(name)] += us / steps / 1e3
    longest = sorted(times.items(), key=lambda kv: -kv[1])[:10]
    return {
        "ms_per_step": by_kind,
        "total_ms": sum(by_kind.values()),
        "longest": [(name[:120], us / steps / 1e3) for name, us in longest],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS))
    parser.add_argument("--size", choices=("gpu", "tiny"), default=None)
    args = parser.parse_args(argv)
    by_name = {v.name: v for v in bench.VARIANTS}
    unknown = [n for n in args.variants if n not in by_name]
    if unknown:
        parser.error(f"--variants: {unknown} are not among {sorted(by_name)}")
    size = args.size or ("gpu" if jax.default_backend() == "gpu" else "tiny")
    cfg = bench.CONFIGS[size]
    print(f"device: {jax.devices()[0].device_kind}, jax {jax.__version__}, size {size}")
    results = {}
    print(f"{'variant':32} {'total ms':>9} " + " ".join(f"{k:>10}" for k in KINDS))
    for name in args.variants:
        try:
            r = profile(by_name[name], cfg)
        except Exception as e:  # One variant failing must not stop the others.
            print(f"{name:32} FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        results[name] = r
        row = " ".join(f"{r['ms_per_step'][k]:10.2f}" for k in KINDS)
        print(f"{name:32} {r['total_ms']:9.2f} {row}", flush=True)
    for name, r in results.items():
        print(f"\n{name}: longest kernels, ms per step")
        for kernel, ms in r["longest"]:
            print(f"  {ms:8.3f}  {kernel}")
    if not any(r["total_ms"] for r in results.values()):
        print("no GPU kernels seen (no GPU, or the profiler saw none)")
    out = pathlib.Path(os.environ.get("OUT") or "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_kernels.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
