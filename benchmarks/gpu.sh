#!/usr/bin/env bash
# The whole GPU measurement in one command, under 8 minutes, compile included:
# the Transformer LM train step sized for an H100/H200
# (benchmarks/gpu_transformer.py) in every precision variant.
#
#   benchmarks/gpu.sh                                   # from anywhere; no installs
#   OUT=/some/dir benchmarks/gpu.sh                     # log + JSON there (else ./results)
#   JMP_POLICY_BENCH_SIZE=wide benchmarks/gpu.sh        # width 4096, 4 layers
#   JMP_POLICY_BENCH_SIZE=tiny benchmarks/gpu.sh        # seconds on a CPU: a smoke test
#   benchmarks/gpu.sh --lower-only                      # no GPU: the StableHLO's products
#   benchmarks/gpu.sh --compile-only [--targets h200_sxm] [--backends default]
#       no GPU: every variant compiled for an H100 and an H200 (memory, GEMM kernels,
#       each step's kernel traffic; --size wide for width 4096);
#       needs the CUDA plugin for the installed jaxlib, which ./run puts in
#       .venv/cuda-plugin (used from there when present); ~40 min on 2 cores
#   benchmarks/gpu.sh --compile-only --devices 8 [--targets h200_sxm] [--layouts fsdp,tp_rows]
#       no GPU: what a sharded train step sends over the wire per policy, compiled
#       for 8 x H100 and 8 x H200 (benchmarks/gpu_collectives.py); ~8 min on 2 cores
#
# It uses the JAX already installed (python3 on PATH, or $PYTHON) and this
# source tree (PYTHONPATH=.). $JMP_POLICY_BENCH_BUDGET_S (default 400 for the
# GPU size) is the benchmark's own wall-clock budget; the hard stop below
# (475 s) only catches a hang.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3 || command -v python)}"
export PYTHONPATH=".${PYTHONPATH:+:$PYTHONPATH}"
if [ "${1:-}" = --compile-only ]; then
    shift
    [ -d .venv/cuda-plugin ] && PYTHONPATH="$PYTHONPATH:$PWD/.venv/cuda-plugin"
    for arg in "$@"; do
        if [ "$arg" = --devices ]; then
            exec "$PY" benchmarks/gpu_collectives.py --require-cuda-plugin "$@"
        fi
    done
    exec "$PY" benchmarks/gpu_compile.py --require-cuda-plugin "$@"
fi
if command -v timeout >/dev/null; then
    exec timeout --kill-after=5 475 "$PY" benchmarks/gpu_transformer.py "$@"
fi
exec "$PY" benchmarks/gpu_transformer.py "$@"
