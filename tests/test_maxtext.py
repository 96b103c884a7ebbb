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

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
MAXTEXT = ROOT / ".venv" / "maxtext"


@pytest.mark.skipif(
    not (MAXTEXT / "maxtext").is_dir(), reason="./run installs MaxText in .venv/maxtext"
)
@pytest.mark.parametrize("front_end", ["nnx", "linen", "nnx-autocast", "linen-autocast"])
def test_maxtext(front_end, tmp_path):
    path = os.pathsep.join([str(MAXTEXT), str(ROOT / "tests"), str(ROOT)])
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "corpus" / "maxtext_check.py"), front_end],
        env={**os.environ, "PYTHONPATH": path, "TMPDIR": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "every check holds" in run.stdout, run.stdout
