"""The benchmarks of `benchmarks/`, run as tests.

`transformer --no-time`: the bytes saved for the backward pass of the
Transformer's loss under `with_policy(mixed_bfloat16)` are at most its
`TARGET_RATIO` (0.55) of float32's; every matmul of the whole lowered train
step takes half operands in the half variants, and produces float32 in the
float32-accumulating ones (`autocast`, `half_dot_general`). Its model is the
example's: the same parameters and losses.

Every script starts as a user starts it (`python benchmarks/NAME.py`); the
quick runs of those not run in this process run so too.
"""

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest

from jmp_policy.app import transformer_lm

from helpers import BENCHMARKS, import_benchmark, load_script

ROOT = Path(__file__).resolve().parent.parent
transformer = import_benchmark("transformer")


@pytest.fixture(scope="module", autouse=True)
def _standard_promotion():
    # optax.adam's bias correction (float ** int32) fails under the suite's
    # strict promotion; the benchmarks, like user code, run under standard.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture(scope="module")
def transformer_benchmark():
    """`transformer --no-time`: its module and its table rows by variant."""
    bench = transformer
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        status = bench.main(["--no-time"])
    bench.printed = out.getvalue()
    names = [v for v in (bench.REFERENCE, *bench.HALF_VARIANTS)]
    rows = {}
    for line in out.getvalue().splitlines():
        for name in names:
            rest = line.removeprefix(name)
            if rest != line and rest[:1] == " " and "%" in rest:
                dots, half, f32, nbytes, ratio = rest.split()
                rows[name] = (int(dots), half, f32, int(nbytes.replace(",", "")), float(ratio))
    assert list(rows) == names, out.getvalue()
    return bench, status, rows


@pytest.mark.slow
def test_mixed_bfloat16_residual_bytes_at_most_target_of_float32(transformer_benchmark):
    # The benchmark's own bytes, and its printed ratio, for with_policy(mixed_bfloat16).
    bench, status, rows = transformer_benchmark
    by_variant = bench.residual_bytes()
    ratio = by_variant["with_policy"] / by_variant["float32"]
    assert ratio <= bench.TARGET_RATIO, by_variant
    assert rows["with_policy"][4] == round(ratio, 3)
    assert rows["with_policy"][3] == by_variant["with_policy"]
    assert status == 0


@pytest.mark.slow
def test_with_policy_saves_less_than_flax_dtype_by_hand(transformer_benchmark):
    # Flax's hand-set bfloat16 keeps its LayerNorms' float32 copies; the
    # policy rematerialises them.
    _, _, rows = transformer_benchmark
    assert rows["with_policy"][3] < rows["flax dtype=bf16"][3]


@pytest.mark.slow
def test_every_train_step_matmul_is_half_and_the_accumulating_paths_give_float32(
    transformer_benchmark,
):
    # The example Transformer's whole jitted train step: 17 products forward
    # (2 x (q, k, v, out, 2 einsums, 2 MLP) + head), 2 each backward.
    _, _, rows = transformer_benchmark
    assert rows["float32"][:3] == (51, "0%", "100%")
    assert rows["flax dtype=bf16"][:3] == rows["with_policy"][:3] == (51, "100%", "0%")
    # autocast's products give their results in the reduce dtype (bf16).
    assert rows["autocast"][:3] == (51, "100%", "0%")
    assert rows["with_policy+f32acc"][:3] == (51, "100%", "100%")
    # The policy's matmul dtype (with r=f32) alone gives what the hand-wired model does.
    assert rows["m=bf16"][:3] == (51, "100%", "100%")


@pytest.mark.slow
def test_mixed_float8_every_train_step_matmul_fp8(transformer_benchmark):
    bench, _, _ = transformer_benchmark
    line = next(x for x in bench.printed.splitlines() if x.startswith("mixed_float8: "))
    assert line == (
        "mixed_float8: 17 forward e4m3 x e4m3 dots, 34 backward dots with an e5m2 "
        "output gradient, 0 others: all FP8"
    )


def test_the_benchmark_model_is_the_example_model():
    # The package carries its own copy of the example's model (for `doctor
    # --fp8 transformer`: a wheel has no examples/); with its extra fields left
    # at None it is the same model: the same parameters and the same loss.
    example = load_script("examples/transformer_lm.py", "transformer_lm")
    batches, _, vocab_size = example.make_data(1)
    ours_batches, _, ours_vocab = transformer_lm.make_data(1)
    np.testing.assert_array_equal(batches, ours_batches)
    assert vocab_size == ours_vocab
    theirs = example.init_params(example.make_model(vocab_size), "float32")
    ours = transformer_lm.init_params(transformer_lm.make_model(vocab_size), "float32")
    assert jax.tree.structure(theirs) == jax.tree.structure(ours)
    for a, b in zip(jax.tree.leaves(theirs), jax.tree.leaves(ours)):
        np.testing.assert_array_equal(a, b)
    apply_theirs = example.make_model(vocab_size).apply
    apply_ours = transformer_lm.make_model(vocab_size).apply
    np.testing.assert_array_equal(
        example.loss_fn(apply_theirs, theirs, batches[0]),
        transformer_lm.loss_fn(apply_ours, ours, batches[0]),
    )


def test_cpu_dot_benchmark_compares_the_cpu_form_with_the_dot_as_written():
    # The attention product XLA:CPU rejects as written before jaxlib 0.12.1
    # (where the form is on by default) runs in the CPU form, with float32's
    # values (bf16 inputs, float32 accumulation); the Dense products run both
    # ways with the same values.
    import jax
    import numpy as np

    from jmp_policy.engine.products import cpu_form

    cpu_dot = import_benchmark("cpu_dot")

    cases = cpu_dot.cases(quick=True)
    assert list(cases) == [
        "dense fwd [T,K]x[K,N]", "dense dx [T,N]x[K,N]", "dense dw [T,K]x[T,N]",
        "attention backward", "MLP train step",
    ]  # fmt: skip
    f32, written, cpu = (cpu_dot.ready(b) for b in cases["attention backward"])
    if cpu_form.cpu_bf16_dot_workaround({}):
        assert isinstance(written, str) and "DotThunk" in written, written
    else:
        np.testing.assert_array_equal(jax.device_get(written()), jax.device_get(cpu()))
    np.testing.assert_allclose(jax.device_get(cpu()), jax.device_get(f32()), rtol=2e-2, atol=0.5)
    f32, written, cpu = (cpu_dot.ready(b) for b in cases["dense dw [T,K]x[T,N]"])
    np.testing.assert_array_equal(jax.device_get(cpu()), jax.device_get(written()))


# --- fp8 --quick ------------------------------------------------------------------


@pytest.fixture(scope="module")
def fp8_table():
    """`fp8 --quick` with an uninstalled peer added: `({variant: {row: cell}}, text)`."""
    fp8 = import_benchmark("fp8")

    absent = fp8.Variant("absent peer", "no-such-distribution-jmp-policy", fp8._flax)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fp8, "VARIANTS", [*fp8.VARIANTS, absent])
        columns, rows, notes = fp8.measure(quick=True)
    text = fp8.format_table(columns, rows, notes)
    # Columns are "name version" for the peers: keyed by name.
    by_variant = {
        next(v.name for v in fp8.VARIANTS if col.startswith(v.name)) if col != "float32" else col: {
            row: cells.get(col, "") for row, cells in rows.items()
        }
        for col in columns
    }
    return by_variant, text


@pytest.mark.slow
def test_fp8_benchmark_jmp_columns(fp8_table):
    table, text = fp8_table
    for name in ("jmp tensor", "jmp rowwise"):
        col = table[name]
        assert col["MLP: FP8 dots fwd / bwd / other"] == "3 / 5 / 0", text
        assert col["MLP: extra state arrays (bytes)"] == "0 (0)"
        assert abs(float(col["MLP: loss - float32"])) < 0.01
        assert col["MLP: NaN batch (loss_scaled)"] == "skipped, recovers"
        assert col["MLP: all-zero batch"] == "ok, recovers"
        for row in ("inputs x1e-06", "inputs x1e-20", "gradients x1e-15"):
            assert float(col[f"MLP: {row}"]) < 0.1, (row, text)
        assert all(line.rstrip() == line for line in text.splitlines())
    # Per tensor one outlier of 1e6 flushes the other rows; per row it does not.
    assert float(table["jmp tensor"]["MLP: outlier 1e+06: other rows"]) == 1.0
    for outlier in ("1e+04", "1e+05", "1e+06"):
        assert float(table["jmp rowwise"][f"MLP: outlier {outlier}: other rows"]) < 0.1


@pytest.mark.slow
def test_fp8_benchmark_block_formats(fp8_table):
    table, text = fp8_table
    mx, nv = table["jmp mxfp8"], table["jmp nvfp4"]
    assert mx["MLP: quantized to"] == "f8E4M3FN f8E8M0FNU", text
    assert nv["MLP: quantized to"] == "f4E2M1FN f8E4M3FN", text
    # Emulated on CPU: each block-scaled product a float32 dot (14 for NVFP4:
    # its 6 Hadamard transforms besides the 8 products).
    assert mx["MLP: FP8 dots fwd / bwd / other"] == "0 / 0 / 8"
    assert nv["MLP: FP8 dots fwd / bwd / other"] == "0 / 0 / 14"
    for col in (mx, nv):
        assert col["MLP: extra state arrays (bytes)"] == "0 (0)"
        assert col["MLP: NaN batch (loss_scaled)"] == "skipped, recovers"
        assert col["MLP: all-zero batch"] == "ok, recovers"
        assert abs(float(col["MLP: loss - float32"])) < 0.05
    # MXFP8's power-of-two block scales hold every outlier and tiny value;
    # NVFP4's float32 tensor scale holds tiny values, but one outlier of 1e6
    # puts the other blocks' e4m3 scales below their range.
    for row in ("outlier 1e+04: other rows", "outlier 1e+06: other rows", "inputs x1e-20"):
        assert float(mx[f"MLP: {row}"]) < 0.1, row
    for row in ("outlier 1e+04: other rows", "inputs x1e-20", "gradients x1e-15"):
        assert float(nv[f"MLP: {row}"]) < 0.3, row
    assert float(nv["MLP: outlier 1e+06: other rows"]) > 0.5
    assert float(mx["MLP: output error (a batch)"]) < 0.1 < float(nv["MLP: output error (a batch)"])
    # The quantized copies saved for the backward pass: fewer bytes than the
    # operands (bfloat16) would be.
    for name in ("jmp tensor", "jmp rowwise", "jmp mxfp8", "jmp nvfp4"):
        saved = int(table[name]["MLP: residual bytes (read)"].replace(",", ""))
        operands = int(table[name]["MLP: residual bytes, operands saved"].replace(",", ""))
        assert saved < 0.8 * operands, (name, saved, operands)
    if "qwix mxfp8" in table:
        # Qwix's MX scales are float32 powers of two, its gradients e5m2 per channel.
        assert table["qwix mxfp8"]["MLP: quantized to"] == "f8E4M3FN f8E5M2"


@pytest.mark.slow
def test_fp8_benchmark_peers_when_installed_and_skips_a_missing_one(fp8_table):
    table, text = fp8_table
    assert "note: absent peer: skipped (no-such-distribution-jmp-policy is not installed)" in text
    assert "absent peer" not in table and "absent peer" not in text.splitlines()[0]
    for name in ("qwix qt", "flax fp8"):
        if name in table:  # installed
            assert table[name]["MLP: FP8 dots fwd / bwd / other"] == "3 / 5 / 0", text
            assert table[name]["MLP: quantized to"] == "f8E4M3FN f8E5M2", text
            assert table[name]["MLP: NaN batch (loss_scaled)"].startswith("skipped, recovers")
    if "flax fp8" in table:
        # Delayed scaling keeps amax histories: 6 arrays per Dense (1024 + 1 floats
        # for the input, the kernel and the output gradient), 3 Dense.
        assert table["flax fp8"]["MLP: extra state arrays (bytes)"] == "18 (36,900)"


@pytest.mark.slow
def test_lowering_benchmark_prints_each_variant_against_flax_by_hand():
    lowering = import_benchmark("lowering")

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        # In this process: not MaxText, whose own packages would shadow others'.
        argv = ["--depth", "1", "--width", "32", "--rounds", "1", "--models", "transformer"]
        assert lowering.main([*argv, "griffin"]) == 0
    rows = {}
    for line in out.getvalue().splitlines():
        for name in sorted(lowering.TARGETS, key=len, reverse=True):  # "with_policy m=bf16" first
            if line.startswith(name + " "):
                rows[name] = tuple(map(float, line.removeprefix(name).split()))
                break
    assert set(rows) == set(lowering.TARGETS), out.getvalue()
    assert all(ratio > 0 and faults >= 0 for ratio, _, faults in rows.values())
    assert "flax dtype=bf16" in out.getvalue() and "= 1.00" in out.getvalue()


# --- each script, as a user runs it ------------------------------------------------


@pytest.mark.slow
def test_every_benchmark_script_starts_and_the_others_run_quick():
    # Every script's imports and arguments: `--help`, all in one process
    # (JAX imported once), each with `benchmarks/` first on sys.path as
    # `python benchmarks/NAME.py` has it.
    code = (
        "import contextlib, io, json, runpy, sys\n"
        "out = {}\n"
        "for path in sys.argv[1:]:\n"
        "    sys.argv, sys.path[0], text = [path, '--help'], 'benchmarks', io.StringIO()\n"
        "    with contextlib.redirect_stdout(text):\n"
        "        try:\n"
        "            runpy.run_path(path, run_name='__main__')\n"
        "        except SystemExit as e:\n"
        "            out[path] = [e.code, text.getvalue()]\n"
        "print(json.dumps(out))\n"
    )
    scripts = sorted(str(p.relative_to(ROOT)) for p in BENCHMARKS.glob("[!_]*.py"))
    assert "benchmarks/gpu_compile.py" in scripts and len(scripts) >= 8
    proc = subprocess.run(
        [sys.executable, "-c", code, *scripts], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    helps = json.loads(proc.stdout)
    assert sorted(helps) == scripts
    for path, (status, text) in helps.items():
        assert status in (0, None) and "usage:" in text, (path, status, text)
    # The quick runs of those no other test runs.
    for name in ("cpu_dot", "gpu_compile", "loss_scaling"):
        proc = subprocess.run(
            [sys.executable, f"benchmarks/{name}.py", "--quick"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        assert proc.returncode == 0, (name, proc.stdout + proc.stderr)
        if name == "gpu_compile":
            # No CUDA plugin on the path: it reads its targets, then says why not.
            assert "gpu_compile: not run: compiling for a GPU needs the CUDA plugin" in proc.stdout


saved_bytes = import_benchmark("saved_bytes")


@pytest.mark.parametrize("model", ["Transformer", "Equinox"])
def test_autocast_saves_no_more_than_the_models_own_half_config(model):
    # Activations stay in bfloat16 between products: the bytes the backward
    # pass keeps are at most the own config's (x 1.02).
    for policy in saved_bytes.TARGETED:
        figures = saved_bytes.figures(model, policy)
        own = figures.pop("own config")
        for front_end, value in figures.items():
            assert value <= saved_bytes.TARGET * own, (policy, front_end, value, own)
