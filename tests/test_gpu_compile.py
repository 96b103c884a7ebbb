"""`benchmarks/gpu.sh --compile-only`: train steps compiled for a GPU on this CPU-only machine.

The reading of XLA's optimised HLO is checked on a small module written
here (every GEMM kind, FP8 scales, a cuBLAS call inside a custom fusion,
reads through tuple views). The compile itself runs as a user runs it
(bash, the CUDA plugin from `.venv/cuda-plugin`, which `./run` installs), at
the tiny size, for one variant and one GPU: the table and the JSON keep
their structure and the FP8 GEMMs are FP8. It needs the CUDA plugin built
for the installed jaxlib; without one it skips, saying so.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jaxlib
import pytest

from helpers import import_benchmark

_compiled_hlo = import_benchmark("_compiled_hlo")
gpu_compile = import_benchmark("gpu_compile")
ROOT = Path(__file__).resolve().parent.parent
PLUGIN = ROOT / ".venv" / "cuda-plugin"

HLO = """\
HloModule jit_step, entry_computation_layout={()->f32[]}

%fused_computation.gemm (param_0: f8e4m3fn[16,32], param_1: f8e5m2[32,8]) -> f32[16,8] {
  %param_0 = f8e4m3fn[16,32]{1,0} parameter(0)
  %param_1 = f8e5m2[32,8]{1,0} parameter(1)
  ROOT %dot.1 = f32[16,8]{1,0} dot(%param_0, %param_1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_upcast (param_0.2: f8e4m3fn[16,32]) -> bf16[16,32] {
  %param_0.2 = f8e4m3fn[16,32]{1,0} parameter(0)
  ROOT %convert.1 = bf16[16,32]{1,0} convert(%param_0.2)
}

%fused_computation.upcast_gemm (param_0.3: f8e4m3fn[16,32], param_1.3: bf16[32,8]) -> f32[16,8] {
  %param_0.3 = f8e4m3fn[16,32]{1,0} parameter(0)
  %fusion.9 = bf16[16,32]{1,0} fusion(%param_0.3), kind=kLoop, calls=%fused_upcast
  %param_1.3 = bf16[32,8]{1,0} parameter(1)
  ROOT %dot.2 = f32[16,8]{1,0} dot(%fusion.9, %param_1.3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%address_computation (p0: bf16[4,16,32], p1: bf16[32,8], p2: s32[]) -> (f32[16,8], s8[64]) {
  %p0 = bf16[4,16,32]{2,1,0} parameter(0)
  %p2 = s32[] parameter(2)
  %slice = bf16[1,16,32]{2,1,0} dynamic-slice(%p0, %p2, %p2, %p2), dynamic_slice_sizes={1,16,32}
  %bitcast.3 = bf16[16,32]{1,0} bitcast(%slice)
  %p1 = bf16[32,8]{1,0} parameter(1)
  ROOT %cublas.9 = (f32[16,8]{1,0}, s8[64]{0}) custom-call(%bitcast.3, %p1), custom_call_target="__cublas$lt$matmul"
}

%fused_small_dot (param_0.5: bf16[2,32], param_1.5: bf16[32,8]) -> f32[2,8] {
  %param_0.5 = bf16[2,32]{1,0} parameter(0)
  %param_1.5 = bf16[32,8]{1,0} parameter(1)
  ROOT %dot.3 = f32[2,8]{1,0} dot(%param_0.5, %param_1.5), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_add (param_0.4: f32[16,8], param_1.4: f32[16,8]) -> f32[16,8] {
  %param_0.4 = f32[16,8]{1,0} parameter(0)
  %param_1.4 = f32[16,8]{1,0} parameter(1)
  ROOT %add.1 = f32[16,8]{1,0} add(%param_0.4, %param_1.4)
}

ENTRY %main.1 (a: f8e4m3fn[16,32], b: f8e5m2[32,8], c: bf16[32,8], w: bf16[4,16,32], s: bf16[2,32]) -> f32[16,8] {
  %a = f8e4m3fn[16,32]{1,0} parameter(0)
  %b = f8e5m2[32,8]{1,0} parameter(1)
  %c = bf16[32,8]{1,0} parameter(2)
  %w = bf16[4,16,32]{2,1,0} parameter(3)
  %s = bf16[2,32]{1,0} parameter(4)
  %loop_dot_fusion = f32[2,8]{1,0} fusion(%s, %c), kind=kLoop, calls=%fused_small_dot
  %one = f32[] constant(1)
  %i = s32[] constant(0)
  %gemm_fusion.1 = f32[16,8]{1,0} fusion(%a, %b), kind=kCustom, calls=%fused_computation.gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %gemm_fusion.2 = f32[16,8]{1,0} fusion(%a, %c), kind=kCustom, calls=%fused_computation.upcast_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %cublas-gemm.1 = (f32[16,8]{1,0}, s8[1024]{0}) custom-call(%a, %b, %one, %one), custom_call_target="__cublas$lt$matmul$f8"
  %get-tuple-element.1 = f32[16,8]{1,0} get-tuple-element(%cublas-gemm.1), index=0
  %address.1 = (f32[16,8]{1,0}, s8[64]{0}) fusion(%w, %c, %i), kind=kCustom, calls=%address_computation, backend_config={"fusion_backend_config":{"kind":"__custom_fusion"}}
  %get-tuple-element.2 = f32[16,8]{1,0} get-tuple-element(%address.1), index=0
  %loop_add_fusion = f32[16,8]{1,0} fusion(%gemm_fusion.1, %get-tuple-element.1), kind=kLoop, calls=%fused_add
  %loop_add_fusion.1 = f32[16,8]{1,0} fusion(%gemm_fusion.2, %get-tuple-element.2), kind=kLoop, calls=%fused_add
  ROOT %loop_add_fusion.2 = f32[16,8]{1,0} fusion(%loop_add_fusion, %loop_add_fusion.1), kind=kLoop, calls=%fused_add
}
"""


def test_the_gemms_of_an_optimised_module():
    program = _compiled_hlo.read(HLO)
    assert program.gemm_table() == {
        ("Triton", "f8e4m3fn", "f8e5m2", "f32"): 1,
        # The FP8 operand upcast before the product shows as what is multiplied.
        ("Triton", "bf16", "bf16", "f32"): 1,
        ("cuBLASLt FP8", "f8e4m3fn", "f8e5m2", "f32"): 1,
        ("cuBLASLt", "bf16", "bf16", "f32"): 1,  # Inside the custom fusion.
    }
    assert [g.scale_operands for g in program.gemms] == [0, 0, 2, 0]
    assert program.fusions == 7  # In the entry only: the fused computations' own are not kernels.
    assert program.gemm_result_readers == 4  # Each GEMM read once, through its tuple view.
    assert program.other_dots == 1  # The product in an elementwise kernel, not a GEMM.


LOOP_HLO = """\
HloModule jit_loop

%fused_slice (p0: bf16[4,16,32], p1: s32[]) -> bf16[16,32] {
  %p0 = bf16[4,16,32]{2,1,0} parameter(0)
  %p1 = s32[] parameter(1)
  %c0 = s32[] constant(0)
  %ds = bf16[1,16,32]{2,1,0} dynamic-slice(%p0, %p1, %c0, %c0), dynamic_slice_sizes={1,16,32}
  ROOT %b = bf16[16,32]{1,0} bitcast(%ds)
}

%fused_gemm (r0: bf16[16,32], r1: bf16[32,8]) -> f32[16,8] {
  %r0 = bf16[16,32]{1,0} parameter(0)
  %r1 = bf16[32,8]{1,0} parameter(1)
  ROOT %dot = f32[16,8]{1,0} dot(%r0, %r1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%fused_update (q0: f32[4,16,8], q1: f32[16,8], q2: s32[]) -> f32[4,16,8] {
  %q0 = f32[4,16,8]{2,1,0} parameter(0)
  %q1 = f32[16,8]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %c = s32[] constant(0)
  %u = f32[1,16,8]{2,1,0} bitcast(%q1)
  ROOT %dus = f32[4,16,8]{2,1,0} dynamic-update-slice(%q0, %u, %q2, %c, %c)
}

%fused_neg (n0: f32[4,16,8]) -> f32[4,16,8] {
  %n0 = f32[4,16,8]{2,1,0} parameter(0)
  ROOT %neg = f32[4,16,8]{2,1,0} negate(%n0)
}

%body (t: (s32[], bf16[4,16,32], bf16[32,8], f32[4,16,8])) -> (s32[], bf16[4,16,32], bf16[32,8], f32[4,16,8]) {
  %t = (s32[], bf16[4,16,32]{2,1,0}, bf16[32,8]{1,0}, f32[4,16,8]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %w = bf16[4,16,32]{2,1,0} get-tuple-element(%t), index=1
  %x = bf16[32,8]{1,0} get-tuple-element(%t), index=2
  %acc = f32[4,16,8]{2,1,0} get-tuple-element(%t), index=3
  %slice_fusion = bf16[16,32]{1,0} fusion(%w, %i), kind=kLoop, calls=%fused_slice
  %gemm_fusion = f32[16,8]{1,0} fusion(%slice_fusion, %x), kind=kCustom, calls=%fused_gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  %update_fusion = f32[4,16,8]{2,1,0} fusion(%acc, %gemm_fusion, %i), kind=kLoop, calls=%fused_update
  %one = s32[] constant(1)
  %next = s32[] add(%i, %one)
  ROOT %out = (s32[], bf16[4,16,32]{2,1,0}, bf16[32,8]{1,0}, f32[4,16,8]{2,1,0}) tuple(%next, %w, %x, %update_fusion)
}

%cond (c: (s32[], bf16[4,16,32], bf16[32,8], f32[4,16,8])) -> pred[] {
  %c = (s32[], bf16[4,16,32]{2,1,0}, bf16[32,8]{1,0}, f32[4,16,8]{2,1,0}) parameter(0)
  %ci = s32[] get-tuple-element(%c), index=0
  %four = s32[] constant(4)
  ROOT %lt = pred[] compare(%ci, %four), direction=LT
}

ENTRY %main (w: bf16[4,16,32], x: bf16[32,8], acc: f32[4,16,8]) -> f32[4,16,8] {
  %w = bf16[4,16,32]{2,1,0} parameter(0)
  %x = bf16[32,8]{1,0} parameter(1)
  %acc = f32[4,16,8]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %init = (s32[], bf16[4,16,32]{2,1,0}, bf16[32,8]{1,0}, f32[4,16,8]{2,1,0}) tuple(%zero, %w, %x, %acc)
  %loop = (s32[], bf16[4,16,32]{2,1,0}, bf16[32,8]{1,0}, f32[4,16,8]{2,1,0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"4"}}
  %res = f32[4,16,8]{2,1,0} get-tuple-element(%loop), index=3
  %start = ((f32[4,16,8]{2,1,0}), f32[4,16,8]{2,1,0}, u32[]) fusion-start(%res), kind=kLoop, calls=%fused_neg
  ROOT %done = f32[4,16,8]{2,1,0} fusion-done(%start)
}
"""


def test_what_a_steps_kernels_move():
    found = _compiled_hlo.traffic(LOOP_HLO)
    # Per trip (4): the slice kernel reads one layer of the stacked weights
    # (16 x 32 bf16, not all 4) and its index, writes the slice; the GEMM
    # reads both operands and writes 16 x 8 f32; the update writes its slice
    # in place (reads the GEMM's result and the index, not the buffer); the
    # induction variable's add. The condition runs 5 times; after the loop
    # one asynchronous kernel, counted once (at its start), reads and writes
    # 4 x 16 x 8 f32.
    per_trip = (1024 + 4 + 1024) + (512 + 4 + 512) + (4 + 4 + 4)
    assert found.kernels == 4 * 4 + 5 + 1
    assert found.gemm_bytes == 4 * (1024 + 512 + 512)
    assert found.other_bytes == 4 * per_trip + 5 * (4 + 4 + 1) + 2 * 2048
    assert (
        _compiled_hlo.type_bytes("(f8e4m3fn[4,8]{1,0}, bf16[2], pred[3], f4e2m1fn[4])")
        == 32 + 4 + 3 + 2
    )


def _traffic_row(name, kernels, gemm_bytes, other_bytes):
    program = _compiled_hlo.read(HLO)
    traffic = _compiled_hlo.Traffic(kernels, gemm_bytes, other_bytes)
    return gpu_compile.Row(name, 1, 1, 1, program, traffic, 0.0)


def test_fp8_and_its_bound_are_held_to_the_traffic_targets():
    bf16 = "with_policy mixed_bfloat16"
    rows = {
        bf16: _traffic_row(bf16, 100, 40.0, 100.0),
        "policy mixed_float8": _traffic_row("policy mixed_float8", 160, 24.0, 110.0),
        gpu_compile.FP8_SCALES_KNOWN: _traffic_row(gpu_compile.FP8_SCALES_KNOWN, 114, 26.0, 99.0),
    }
    found = dict(gpu_compile.verdicts(rows))
    assert found["mixed_float8 kernel launches <= 1.15 x mixed_bfloat16's"] is False
    assert found["mixed_float8 non-GEMM kernel bytes <= 1.0 x mixed_bfloat16's"] is False
    bound = f"bound: {gpu_compile.FP8_SCALES_KNOWN}"
    assert found[f"{bound} kernel launches <= 1.15 x mixed_bfloat16's"] is True
    assert found[f"{bound} non-GEMM kernel bytes <= 1.0 x mixed_bfloat16's"] is True
    assert found[f"{bound} kernel bytes <= 0.9 x mixed_bfloat16's"] is True  # 125 <= 126
    del rows[gpu_compile.FP8_SCALES_KNOWN]
    assert (
        dict(gpu_compile.verdicts(rows))[f"{bound} kernel bytes <= 0.9 x mixed_bfloat16's"] is None
    )
    # Its name is one `--variants` accepts (no comma).
    assert (
        "," not in gpu_compile.FP8_SCALES_KNOWN
        and gpu_compile.FP8_SCALES_KNOWN in gpu_compile.VARIANTS
    )


def test_an_unknown_target_or_variant_is_a_usage_error(capsys):
    for argv in (["--targets", "h900"], ["--variants", "bf17"], ["--backends", "tpu"]):
        with pytest.raises(SystemExit) as info:
            gpu_compile.main(argv)
        assert info.value.code == 2
        assert "accepted:" in capsys.readouterr().err


def test_the_shipped_targets_are_an_h100_and_an_h200():
    configs = gpu_compile.target_configs()
    assert set(configs) == {"h100_sxm", "h200_sxm"}
    assert 'device_description_str: "NVIDIA H200"' in configs["h200_sxm"]
    assert all("major: 9" in text for text in configs.values())  # Hopper, sm_90


def _plugin_version() -> str | None:
    found = sorted(PLUGIN.glob("jax_cuda12_plugin-*.dist-info"))
    return found[0].name.removesuffix(".dist-info").split("-")[1] if found else None


@pytest.mark.slow
def test_compile_only_prints_the_table_with_its_verdicts(tmp_path):
    version = _plugin_version()
    if version != jaxlib.__version__:
        pytest.skip(
            f"no CUDA plugin for jaxlib {jaxlib.__version__} in {PLUGIN} (found {version}); "
            "./run installs it where pip has one"
        )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env.update(PYTHON=sys.executable, OUT=str(tmp_path))
    variant = "policy mixed_float8"
    args = ["--size", "tiny", "--targets", "h200_sxm", "--backends", "default"]
    run = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu.sh"), "--compile-only", *args,
         "--variants", f"{variant},{variant} operands,{gpu_compile.FP8_SCALES_KNOWN}"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert "NVIDIA H200 (h200_sxm.txtpb), GEMM back end: default" in lines
    (row,) = [line for line in lines if re.match(rf"{variant} +[0-9]", line) and "->" in line]
    assert "f8e4m3fn x f8e4m3fn -> bf16" in row
    assert "  holds: every product of mixed_float8 an FP8 GEMM (no upcast before one)" in lines
    # Measured at this size: 2.42 MB against 2.70 MB (the GPU size: 8.78 GB, 10.26 GB).
    assert "  holds: mixed_float8 saves FP8 copies: temp memory < with its operands saved" in lines
    assert "  n/a: rowwise FP8 scales in the epilogue or a fused pass" in " ".join(lines)
    assert any(line.startswith("kernel traffic per step") for line in lines)
    assert any("mixed_float8 kernel launches <= 1.15 x" in line for line in lines)
    figures = json.loads((tmp_path / gpu_compile.JSON_NAME).read_text())
    result = figures["targets"]["h200_sxm"]["default"]["variants"][variant]
    assert result["temp_bytes"] > 0 and result["argument_bytes"] > 0
    assert result["kernel_launches"] > 0 and result["gemm_kernel_bytes"] > 0
    kinds = {(g["lhs"], g["rhs"], g["out"]) for g in result["gemms"]}
    assert all(a.startswith("f8") and b.startswith("f8") for a, b, _ in kinds), kinds
    # Results in the reduce dtype (bf16 under mixed_float8), written by the FP8
    # GEMM; float32 where the program asks it of half operands.
    assert {o for _, _, o in kinds} == {"bf16", "f32"}, kinds
    assert sum(g["count"] for g in result["gemms"]) == 23  # Every product of the tiny step.
    # The bound with every scale 1, compiled in a process of its own: the
    # same FP8 GEMMs, and no amax pass before a cast (fewer launches).
    bound = figures["targets"]["h200_sxm"]["default"]["variants"][gpu_compile.FP8_SCALES_KNOWN]
    assert sum(g["count"] for g in bound["gemms"]) == 23
    assert all(g["lhs"].startswith("f8") and g["rhs"].startswith("f8") for g in bound["gemms"])
    assert bound["kernel_launches"] < result["kernel_launches"]
    assert any("bound: mixed_float8 (scales known) kernel launches" in line for line in lines)


COLLECTIVES_HLO = """\
HloModule jit_step

ENTRY %main (p0: bf16[64,32], p1: f32[16], p2: f8e4m3fn[2,32]) -> f32[] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = f32[16]{0} parameter(1)
  %p2 = f8e4m3fn[2,32]{1,0} parameter(2)
  %all-reduce-start = ((bf16[64,32]{1,0}), bf16[64,32]{1,0}) all-reduce-start(%p0), channel_id=1, replica_groups=mesh['x'=8] {'x'}, to_apply=%add
  %all-reduce-done = bf16[64,32]{1,0} all-reduce-done(%all-reduce-start)
  %all-gather = (f32[128]{0}, bf16[8,32]{1,0}, f8e4m3fn[8,32]{1,0}) all-gather(%p1, %p0, %p2), channel_id=2, replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}
  %reduce-scatter = f32[2]{0} reduce-scatter(%p1), channel_id=3, replica_groups=[1,8]<=[8], dimensions={0}, to_apply=%add
  ROOT %all-reduce = f32[] all-reduce(%p1), channel_id=4, replica_groups={}, to_apply=%add
}
"""


def test_the_collectives_and_their_bytes_are_read_from_the_hlo():
    gpu_collectives = import_benchmark("gpu_collectives")
    found = gpu_collectives.collectives(COLLECTIVES_HLO, 8)
    # An async pair counts once, at its `-done`, with its start's groups.
    assert [(c.kind, c.bytes_by_type, c.group) for c in found] == [
        ("all-reduce", (("bf16", 64 * 32 * 2),), 8),
        ("all-gather", (("bf16", 8 * 32 * 2), ("f32", 128 * 4), ("f8e4m3fn", 8 * 32)), 4),
        ("reduce-scatter", (("f32", 2 * 4),), 8),
        ("all-reduce", (("f32", 4),), 8),  # No groups named: every device.
    ]
    # Ring model: all-reduce 2(n-1)/n of the buffer, all-gather (n-1)/n of the
    # gathered one, reduce-scatter (n-1)/n of the scattered one (n results).
    assert [c.wire_bytes for c in found] == [
        2 * 7 / 8 * 4096, 3 / 4 * (512 + 512 + 256), 7 * 8, 2 * 7 / 8 * 4,
    ]  # fmt: skip
    summary = gpu_collectives.summary(found)
    assert summary["collectives"] == 4 and summary["all_reduces"] == 2
    assert summary["scalar_all_reduces"] == 1
    # Element bytes from the type's bit width: the FP8 and FP4 types too.
    sizes = {t: _compiled_hlo.element_bytes(t) for t in
             ("f32", "bf16", "f8e4m3fn", "f8e5m2", "f8e8m0fnu", "f4e2m1fn", "s64", "pred")}  # fmt: skip
    assert sizes == {"f32": 4, "bf16": 2, "f8e4m3fn": 1, "f8e5m2": 1, "f8e8m0fnu": 1,
                     "f4e2m1fn": 0.5, "s64": 8, "pred": 1}  # fmt: skip
    with pytest.raises(ValueError, match="token"):
        _compiled_hlo.element_bytes("token")


@pytest.mark.slow
def test_fp8_policies_send_what_bf16_sends_over_8_gpus(tmp_path):
    # Each device scales the blocks it holds: no activation's amax is
    # all-reduced, no block straddles devices (compiled for 8 x H200; before,
    # `mixed_float8` sent 28 all-reduces under DP and 6.42 MB under TP,
    # `mixed_mxfp8` 11.02 MB and 7 all-reduces under DP). Under FSDP
    # `mixed_float8` gathers its weights in FP8, their scales in one all-reduce.
    version = _plugin_version()
    if version != jaxlib.__version__:
        pytest.skip(f"no CUDA plugin for jaxlib {jaxlib.__version__} in {PLUGIN}")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["PYTHONPATH"] = os.pathsep.join(map(str, (ROOT, PLUGIN)))
    variants = "flax dtype=bf16,mixed_float8,mixed_mxfp8"
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_collectives.py"), "--targets",
         "h200_sxm", "--variants", variants, "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    figures = json.loads((tmp_path / "gpu_collectives.json").read_text())
    rows = figures["targets"]["h200_sxm"]["layouts"]
    for layout in ("fsdp", "dp", "tp"):
        hand = rows[layout]["variants"]["flax dtype=bf16"]
        for policy in ("mixed_float8", "mixed_mxfp8"):
            row = rows[layout]["variants"][policy]
            assert row["megabytes_per_device"] <= hand["megabytes_per_device"] * 1.001, layout
            assert row["scalar_all_reduces"] <= hand["scalar_all_reduces"], (layout, row)
            # The hand config's all-reduces (1, 2, 12), and FSDP's weight scales.
            extra = int(layout == "fsdp" and policy == "mixed_float8")
            assert row["all_reduces"] == hand["all_reduces"] + extra, (layout, policy, row)
        assert False not in rows[layout]["verdicts"].values(), rows[layout]["verdicts"]
    assert rows["fsdp"]["verdicts"]["mixed_float8 all-gathers its weights in FP8"]
    fsdp = rows["fsdp"]["variants"]
    megabytes = {v: fsdp[v]["megabytes_per_device"] for v in ("mixed_float8", "flax dtype=bf16")}
    assert megabytes["mixed_float8"] < 0.9 * megabytes["flax dtype=bf16"], megabytes
