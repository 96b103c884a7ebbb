"""keras-hub (PyPI `keras-hub` 0.32.0, Keras 3.15.1 on JAX): a tiny
`GemmaBackbone` run by Keras' own `stateless_call` under `autocast`, against
Keras' own half config, the `mixed_bfloat16` dtype policy, with the same
weights (`corpus/kerashub_check.py`): the output error against float32 over
positions 0..1023 and at positions 8192.. (keras-hub's own cached call), and
an Adam step with a dynamic loss scale.

The script runs in a process of its own, with keras-hub and Keras first on the
path: `./run` installs them apart, in .venv/kerashub.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from corpus.checks import BF16, error_bound, is_fp8, run_apart

ROOT = Path(__file__).resolve().parent.parent
KERASHUB = ROOT / ".venv" / "kerashub"
POLICIES = ["mixed_bfloat16", "mixed_bfloat16,m=bf16", "mixed_float8"]
WINDOWS = ["len1024", "pos8192"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (KERASHUB / "keras_hub").is_dir(),
        reason="./run installs keras-hub and Keras in .venv/kerashub",
    ),
]


@pytest.fixture(scope="module")
def report() -> dict:
    return run_apart("kerashub_check.py", KERASHUB, KERAS_BACKEND="jax")


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("policy", POLICIES)
def test_kerashub_autocast_as_close_as_keras_mixed(report, policy, window):
    # Keras' own mixed_bfloat16 keeps RoPE's angles in float32 (keras-hub's
    # RotaryEmbedding); autocast of the float32 model is held to its error
    # (1.5x; FP8 to the corpus's FP8 bound, long positions adding nothing).
    own = report["keras_mixed"][window]
    got = report[f"autocast[{policy}]"][window]
    assert got <= error_bound(policy, {BF16: own}), (policy, window, got, own, report)
    if is_fp8(policy):
        errors = report[f"autocast[{policy}]"]
        assert errors["pos8192"] <= 1.5 * errors["len1024"], errors


def test_kerashub_loss_scaled_step_is_finite(report):
    train = report["train"]
    assert train["loss_finite"] and train["grads_finite"] and train["update_finite"], train
