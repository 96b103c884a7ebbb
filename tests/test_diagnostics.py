"""`jmp_policy.diagnose` (core) on gradients with a known answer, and the
doctor's rendering of its report (`jmp_policy.app.doctor`).

The `jmp-policy doctor` command is tested in `test_cli.py`.
"""

import math

import flax.linen as nn
import jax
import jax.ad_checkpoint
import jax.numpy as jnp
import numpy as np
import pytest

from jmp_policy.app import doctor
from jmp_policy.core import diagnostics

from helpers import assert_png


def test_diagnose_known_shares():
    # 8 values: 2 below 2^-24, 2 more below 2^-14, 1 above 65504.
    g = np.array([2.0**-30, 2.0**-26, 2.0**-20, 2.0**-16, 2.0**-5, 0.125, 1.0, 2.0**17], np.float32)
    report = diagnostics.diagnose({"a": jnp.asarray(g), "steps": jnp.int32(3)})
    (stats,) = report.arrays  # the integer leaf is not a gradient
    assert stats.path == "a" and stats.shape == (8,)
    assert stats.f16_underflow == 0.25
    assert stats.f16_below_normal == 0.5
    assert stats.f16_overflow == 0.125
    assert stats.bf16_underflow == stats.bf16_overflow == stats.bf16_below_normal == 0.0
    assert stats.max_abs == 2.0**17 and stats.min_abs == 2.0**-30
    assert report.total == stats.__class__(**{**stats.__dict__, "path": "all", "shape": ()})
    assert report.recommended_policy == "mixed_bfloat16"
    assert report.recommended_loss_scale is None
    assert report.log2_counts.sum() == 8
    text = doctor.report_text(report)
    assert "25.0%" in text and "mixed_bfloat16" in text


def test_diagnose_float16_loss_scale_lifts_small_values_without_overflow():
    g = jnp.array([2.0**-30, 2.0**-20, 2.0**-3], jnp.float32)
    report = diagnostics.diagnose(g)
    # 2^-3 * S <= 65504 / 2  ->  S = 2^17; then 2^-30 * 2^17 = 2^-13 survives.
    assert report.float16_loss_scale == 2.0**17
    assert report.f16_underflow_scaled == 0.0 and report.f16_overflow_scaled == 0.0
    assert math.isclose(report.total.f16_underflow, 1 / 3)


def test_diagnose_nonfinite_recommends_fixing_first():
    report = diagnostics.diagnose([jnp.array([1.0, jnp.inf, 0.0, 2.0])])
    assert report.total.nonfinite == 0.25 and report.total.zero == 0.25
    assert report.recommended_policy == "float32"


def test_diagnose_rejects_gradients_with_arguments():
    with pytest.raises(TypeError, match="either"):
        diagnostics.diagnose({"w": jnp.ones(2)}, 1.0)


class TinyDense(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4, use_bias=False)(x)


def test_doctor_on_a_model_whose_gradients_underflow(tmp_path):
    # loss = sum(x @ W), so dL/dW[i, j] = sum over the batch of x[:, i]: exactly
    # the input. Two of the 8 input features are 2^-30: 25% of the kernel's
    # gradient values (2 rows of 8) flush to zero in float16.
    model = TinyDense()
    x = jnp.asarray(np.array([[2.0**-30, 2.0**-30, 1, 1, 1, 1, 1, 1]], np.float32))
    params = model.init(jax.random.key(0), x)

    def loss(p, x):
        return model.apply(p, x).sum()

    report = diagnostics.diagnose(jax.jit(jax.grad(loss)), params, x)
    (stats,) = report.arrays
    assert stats.path == "params/Dense_0/kernel" and stats.shape == (8, 4)
    assert stats.f16_underflow == 0.25
    assert stats.f16_below_normal == 0.25
    assert stats.min_abs == 2.0**-30 and stats.max_abs == 1.0
    # Found inside the jit: the forward product (1, 8) x (8, 4) and the
    # backward one; M=1 (the batch) and N=4 are not multiples of 8.
    forward = [m for m in report.matmuls if m.lhs_shape == (1, 8) and m.rhs_shape == (8, 4)]
    assert len(forward) == 1 and forward[0].misaligned == {"M": 1, "N": 4}
    assert "Dense_0" in forward[0].name
    assert len(report.misaligned_matmuls) == len(report.matmuls) == 2
    assert "not a multiple of 8" in doctor.report_text(report)
    png = tmp_path / "hist.png"
    doctor.plot_histogram(report, png)
    assert_png(png)


def test_find_matmuls_aligned_and_conv():
    mm = diagnostics.find_matmuls(jnp.dot, jnp.ones((16, 32)), jnp.ones((32, 64)))
    assert [(m.m, m.n, m.k, m.misaligned) for m in mm] == [(16, 64, 32, {})]
    conv = diagnostics.find_matmuls(
        lambda x, w: jax.lax.conv_general_dilated(x, w, (1, 1), "SAME"),
        jnp.ones((2, 3, 8, 8)),
        jnp.ones((16, 3, 3, 3)),
    )
    (c,) = conv
    assert (c.m, c.n, c.k) == (2 * 8 * 8, 16, 27) and c.misaligned == {"K": 27}


def test_plot_histogram_accepts_gradients(tmp_path):
    png = tmp_path / "g.png"
    doctor.plot_histogram({"w": jnp.logspace(-12, 2, 100, dtype=jnp.float32)}, png)
    assert_png(png)


def test_saved_residuals_reads_the_program_not_printed_text(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("print_saved_residuals was called")

    monkeypatch.setattr(jax.ad_checkpoint, "print_saved_residuals", refuse)
    monkeypatch.setattr(diagnostics, "print_saved_residuals", refuse, raising=False)
    x, w = jnp.ones((2, 3)), jnp.ones((3, 4))
    saved = diagnostics.saved_residuals(lambda x, w: jnp.tanh(x @ w).sum(), x, w)
    assert [r.shape for r, _ in saved] == [(2, 3), (3, 4), (2, 4)]
    wheres = [where for _, where in saved]
    assert wheres[:2] == ["from the argument [0]", "from the argument [1]"]
    assert wheres[2].startswith("output of ") and "test_diagnostics.py:" in wheres[2]
