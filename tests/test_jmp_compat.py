"""jmp 0.0.4's own test suite, run from the installed `jmp` wheel against jmp_policy.

The test files are read from the installed package and their `jmp` import is
pointed at `jmp_policy`; nothing of jmp is copied into this repository.
"""

import importlib.resources
import types
import unittest

import jax
import pytest

pytest.importorskip("absl.testing.parameterized")

_IMPORTS = (
    "from jmp._src import policy as jmp",
    "from jmp._src import loss_scale as jmp",
)


def _load_jmp_test(filename: str) -> types.ModuleType:
    source = importlib.resources.files("jmp._src").joinpath(filename).read_text()
    for line in _IMPORTS:
        source = source.replace(line, "import jmp_policy as jmp")
    assert "import jmp_policy as jmp" in source, f"jmp's {filename} changed shape"
    module = types.ModuleType(f"jmp_upstream_{filename[:-3]}")
    exec(compile(source, f"jmp/_src/{filename}", "exec"), module.__dict__)
    return module


_policy_tests = _load_jmp_test("policy_test.py")
_loss_scale_tests = _load_jmp_test("loss_scale_test.py")


# Left out by name, with the reason. absl's `parameterized` expands each
# test into numbered copies (test_str0, test_str1, ...); all are left out.
LEFT_OUT = {
    "test_str": "reads jmp's private `dtype_to_names` table; test_policy.py "
    "checks the same property (str prints jmp's dtype names and round-trips).",
}


def _without_left_out(cls: type) -> type:
    for name in dir(cls):
        base = name.rstrip("0123456789")
        if name.startswith("test") and base in LEFT_OUT:
            setattr(cls, name, unittest.skip(LEFT_OUT[base])(getattr(cls, name)))
    return cls


JmpPolicyTest = _without_left_out(type("JmpPolicyTest", (_policy_tests.PolicyTest,), {}))
JmpLossScaleTest = _without_left_out(
    type("JmpLossScaleTest", (_loss_scale_tests.LossScaleTest,), {})
)


del _policy_tests, _loss_scale_tests


@pytest.fixture(autouse=True)
def _standard_promotion():
    # jmp's tests compare float16 with float32 arrays, which needs standard
    # promotion; the rest of our suite runs under strict promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield
