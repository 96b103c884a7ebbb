"""Google's MaxText (PyPI `maxtext` 0.2.5): its NNX llama2 decoder through
`jmp_policy.nnx`, its linen `TransformerLinen` (NNX wrapped by its own
`ToLinen`) through `with_policy`, and both through `autocast`, against its own
bf16 config (`corpus/maxtext_check.py`: forward error, float32 products, Adam
steps on the CPU, cached decoding into a half KV cache).

Each front end runs in a process of its own, with MaxText and what it imports
first on the path: `./run` installs them apart, in .venv/maxtext, as their
pins clash with this project's.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAXTEXT = ROOT / ".venv" / "maxtext"
FRONT_ENDS = ["nnx", "nnx-config", "linen", "nnx-autocast", "linen-autocast"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (MAXTEXT / "maxtext").is_dir(), reason="./run installs MaxText in .venv/maxtext"
    ),
]


@functools.cache
def run(front_end: str) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(MAXTEXT), str(ROOT / "tests"), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run(
            [sys.executable, str(ROOT / "tests" / "corpus" / "maxtext_check.py"), front_end],
            env={**os.environ, "PYTHONPATH": path, "TMPDIR": tmp},
            capture_output=True,
            text=True,
            timeout=900,
        )


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_maxtext(front_end):
    done = run(front_end)
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    assert "every check holds" in done.stdout, done.stdout


def test_maxtext_products_take_one_dtype_in_every_front_end():
    # The same decoder (linen's is MaxText's NNX one behind its own ToLinen):
    # within each policy, every product's operand dtypes agree across the
    # four routes, as one engine decides them.
    seen = {}
    for front_end in FRONT_ENDS:
        lines = [
            line for line in run(front_end).stdout.splitlines() if line.startswith("products ")
        ]
        assert lines, run(front_end).stdout + run(front_end).stderr[-4000:]
        seen[front_end] = dict(line.split(": ", 1) for line in lines)
    for policy in seen["nnx"]:
        by_front_end = {f: json.loads(seen[f][policy]) for f in FRONT_ENDS}
        assert all(p == by_front_end["nnx"] for p in by_front_end.values()), (policy, by_front_end)


def test_every_front_end_saves_no_more_than_maxtexts_own_bf16_config():
    # tests/corpus/maxtext_saved.py: bytes saved for the backward pass under
    # mixed_bfloat16, by layout (scan_layers, remat_policy) and front end.
    # `with_policy` runs the linen form, its NNX layers behind `ToLinen`
    # where no dtype field reaches them, held against that form's own config.
    path = os.pathsep.join([str(MAXTEXT), str(ROOT / "tests"), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "corpus" / "maxtext_saved.py")],
            env={**os.environ, "PYTHONPATH": path, "TMPDIR": tmp},
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(found) == 8, found  # llama2 and mixtral, scan off/on, remat minimal/full.
    for layout, figures in found.items():
        # Told that its casts to float32 are its config's dtype, `PolicyModule`
        # keeps the residual stream in bf16 as the own config does; its fields
        # trace the megablox kernel in bf16 too. Untold, it saves more: up to 1.2x.
        assert figures["PolicyModule"] <= 1.02 * figures["own config"], (layout, figures)
        assert figures["PolicyModule, no config_dtype"] > figures["PolicyModule"], (layout, figures)
        # No field reaches MaxText's megablox kernel (mixtral's expert products)
        # here: it runs as traced, in float32, its result rounded back to bf16.
        assert figures["autocast"] <= 1.02 * figures["own config"], (layout, figures)
        assert figures["with_policy"] <= 1.02 * figures["own config (linen)"], (layout, figures)
