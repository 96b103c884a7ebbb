"""The rule engine shared by the linen and NNX integrations: one matching, one behaviour."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx as jnnx
from jmp_policy.integrations.rules import RuleSet

MIXED = jmp.get_policy("mixed_bfloat16")
F32, BF16, F16 = np.dtype("float32"), np.dtype(jnp.bfloat16), np.dtype("float16")


class Base:
    pass


class Child(Base):
    pass


@pytest.mark.parametrize(
    "rules, path, expected",
    [
        ({}, "a/b", MIXED),
        ({"a/*": "f32"}, "a/b", jmp.get_policy("f32")),
        ({"a/*": "f32", "a/b": "f16"}, "a/b", jmp.get_policy("f16")),  # More literal chars.
        ({Base: "f32", Child: "f16"}, "x", jmp.get_policy("f16")),  # Nearest in the MRO.
        ({Child: "f16", "x": "f32"}, "x", jmp.get_policy("f32")),  # A path beats a class.
        ({"?": "f32", "*": "f16"}, "x", jmp.get_policy("f32")),  # Tie: listed first.
    ],
)
def test_policy_for(rules, path, expected):
    matched = set()
    policy, named = RuleSet(rules, Base, "a/b").policy_for(Child(), path, MIXED, matched)
    assert policy == expected
    assert named == (expected != MIXED)


def test_check_all_matched_names_the_pattern_and_paths():
    rule_set = RuleSet({"a/*": "f32", "zz": "f16"}, Base, "a/b")
    matched = set()
    rule_set.policy_for(Child(), "a/b", MIXED, matched)
    with pytest.raises(ValueError, match=r"pattern 'zz' matches no module.*\['a', 'a/b'\]"):
        rule_set.check_all_matched(matched, ["a/b", "a"], Child())


LINEN_DTYPES = {}


class RecordingDense(nn.Dense):
    def __call__(self, x):
        LINEN_DTYPES[self.name] = np.dtype(self.dtype)  # As with_policy set it for this call.
        return super().__call__(x)


class LinenNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = RecordingDense(4, name="body")(x)
        x = nn.LayerNorm(name="norm")(x)
        return RecordingDense(2, name="head")(x)


class NnxNet(nnx.Module):
    def __init__(self):
        rngs = nnx.Rngs(0)
        self.body = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)
        self.head = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, x):
        return self.head(self.norm(self.body(x)))


RULES = [
    {"head": "f32"},
    {"b*": "p=f32,c=f16,o=f16", "head": "f32"},
    {"*": "f32", "head": "mixed_bfloat16"},
]


@pytest.mark.parametrize("rules", RULES)
def test_linen_and_nnx_resolve_the_same_dtypes(rules):
    """Same rules, same module paths: the same compute dtype per layer in both integrations."""
    x = jnp.ones((2, 3))
    model = LinenNet()
    variables = model.init(jax.random.key(0), x)
    LINEN_DTYPES.clear()
    jmp.with_policy(model.apply, MIXED, rules=rules)(variables, x)
    mixed = jnnx.with_policy(NnxNet(), MIXED, rules=rules)
    nnx_dtypes = {name: np.dtype(getattr(mixed, name).dtype) for name in ("body", "head")}
    assert LINEN_DTYPES == nnx_dtypes


def test_linen_and_nnx_both_raise_on_an_unmatched_pattern():
    x, typo = jnp.ones((2, 3)), {"haed": "f32"}
    model = LinenNet()
    variables = model.init(jax.random.key(0), x)
    with pytest.raises(ValueError, match="'haed' matches no module") as linen_error:
        jmp.with_policy(model.apply, MIXED, rules=typo)(variables, x)
    with pytest.raises(ValueError, match="'haed' matches no module") as nnx_error:
        jnnx.with_policy(NnxNet(), MIXED, rules=typo)
    for error in (linen_error, nnx_error):
        assert "'head'" in str(error.value)  # The paths shown include the right one.
