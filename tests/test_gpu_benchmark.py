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

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import import_benchmark

ROOT = Path(__file__).resolve().parent.parent
bench = import_benchmark("gpu_transformer")
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
    assert "JMP_POLICY_BENCH_SIZE: 'huge' is not one of auto, gpu, wide, tiny" in run.stderr
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


# ------------------------------------------------------- the GPU path, lowered for CUDA

# What each variant's train step at the GPU size must be, as a GPU would get it:
# its products (9 forward: 8 in the one scanned block and the head; 18 backward).
EXPECTED_PRODUCTS = {
    "float32": "27 f32 x f32 -> f32",
    "flax dtype=bf16": "27 bf16 x bf16 -> bf16",
    "with_policy mixed_bfloat16": "27 bf16 x bf16 -> bf16",
    "with_policy + loss_scaled": "27 bf16 x bf16 -> bf16",
    "with_policy + half_dot_general": "27 bf16 x bf16 -> f32",
    "policy m=bf16": "27 bf16 x bf16 -> f32",
    # FP8 operands straight into the products: e4m3 x e4m3 forward, the e5m2
    # output gradient with a saved e4m3 operand backward (never e5m2 x e5m2).
    "policy mixed_float8": "9 f8E4M3FN x f8E4M3FN -> bf16, 18 f8E5M2 x f8E4M3FN -> bf16",
    "float32 HIGHEST": "27 f32 x f32 -> f32",
    "policy mixed_float8_rowwise": "9 f8E4M3FN x f8E4M3FN -> bf16, 18 f8E5M2 x f8E4M3FN -> bf16",
    # Block-scaled (jax.nn.scaled_matmul's custom call): e4m3 with e8m0 scales
    # in all three products; e2m1 with e4m3 scales, and the Hadamard transform
    # of both operands of each weight-gradient product.
    "policy mixed_mxfp8": "27 f8E4M3FN x f8E4M3FN (f8E8M0FNU scales) -> bf16",
    "policy mixed_nvfp4": "27 f4E2M1FN x f4E2M1FN (f8E4M3FN scales) -> bf16; 18 Hadamard",
}


@pytest.fixture(scope="module")
def lower_only_run(tmp_path_factory):
    # As a user without a GPU runs it; lowering only, about 10 s.
    out = tmp_path_factory.mktemp("gpu_lower")
    env = _env(out)
    env.pop("XLA_FLAGS")
    return subprocess.run(
        ["bash", str(SCRIPT), "--lower-only"],
        cwd=out, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_gpu_sh_lower_only_prints_what_a_gpu_would_run(lower_only_run):
    run = lower_only_run
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "lowered for cuda" in run.stdout and "11 of 11 variants as claimed" in run.stdout
    assert "NOT AS CLAIMED" not in run.stdout
    rows = {}
    for line in run.stdout.splitlines():
        if line[:32].rstrip() in EXPECTED_PRODUCTS and line[32:33] == " ":
            rows[line[:32].rstrip()] = line[33:].split(None, 4)
    assert list(rows) == list(EXPECTED_PRODUCTS), run.stdout
    for name, (cpu_form, checks, selects, highest, products) in rows.items():
        assert products == EXPECTED_PRODUCTS[name], (name, products)
        assert cpu_form == "0", name  # no CPU-only branch in a CUDA program
        # loss_scaled: each of the 22 gradient leaves checked once, one select
        # per leaf of the updates (22) and of adam's state (mu, nu, count: 45).
        assert (checks, selects) == (("22", "67") if name == bench.LOSS_SCALED else ("0", "0"))
        assert highest == ("27" if name == "float32 HIGHEST" else "0"), name


def test_the_check_sees_the_cpu_form_where_there_is_one(monkeypatch):
    # Not vacuous: the same program lowered for the CPU holds the CPU-only
    # form of its half products (on, as under a jaxlib that needs it), and
    # `check` reports it.
    import jax
    import jax.numpy as jnp

    from jmp_policy.engine.products import cpu_form

    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", True)
    _gpu_lowering = import_benchmark("_gpu_lowering")

    cfg = bench.CONFIGS["tiny"]
    variant = next(v for v in bench.VARIANTS if v.policy == "p=f32,c=bf16,o=f32,m=bf16,r=f32")
    tokens = jax.ShapeDtypeStruct((cfg.batch, cfg.seq + 1), jnp.int32)
    inputs = jax.ShapeDtypeStruct((cfg.batch, cfg.seq), jnp.int32)
    params = jax.eval_shape(bench.TransformerLM(cfg).init, jax.random.key(0), inputs)
    _, _, tx, step = bench._build(variant, cfg)
    state = jax.eval_shape(tx.init, params)
    claims = bench.claims(variant, len(jax.tree.leaves(params)), 0)
    with jax.numpy_dtype_promotion("standard"):
        for platform, has_cpu_form in (("cpu", True), ("cuda", False)):
            text = _gpu_lowering.lower(step, params, state, tokens, platform=platform)
            s = _gpu_lowering.structure(text)
            assert (s.cpu_form > 0) is has_cpu_form, platform
            problems = _gpu_lowering.check(claims, s)
            assert any("CPU-only form" in p for p in problems) is has_cpu_form, problems
            assert s.dots == {("bf16", "bf16", "f32"): 27}, s.dots


def test_flax_fp8_variant_trains_and_replaces_its_state_by_its_gradient():
    # The peer's delayed scaling, as Flax's train_state runs it: adam trains
    # the params only; the FP8 collection takes its "gradient" (this step's
    # amaxes pushed into each history); its products are FP8 in both passes.
    import jax
    import numpy as np

    _gpu_lowering = import_benchmark("_gpu_lowering")

    cfg = bench.CONFIGS["tiny"]
    model, _, tx, step = bench._build(bench.FLAX_FP8, cfg)
    tokens = jax.random.randint(jax.random.key(0), (cfg.batch, cfg.seq + 1), 0, cfg.vocab)
    with jax.numpy_dtype_promotion("standard"):  # Flax's and optax's own code
        variables = model.init(jax.random.key(1), tokens[:, :-1])
        opt_state = tx.init(bench.trainable(variables))
        new, _, loss = jax.jit(step)(variables, opt_state, tokens)
        text = _gpu_lowering.lower(step, variables, opt_state, tokens)
    assert jax.tree.structure(bench.trainable(variables)) == jax.tree.structure(variables["params"])
    assert np.isfinite(loss) and jax.tree.structure(new) == jax.tree.structure(variables)
    history = new[bench.OWG]["head"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"]
    assert not np.any(variables[bench.OWG]["head"]["Fp8DirectDotGeneralOp_0"]["input_amax_history"])
    assert history[0] > 0 and not np.any(history[1:])  # this step's amax, first
    moved = jax.tree.map(lambda a, b: bool(np.any(a != b)), new["params"], variables["params"])
    assert all(jax.tree.leaves(moved))
    dots = _gpu_lowering.structure(text).dots
    assert any(a.startswith("f8") and b.startswith("f8") for a, b, _ in dots), dots


def test_readme_first_example_lowers_for_cuda_as_a_gpu_needs_it():
    # The README's train step (float16 layers, loss_scaled): on a GPU, every
    # product float16, no CPU-only branch, each gradient checked once.
    import re

    import jax

    _gpu_lowering = import_benchmark("_gpu_lowering")

    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    # The first example (the first train step), without its 100 training steps.
    block = next(b for b in blocks if "def train_step(params, opt_state, x, y)" in b)
    namespace: dict = {}
    with jax.numpy_dtype_promotion("standard"):
        exec(block.split("for step in range")[0], namespace)
        args = [namespace[k] for k in ("params", "opt_state", "x", "y")]
        text = _gpu_lowering.lower(namespace["train_step"], *args)
    s = _gpu_lowering.structure(text)
    leaves = len(jax.tree.leaves(namespace["params"]))
    state_leaves = len(jax.tree.leaves(namespace["opt_state"].inner_state))
    # 2 Dense layers: 2 products forward, 3 backward (no input gradient for x).
    assert s.dots == {("f16", "f16", "f16"): 5}, s.dots
    assert (s.cpu_form, s.finiteness_checks, s.skip_selects) == (0, leaves, leaves + state_leaves)


def test_kernel_profile_sums_gpu_kernels_by_kind():
    # `benchmarks/gpu_kernels.py` reads a Perfetto trace: only the GPU
    # processes' kernels count, each by the kind its name says.
    gpu_kernels = import_benchmark("gpu_kernels")
    trace = {
        "traceEvents": [
            {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/device:GPU:0"}},
            {"ph": "X", "pid": 7, "name": "nvjet_sm90_tst_128x160_NNT", "dur": 30.0},
            {"ph": "X", "pid": 7, "name": "nvjet_sm90_tst_128x160_NNT", "dur": 10.0},
            {"ph": "X", "pid": 7, "name": "input_add_reduce_fusion_2", "dur": 5.0},
            {"ph": "X", "pid": 7, "name": "ncclDevKernel_AllReduce", "dur": 2.0},
            {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "dur": 999.0},
        ]
    }
    times = gpu_kernels.gpu_kernel_times(trace)
    assert times == {
        "nvjet_sm90_tst_128x160_NNT": 40.0,
        "input_add_reduce_fusion_2": 5.0,
        "ncclDevKernel_AllReduce": 2.0,
    }
    assert [gpu_kernels.kind_of(k) for k in times] == ["gemm", "other", "collective"]
    assert gpu_kernels.kind_of("memcpy128") == "copy"
    assert gpu_kernels.kind_of("cutlass_80_wmma_tensorop_bf16") == "gemm"
