"""`benchmarks/gpu.sh`, the GPU measurement, stays runnable: its tiny CPU mode, run as a test.

The script is started as a user starts it (bash, `PYTHONPATH=.`, `$OUT`), with
`JMP_POLICY_BENCH_SIZE=tiny`. Checked: it exits 0 and writes its log and a
JSON with the expected keys; every variant runs (those that need a
`matmul_dtype` field of `Policy` are reported as not available until it
exists), all from the same parameters (the same first loss within bfloat16
rounding), with tokens per second, ratios and MFU (n/a on a CPU); the
targets are reported and not judged on a CPU. About 60 s on 2 CPU cores
(compiling 6 train steps): marked slow.

The GPU size itself is traced and lowered (not compiled, not run): every
variant builds at that size, and its matmuls take the operand dtypes and
precision it claims (bfloat16 for the half variants, HIGHEST only for
`float32 HIGHEST`).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jmp_policy.app.benchmarks import gpu_transformer as bench

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu.sh"


def _env(tmp_path, **extra) -> dict:
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env.update(
        PYTHON=sys.executable,
        OUT=str(tmp_path),
        JAX_PLATFORMS="cpu",
        # One CPU device; cheaper LLVM passes: the tiny mode only checks the script runs.
        XLA_FLAGS="--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
        **extra,
    )
    return env


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu_bench")
    # A budget far above the run's need, so that a busy machine skips no variant.
    env = _env(out, JMP_POLICY_BENCH_SIZE="tiny", JMP_POLICY_BENCH_BUDGET_S="900")
    run = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=out,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    return out, run


@pytest.mark.slow
def test_gpu_sh_tiny_mode_runs_and_writes_its_figures(tiny_run):
    out, run = tiny_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    figures = json.loads((out / bench.JSON_NAME).read_text())
    log = (out / bench.LOG_NAME).read_text()
    assert "variant" in log and "tokens/s" in log and "x float32" in log and "MFU" in log

    for key in (
        "device_kind",
        "backend",
        "jax_version",
        "size",
        "config",
        "matmul_params",
        "tokens_per_step",
        "flops_per_step",
        "flops_formula",
        "peak_bf16_dense_tflops",
        "budget_s",
        "rounds",
        "wall_s",
        "variants",
        "targets",
    ):
        assert key in figures, key
    assert figures["size"] == "tiny" and figures["backend"] == "cpu"
    cfg = bench.CONFIGS["tiny"]
    assert figures["config"]["width"] == cfg.width
    assert figures["flops_per_step"] == bench.step_flops(cfg)
    assert figures["peak_bf16_dense_tflops"] is None  # a CPU: MFU n/a
    assert cfg.min_rounds <= figures["rounds"] <= cfg.max_rounds

    variants = figures["variants"]
    assert list(variants) == [v.name for v in bench.VARIANTS]
    reference_loss = variants[bench.REFERENCE]["loss"]
    for v in bench.VARIANTS:
        entry = variants[v.name]
        if v.needs_matmul_dtype and not bench.HAS_MATMUL_DTYPE:
            assert entry["status"] == "skipped" and "not available" in entry["reason"]
            continue
        assert entry["status"] == "ok", (v.name, entry)
        assert len(entry["step_ms_rounds"]) == figures["rounds"]
        assert entry["step_ms_median"] > 0 and entry["compile_s"] > 0
        assert entry["tokens_per_s"] == pytest.approx(
            cfg.tokens_per_step / (entry["step_ms_median"] / 1e3)
        )
        assert entry["mfu"] is None
        assert entry["speedup_vs_float32"] > 0 and entry["speedup_vs_flax_bf16"] > 0
        # The same parameters and tokens: the first loss agrees up to bfloat16 rounding.
        assert math.isclose(entry["loss"], reference_loss, rel_tol=0.01), (v.name, entry["loss"])
    assert variants[bench.REFERENCE]["speedup_vs_float32"] == 1.0
    assert variants[bench.BY_HAND]["speedup_vs_flax_bf16"] == 1.0

    targets = figures["targets"]
    assert set(targets) == {
        "with_policy_speedup_vs_float32",
        "with_policy_speed_vs_flax_bf16",
        "loss_scaled_step_time_vs_plain_adam",
        "mixed_float8_speed_vs_with_policy_bf16",
    }
    for t in targets.values():
        assert t["value"] > 0 and t["judged"] is False  # not judged on a CPU


def test_bad_size_in_the_environment_is_a_usage_error(tmp_path):
    env = _env(tmp_path, JMP_POLICY_BENCH_SIZE="huge")
    run = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert run.returncode == 2
    assert "JMP_POLICY_BENCH_SIZE: 'huge' is not one of auto, gpu, tiny" in run.stderr
    assert not (tmp_path / bench.JSON_NAME).exists()


def test_flop_count_is_the_standard_formula():
    # 6 N per token (N: the matmul parameters) plus 12 L S d for attention.
    cfg = bench.CONFIGS["gpu"]
    n = cfg.layers * (4 * cfg.width**2 + 2 * cfg.width * 4 * cfg.width) + cfg.width * cfg.vocab
    assert bench.matmul_params(cfg) == n
    per_token = 6 * n + 12 * cfg.layers * cfg.seq * cfg.width
    assert bench.step_flops(cfg) == cfg.batch * cfg.seq * per_token
    assert bench.peak_bf16_tflops("NVIDIA H100 PCIe") == 756.0
    assert bench.peak_bf16_tflops("NVIDIA GH200 480GB") == 989.0


def test_matmul_parameter_count_is_the_models():
    import jax
    import jax.numpy as jnp

    cfg = bench.CONFIGS["tiny"]
    shapes = jax.eval_shape(
        bench.TransformerLM(cfg).init, jax.random.key(0), jnp.zeros((1, cfg.seq), jnp.int32)
    )
    kernels = [
        leaf.size
        for path, leaf in jax.tree_util.tree_leaves_with_path(shapes)
        if jax.tree_util.keystr(path).endswith("['kernel']")
    ]
    assert sum(kernels) == bench.matmul_params(cfg)


def test_gpu_size_step_lowers_with_the_matmul_dtypes_each_variant_claims():
    # The GPU size cannot run here, but its whole train step can be traced and
    # lowered (no compile, abstract inputs): every variant builds, and its
    # dot_generals take the operands it says (bf16 for the half variants).
    import re

    import jax
    import jax.numpy as jnp

    cfg = bench.CONFIGS["gpu"]
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    params = jax.eval_shape(bench.TransformerLM(cfg).init, jax.random.key(0), tokens)
    dot = re.compile(r"stablehlo.dot_general(.*?): \((tensor<[^>]*>), (tensor<[^>]*>)\) -> ")
    float32_variants = {bench.REFERENCE, "float32 HIGHEST"}
    with jax.numpy_dtype_promotion("standard"):
        for v in bench.VARIANTS:
            if v.needs_matmul_dtype and not bench.HAS_MATMUL_DTYPE:
                continue
            _, _, tx, step = bench._build(v, cfg)
            state = jax.eval_shape(tx.init, params)
            precision = (
                jax.default_matmul_precision(v.precision)
                if v.precision
                else contextlib.nullcontext()
            )
            with precision:
                text = jax.jit(step).lower(params, state, tokens).as_text()
            dots = dot.findall(text)
            # Forward: 8 in the scanned block (q, k, v, scores, weighted values,
            # out, 2 MLP; one scan body in the program) and the head; backward 2 each.
            assert len(dots) == 27, (v.name, len(dots))
            operands = {t.rsplit("x", 1)[1] for d in dots for t in d[1:]}
            if v.name in float32_variants:
                assert operands == {"f32>"}, (v.name, operands)
            elif not v.needs_matmul_dtype or "m=bf16" in v.policy:
                assert operands == {"bf16>"}, (v.name, operands)
            else:  # mixed_float8: e4m3 operands, the output gradients e5m2
                assert operands == {"f8E4M3FN>", "f8E5M2>"}, (v.name, operands)
            highest = ["HIGHEST" in d[0] for d in dots]
            assert all(highest) if v.precision == "highest" else not any(highest), v.name
