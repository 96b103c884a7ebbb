"""Two JAX processes, one 8-device mesh: loss scaling across `jax.distributed`.

The test starts two processes of `tests/_multiprocess_worker.py` (each with
4 virtual CPU devices, joined by `jax.distributed.initialize` on a free
localhost port, CPU collectives through gloo). They train a linen MLP under
`with_policy(..., "mixed_float16")` with
`loss_scaled(optax.adam, DynamicLossScale(2**15, period=3))`, data parallel
over the global batch built with `jax.make_array_from_process_local_data`,
in two configurations: parameters and Adam state sharded over the mesh
(FSDP-style, first axis) and replicated. At chosen steps one process's rows
of the batch hold a value that overflows float16 (the other process's rows
are finite). Checked:

* both processes skip exactly the injected steps, leave their own parameter
  and Adam shards bit for bit unchanged on them, and hold the same loss
  scale, counters and loss at every step;
* every copy of every parameter and optimizer-state piece, on all 8 devices
  of both processes, holds the same bits; the assembled global result equals
  the same run on the 8 devices of this (single) process within
  `REFERENCE_ULPS` float16 ulps of each array's largest value (measured: up
  to 1.45; the cross-device reductions run in another order), with the same
  skipped steps and loss-scale trajectory, step by step;
* an orbax checkpoint written by both processes after `SAVE_AT` steps and
  restored by two new processes continues bit-identically to the end, an
  injected overflow after the restore included;
* nothing is left running: each run has a timeout, both processes are
  killed in a `finally`, and a failure shows both processes' output (the
  last test makes one process fail and checks exactly that).

`examples/multihost.py --demo` runs too (two processes, an overflow in one
process's rows at step 5, the same replicated parameters at the end).

Three launches of two processes, about 70 s on 2 CPU cores: marked slow (the
normal suite runs it).
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh

from helpers import load_script

ROOT = Path(__file__).resolve().parent.parent
WORKER = ROOT / "tests" / "_multiprocess_worker.py"
LAUNCH_TIMEOUT = 240  # seconds per launch; a normal one takes about 12 s on 2 busy cores
# Tolerance against the single-process run, per array: max |multi - single|
# <= REFERENCE_ULPS float16 ulps (2**-10) of the array's largest magnitude.
# The two runs reduce the gradients across devices in a different order
# (gloo's all-reduce between processes, XLA's in-process one): under float32
# compute they differ by ~1e-7 of a leaf's largest value (float32 rounding),
# under this test's float16 compute by up to 1.4e-3 (1.45 float16 ulps,
# measured), carried through 10 Adam steps. A dropped or doubled shard of the
# gradients, or a step skipped by one run only, differs by percents.
REFERENCE_ULPS = 4
LOSS_RTOL = 1e-3  # the losses: measured within 1e-3 relative

pytestmark = pytest.mark.slow


worker = load_script("tests/_multiprocess_worker.py", "_multiprocess_worker")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


class LaunchError(AssertionError):
    """A failed or timed-out two-process run; `pids` are the processes it started (reaped)."""

    def __init__(self, message: str, pids: list[int]):
        super().__init__(message)
        self.pids = pids


def launch(args_for, out: Path, timeout: float = LAUNCH_TIMEOUT) -> list[int]:
    """Runs the two worker processes to completion; returns their pids (all reaped).

    `args_for(i)` gives process i's arguments. If a process fails, or the
    pair runs past `timeout`, both are killed at once (a survivor would wait
    for its peer until the distributed runtime's own timeouts, minutes) and
    a `LaunchError` carries both processes' output.
    """
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={worker.DEVICES_PER_PROCESS}",
        JAX_PLATFORMS="cpu",
        PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
    )
    port = free_port()
    procs, logs = [], []
    try:
        for i in range(worker.N_PROCESSES):
            log = open(out / f"process{i}.log", "w+b")  # noqa: SIM115 (closed in finally)
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(WORKER),
                        "--process-id",
                        str(i),
                        "--port",
                        str(port),
                        *args_for(i),
                    ],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: killed as a whole
                )
            )
        deadline = time.monotonic() + timeout
        failure = None
        while failure is None:
            codes = [p.poll() for p in procs]
            if all(c == 0 for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                failure = "exit codes " + ", ".join(
                    f"process {i}: {c if c is not None else 'still running (killed)'}"
                    for i, c in enumerate(codes)
                )
            elif time.monotonic() > deadline:
                failure = f"timed out after {timeout:.0f} s (both killed)"
            else:
                time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait()
        outputs = []
        for i, log in enumerate(logs):
            log.seek(0)
            text = log.read().decode(errors="replace")
            log.close()
            # gloo's connection chatter says nothing about a failure.
            text = "\n".join(l for l in text.splitlines() if not l.startswith("[Gloo]"))
            outputs.append(f"--- process {i} output ---\n{text[-6000:]}")
    if failure is not None:
        raise LaunchError(
            f"two-process run failed: {failure}\n" + "\n".join(outputs), [p.pid for p in procs]
        )
    return [p.pid for p in procs]


def load(out: Path, name: str):
    meta = json.loads((out / f"{name}.json").read_text())
    arrays = dict(np.load(out / f"{name}.npz"))
    return meta, arrays


def assemble(results) -> dict[str, np.ndarray]:
    """Global arrays from the shards of all processes; every copy of a piece must agree."""
    pieces: dict[str, dict[tuple, bytes]] = {}
    globals_: dict[str, np.ndarray] = {}
    covered: dict[str, np.ndarray] = {}
    for meta, arrays in results:
        for shard in meta["shards"]:
            leaf, data = shard["leaf"], arrays[shard["key"]]
            if leaf not in globals_:
                globals_[leaf] = np.zeros(shard["shape"], shard["dtype"])
                covered[leaf] = np.zeros(shard["shape"], bool)
            index = tuple(slice(a, b) for a, b in shard["index"])
            where = tuple(map(tuple, shard["index"]))
            first = pieces.setdefault(leaf, {}).setdefault(where, data.tobytes())
            assert first == data.tobytes(), (
                f"{leaf}{shard['index']}: device {shard['device']} holds other bits than "
                "another copy of the same piece"
            )
            globals_[leaf][index] = data
            covered[leaf][index] = True
    for leaf, mask in covered.items():
        assert mask.all(), f"{leaf}: the shards do not cover the array"
    return globals_


def comparable(records):
    """The records without what differs by design between processes; NaN made comparable."""
    return [
        {
            k: (repr(v) if isinstance(v, float) and math.isnan(v) else v)
            for k, v in r.items()
            if k != "overflow_in_my_rows"
        }
        for r in records
    ]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Launch 1 trains both configurations and checkpoints; launch 2 restores and continues."""
    out = tmp_path_factory.mktemp("multiprocess")
    ckpt = out / "ckpt"
    pids = []
    for phase in ("train", "resume"):
        pids += launch(
            lambda i, phase=phase: ["--phase", phase, "--out", str(out), "--ckpt", str(ckpt)], out
        )
    results = {
        (phase, config): [load(out, f"{phase}_{config}_process{i}") for i in range(2)]
        for phase in ("train", "resume")
        for config in worker.CONFIGS
    }
    return results, pids


@pytest.fixture(scope="module")
def reference():
    """The same training on the 8 devices of this process: `{config: (records, arrays)}`."""
    if len(jax.devices()) < worker.N_DEVICES:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    mesh = Mesh(np.array(jax.devices()[: worker.N_DEVICES]), ("data",))
    assert worker.local_rows(mesh) == slice(0, worker.GLOBAL_BATCH)
    out = {}
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32
        for config in worker.CONFIGS:
            records, params, opt_state = worker.train(mesh, config)
            meta, arrays = worker.shards_of({"params": params, "opt_state": opt_state})
            out[config] = (records, assemble([({"shards": meta}, arrays)]))
    return out


INJECTED = sorted(worker.INJECT)


def trajectory(records):
    keys = (
        "step",
        "skipped",
        "unchanged",
        "loss_scale",
        "counter",
        "notfinite_count",
        "total_notfinite",
    )
    return [tuple(r[k] for k in keys) for r in records]


@pytest.mark.parametrize("config", worker.CONFIGS)
def test_both_processes_skip_every_injected_overflow_together(runs, config):
    results, _ = runs
    (meta0, _), (meta1, _) = results["train", config]
    assert (meta0["rows"], meta1["rows"]) == ([0, 8], [8, 16])  # each its own half of the batch
    for process, meta in enumerate((meta0, meta1)):
        records = meta["records"]
        assert [r["step"] for r in records] == list(range(worker.STEPS))
        assert [r["step"] for r in records if r["skipped"]] == INJECTED, records
        # The overflow sat in one process's rows only; the other skipped all the same.
        assert [r["step"] for r in records if r["overflow_in_my_rows"]] == [
            s for s in INJECTED if worker.INJECT[s] == process
        ]
        for r in records:
            # A skipped step leaves this process's parameter and Adam shards bit for bit
            # as they were; every other step changes them.
            assert r["unchanged"] == r["skipped"], r
            assert math.isnan(r["loss"]) == r["skipped"], r
    # Same loss scale, counters and loss on every step.
    assert comparable(meta0["records"]) == comparable(meta1["records"])
    last = meta0["records"][-1]
    assert (last["loss_scale"], last["counter"], last["total_notfinite"]) == (2.0**13, 1, 4)


@pytest.mark.parametrize("config", worker.CONFIGS)
def test_every_copy_agrees_and_the_result_is_the_single_process_one(runs, reference, config):
    results, _ = runs
    for meta, _ in results["train", config]:
        shards = meta["shards"]
        assert len({s["device"] for s in shards}) == worker.DEVICES_PER_PROCESS
        kernel = [s for s in shards if s["leaf"] == "['params']['params']['Dense_1']['kernel']"]
        if config == "fsdp":  # a (32, 32) kernel: 4 rows on each device
            assert [s["fully_replicated"] for s in kernel] == [False] * 4
            assert {tuple(s["index"][0]) for s in kernel} == {
                (r, r + 4) for r in range(meta["rows"][0] * 2, meta["rows"][1] * 2, 4)
            }
        else:
            assert all(s["fully_replicated"] for s in shards)
    # Every copy of every piece holds the same bits across devices and processes.
    multi = assemble(results["train", config])
    ref_records, ref = reference[config]
    records = results["train", config][0][0]["records"]
    assert trajectory(records) == trajectory(ref_records)
    np.testing.assert_allclose(  # NaN where NaN
        [r["loss"] for r in records], [r["loss"] for r in ref_records], rtol=LOSS_RTOL
    )
    assert multi.keys() == ref.keys()
    for leaf in multi:
        assert multi[leaf].dtype == ref[leaf].dtype, leaf
        if multi[leaf].ndim == 0:  # loss scale, counters, Adam's count: exactly
            assert multi[leaf].tobytes() == ref[leaf].tobytes(), (leaf, multi[leaf], ref[leaf])
            continue
        scale = np.abs(ref[leaf]).max()
        worst = np.abs(multi[leaf] - ref[leaf]).max()
        assert worst <= REFERENCE_ULPS * 2.0**-10 * scale, (leaf, worst, scale)


@pytest.mark.parametrize("config", worker.CONFIGS)
def test_orbax_restore_in_two_new_processes_continues_bit_identically(runs, config):
    results, _ = runs
    trained, resumed = results["train", config], results["resume", config]
    for (t, _), (r, _) in zip(trained, resumed):
        restored, *continued = r["records"]
        at_save = t["records"][worker.SAVE_AT - 1]
        assert restored["step"] == "restored"
        for key in ("loss_scale", "counter", "notfinite_count", "total_notfinite"):
            assert restored[key] == at_save[key], key
        assert comparable(continued) == comparable(t["records"][worker.SAVE_AT :])
    a, b = assemble(trained), assemble(resumed)
    assert a.keys() == b.keys()
    for leaf in a:
        assert a[leaf].dtype == b[leaf].dtype and a[leaf].tobytes() == b[leaf].tobytes(), leaf


def test_no_worker_process_is_left_running(runs):
    _, pids = runs
    assert len(pids) == 4
    assert not [pid for pid in pids if _alive(pid)]


def test_a_failing_process_takes_its_peer_down_and_both_outputs_are_shown(tmp_path):
    # Process 1 fails at once (a bad argument); process 0 would wait in
    # jax.distributed.initialize for its peer: it must be killed, promptly.
    def args_for(i):
        configs = "fsdp" if i == 0 else "no-such-config"
        return [
            "--configs",
            configs,
            "--phase",
            "train",
            "--out",
            str(tmp_path),
            "--ckpt",
            str(tmp_path / "ckpt"),
        ]

    start = time.monotonic()
    with pytest.raises(LaunchError) as failure:
        launch(args_for, tmp_path, timeout=60)
    message = str(failure.value)
    assert "process 1: 2" in message and "process 0: still running (killed)" in message
    assert "--- process 0 output ---" in message and "--- process 1 output ---" in message
    assert "no-such-config" in message  # process 1's own error
    assert time.monotonic() - start < 30
    assert not [pid for pid in failure.value.pids if _alive(pid)]


def test_a_run_past_its_timeout_is_killed(tmp_path):
    with pytest.raises(LaunchError, match="timed out after 1 s") as failure:
        launch(
            lambda i: [
                "--phase",
                "train",
                "--out",
                str(tmp_path),
                "--ckpt",
                str(tmp_path / "ckpt"),
            ],
            tmp_path,
            timeout=1,
        )
    assert len(failure.value.pids) == 2
    assert not [pid for pid in failure.value.pids if _alive(pid)]


def test_multihost_example_demo_runs_two_processes_that_agree():
    # `examples/multihost.py --demo`: two processes of 4 CPU devices; process 1's
    # rows overflow float16 at step 5.
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "multihost.py"), "--demo", "--steps", "7"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT + 60,
        check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    per_process = []
    for process in (0, 1):
        steps = [l for l in lines if l.startswith(f"process {process} step ")]
        assert len(steps) == 7, run.stdout
        assert "loss nan loss scale 16384 skipped steps so far 1" in steps[5], steps
        assert steps[6].endswith("loss scale 16384 skipped steps so far 1"), steps
        per_process.append([l.split(" ", 2)[2] for l in steps])
    assert per_process[0] == per_process[1]  # same losses, scales and skips
    sums = [l.rsplit(" ", 1)[1] for l in lines if "checksum of its parameter shards" in l]
    assert len(sums) == 2 and sums[0] == sums[1], run.stdout  # replicated: the same bits
