"""The shared test helpers (`helpers.py`): a parser that missed an op, or a
comparison that missed a bit, would make the tests built on them prove nothing."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import assert_bitwise_equal, contractions, hlo_ops, lowered_ops

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)


def test_contractions_reads_dot_general_and_convolution_lines():
    text = "\n".join(
        [
            "    %3 = stablehlo.dot_general %1, %2, contracting_dims = [2] x [0], precision ="
            " [DEFAULT, DEFAULT] : (tensor<2x8x16xbf16>, tensor<16x64xbf16>) ->"
            " tensor<2x8x64xbf16>",
            "    %4 = stablehlo.add %3, %3 : tensor<2x8x64xbf16>",
            "    %5 = stablehlo.convolution(%a, %b) dim_numbers = [b, 0, 1, f]x[0, 1, i, o]->"
            "[b, 0, 1, f], window = {stride = [1, 1]} {batch_group_count = 1 : i64,"
            " feature_group_count = 1 : i64} : (tensor<4x8x8x3xf32>, tensor<3x3x3x8xf32>)"
            " -> tensor<4x8x8x8xf32>",
            "    %6 = stablehlo.dot_general %x, %y, contracting_dims = [0] x [0] :"
            " (tensor<24xf16>, tensor<24xf16>) -> tensor<f32>",
        ]
    )
    found = contractions(text)
    assert [c.name for c in found] == ["dot_general", "convolution", "dot_general"]
    assert [c.operand_dtypes for c in found] == [(BF16, BF16), (F32, F32), (F16, F16)]
    assert [c.result_dtype for c in found] == [BF16, F32, F32]
    assert [c.has_dim(24) for c in found] == [False, False, True]
    (add,) = [op for op in hlo_ops(text) if op.name == "add"]
    assert add.operand_types == add.result_types == ("bf16",)


def test_contractions_raise_on_a_line_they_cannot_read():
    with pytest.raises(ValueError, match="cannot read"):
        contractions("%1 = stablehlo.dot_general %a, %b, contracting_dims = [1] x [0]")
    # A contraction not at the start of an op's line is counted, not skipped.
    with pytest.raises(ValueError, match="read 0 of the 1"):
        contractions("%1 = call @f() {note = stablehlo.dot_general}")


def test_lowered_ops_of_a_real_program():
    def f(a, b):
        return jax.lax.dot_general(
            a, b, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32
        )

    a = jnp.ones((4, 8), jnp.bfloat16)
    dots = [op for op in lowered_ops(f, a, a.T) if op.name == "dot_general"]
    assert [(d.operands, d.results) for d in dots] == [(("4x8xbf16", "8x4xbf16"), ("4x4xf32",))]


def test_assert_bitwise_equal_sees_the_sign_of_zero_nan_payloads_and_dtypes():
    x = np.float32([0.0, np.nan])
    assert_bitwise_equal({"a": x}, {"a": jnp.asarray(x)})
    other_nan = x.view(np.uint32).copy()
    other_nan[1] |= 1  # still a NaN, another payload
    for other in (
        {"a": np.float32([-0.0, np.nan])},  # -0.0 == 0.0, but not bit for bit
        {"a": other_nan.view(np.float32)},
        {"a": x.astype(np.float64)},
        {"b": x},
    ):
        with pytest.raises(AssertionError):
            assert_bitwise_equal({"a": x}, other)
