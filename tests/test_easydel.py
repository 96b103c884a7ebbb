"""EasyDeL (PyPI `easydel` 0.3.0, Flax NNX): tiny Llama, Mixtral and
DeepSeek-V3 causal LMs through `jmp_policy.nnx.PolicyModule` and `autocast`,
against EasyDeL's own half config (`dtype=bfloat16, param_dtype=float32`,
bf16 attention) with the same weights (`corpus/easydel_check.py`): the logits'
error against float32 at positions 8000..8031 and 0..31, and an Adam step the
way EasyDeL's trainer takes it, with a dynamic loss scale.

The script runs in a process of its own, with EasyDeL and what it imports
first on the path: `./run` installs them apart, in .venv/easydel, as their
pins clash with this project's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from corpus.checks import BF16, error_bound, is_fp8, run_apart

ROOT = Path(__file__).resolve().parent.parent
EASYDEL = ROOT / ".venv" / "easydel"
MODELS = ["llama", "mixtral", "deepseek_v3"]
FRONT_ENDS = ["policy_module", "policy_module_config", "autocast"]
POLICIES = ["mixed_bfloat16", "mixed_bfloat16,m=bf16", "mixed_float8"]
POSITIONS = ["pos8000", "pos0"]
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not (EASYDEL / "easydel").is_dir(),
        reason="./run installs EasyDeL and what it imports in .venv/easydel",
    ),
]


@pytest.fixture(scope="module")
def report() -> dict:
    return run_apart("easydel_check.py", EASYDEL)


@pytest.mark.parametrize("positions", POSITIONS)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("model", MODELS)
def test_easydel_as_close_as_its_half_config(report, model, front_end, policy, positions):
    # EasyDeL's rotary embedding promotes bf16 operands to float32 itself, in
    # its own half config too; a policy is held to that config's error, at
    # positions 8000.. as at 0.. (1.5x; FP8 to the corpus's FP8 bound, and
    # long positions may add nothing to its error at short ones).
    results = report[model]
    own = results["hand"][positions]
    got = results[f"{front_end}[{policy}]"]
    assert "error" not in got, (model, front_end, policy, got)
    bound = error_bound(policy, {BF16: own})
    assert got[positions] <= bound, (model, front_end, policy, positions, got, own)
    if is_fp8(policy):
        assert got["pos8000"] <= 1.5 * got["pos0"], (model, front_end, policy, got)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
@pytest.mark.parametrize("model", MODELS)
def test_easydel_loss_scaled_trainer_step_is_finite(report, model, front_end, policy):
    train = report[model][f"train[{front_end}][{policy}]"]
    assert train["ran"], (model, front_end, policy, train)
    assert train["loss_finite"] and train["grads_finite"] and train["update_finite"], train
