"""Tests run under strict dtype promotion: a silent float32 upcast is an error."""

import jax

jax.config.update("jax_numpy_dtype_promotion", "strict")
