"""Test set-up: 8 virtual CPU devices, and strict dtype promotion.

Strict promotion turns a silent float32 upcast into an error, which is what a
precision library should be tested under.
"""

import os

# Must be set before JAX starts its backend; multi-device tests need 8 devices.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_configure(config):
    # Slow tests still run in the normal test command; `-m "not slow"` skips them.
    config.addinivalue_line(
        "markers",
        "slow: long-running reliability test (runs by default; deselect with -m 'not slow')",
    )


# Scripts: each corpus script runs in a process of its own, where its model's
# package is importable; figures.py prints the corpus table of the docs.
collect_ignore = [
    "corpus/gemma_check.py",
    "corpus/maxtext_check.py",
    "corpus/maxtext_saved.py",
    "corpus/kerashub_check.py",
    "corpus/easydel_check.py",
    "corpus/easydel_saved.py",
    "corpus/figures.py",
]
