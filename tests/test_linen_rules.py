"""`with_policy` on linen models: rules (which policy each module gets, and
their specificity) and lifted transforms (`nn.scan`, `nn.remat`, `nn.vmap`).
Strict dtype promotion, as in `test_linen.py`.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from linen_models import (
    BF16,
    F16,
    F32,
    FEATURES,
    LM_DOTS,
    AutoEncoder,
    RematLM,
    ScanLM,
    VmapLM,
    _dtypes,
    _tokens,
    compute_dtypes,
    lowered_train_step,
)

from jmp_policy import Policy, with_policy

# --------------------------------------------------------------------------
# Rules: which policy each module gets. A module's output dtype is its
# compute dtype, so the captured outputs of every module read the rules back.


class MyDense(nn.Dense):
    pass


class MyDenser(MyDense):
    pass


class Stage(nn.Module):
    """Dense, LayerNorm, MyDense, Dense; optionally a nested Stage in between."""

    nested: bool = False

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(8)(x))
        if self.nested:
            x = Stage()(x)
        return nn.Dense(8)(MyDense(8)(x))


class Chain(nn.Module):
    """Modules in a chain: no arithmetic between the outputs of two modules."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(8)(x))
        x = Stage(name="Block_0")(x)
        x = Stage(nested=True, name="Block_1")(x)
        return MyDenser(8)(x)


# The modules of Chain, by path, and the class of each.
CHAIN = {
    "Dense_0": nn.Dense,
    "LayerNorm_0": nn.LayerNorm,
    "Block_0/Dense_0": nn.Dense,
    "Block_0/LayerNorm_0": nn.LayerNorm,
    "Block_0/MyDense_0": MyDense,
    "Block_0/Dense_1": nn.Dense,
    "Block_1/Dense_0": nn.Dense,
    "Block_1/LayerNorm_0": nn.LayerNorm,
    "Block_1/Stage_0/Dense_0": nn.Dense,
    "Block_1/Stage_0/LayerNorm_0": nn.LayerNorm,
    "Block_1/Stage_0/MyDense_0": MyDense,
    "Block_1/Stage_0/Dense_1": nn.Dense,
    "Block_1/MyDense_0": MyDense,
    "Block_1/Dense_1": nn.Dense,
    "MyDenser_0": MyDenser,
}
HALF16 = "p=f32,c=f16"  # A rule value whose compute dtype marks the modules it reached.


def leaf_output_dtypes(rules, policy="mixed_bfloat16") -> dict[str, np.dtype]:
    """The output dtype of each leaf module of `Chain` under `policy` and `rules`."""
    model = Chain()
    x = jnp.ones((2, 4))
    variables = jax.eval_shape(with_policy(model.init, policy, rules=rules), jax.random.key(0), x)
    apply = with_policy(model.apply, policy, rules=rules)
    _, state = jax.eval_shape(lambda v: apply(v, x, capture_intermediates=True), variables)
    found = {}
    for path, (out,) in flax.traverse_util.flatten_dict(state["intermediates"], sep="/").items():
        path = path.removesuffix("__call__").rstrip("/")
        if path in CHAIN:
            found[path] = np.dtype(out.dtype)
    assert set(found) == set(CHAIN)
    return found


def expect(default=BF16, **dtypes) -> dict[str, np.dtype]:
    return {path: dtypes.get(path, default) for path in CHAIN}


def expect_where(predicate, dtype, default=BF16):
    return {path: dtype if predicate(path, cls) else default for path, cls in CHAIN.items()}


def test_no_rules_every_module_in_compute_dtype():
    assert leaf_output_dtypes(None) == expect()
    assert leaf_output_dtypes(None, policy="f32") == expect(F32)


def test_class_rule_matches_subclasses():
    expected = expect_where(lambda _, cls: issubclass(cls, nn.Dense), F16)
    assert expected["MyDenser_0"] == F16 and expected["LayerNorm_0"] == BF16
    assert leaf_output_dtypes({nn.Dense: HALF16}) == expected


def test_path_pattern_star_crosses_slashes():
    assert leaf_output_dtypes({"Block_0/*": HALF16}) == expect_where(
        lambda p, _: p.startswith("Block_0/"), F16
    )
    # `*/LayerNorm_*` reaches nested LayerNorms, but not the top-level one.
    assert leaf_output_dtypes({"*/LayerNorm_*": "f32"}) == expect(
        **{
            "Block_0/LayerNorm_0": F32,
            "Block_1/LayerNorm_0": F32,
            "Block_1/Stage_0/LayerNorm_0": F32,
        }
    )


@pytest.mark.parametrize("reverse", [False, True], ids=["listed-first", "listed-last"])
def test_path_rule_beats_class_rule(reverse):
    rules = [(nn.Dense, HALF16), ("Block_0/Dense_0", "f32")]
    found = leaf_output_dtypes(dict(reversed(rules) if reverse else rules))
    expected = expect_where(lambda _, cls: issubclass(cls, nn.Dense), F16)
    assert found == {**expected, "Block_0/Dense_0": F32}


@pytest.mark.parametrize("reverse", [False, True], ids=["listed-first", "listed-last"])
def test_more_literal_pattern_beats_fewer(reverse):
    rules = [("Block_0/Dense_*", "f32"), ("Block_*", HALF16)]
    found = leaf_output_dtypes(dict(reversed(rules) if reverse else rules))
    expected = expect_where(lambda p, _: p.startswith("Block_"), F16)
    assert found == {**expected, "Block_0/Dense_0": F32, "Block_0/Dense_1": F32}


@pytest.mark.parametrize("reverse", [False, True], ids=["listed-first", "listed-last"])
def test_nearer_class_in_mro_beats_farther(reverse):
    rules = [(MyDense, "f32"), (nn.Dense, HALF16)]
    found = leaf_output_dtypes(dict(reversed(rules) if reverse else rules))
    assert found == {
        path: F32 if issubclass(cls, MyDense) else F16 if cls is nn.Dense else BF16
        for path, cls in CHAIN.items()
    }


def test_ties_go_to_the_rule_listed_first():
    # Both patterns have 14 literal characters and match Block_0/Dense_0.
    first = leaf_output_dtypes({"Block_0/Dense_?": HALF16, "Block_0/*ense_0": "f32"})
    second = leaf_output_dtypes({"Block_0/*ense_0": "f32", "Block_0/Dense_?": HALF16})
    only = {"Block_0/Dense_1": F16, "Block_0/MyDense_0": F32}  # Matched by one rule only.
    assert first == expect(**only, **{"Block_0/Dense_0": F16})
    assert second == expect(**only, **{"Block_0/Dense_0": F32})


@pytest.mark.parametrize("parent", ["Block_1", Stage], ids=["path", "class"])
def test_children_inherit_their_parents_rule(parent):
    found = leaf_output_dtypes({parent: HALF16})
    if parent is Stage:  # Every Stage: both blocks and the nested one.
        assert found == expect_where(lambda p, _: p.startswith("Block_"), F16)
    else:
        assert found == expect_where(lambda p, _: p.startswith("Block_1/"), F16)
    # A rule on a child overrides the inherited policy, for that child only.
    found = leaf_output_dtypes({parent: HALF16, "Block_1/Stage_0/Dense_1": "f32"})
    assert found["Block_1/Stage_0/Dense_1"] == F32
    assert found["Block_1/Stage_0/MyDense_0"] == F16


def test_rule_values_spec_or_policy():
    by_spec = leaf_output_dtypes({"Block_0": "p=f32,c=f16,o=f16"})
    by_policy = leaf_output_dtypes({"Block_0": Policy(F32, F16, F16)})
    assert by_spec == by_policy == expect_where(lambda p, _: p.startswith("Block_0/"), F16)


@pytest.mark.parametrize(
    ("rules", "error", "message"),
    [
        ({3: "f32"}, TypeError, r"Module subclass or a non-empty module path pattern.*got 3"),
        ({"": "f32"}, TypeError, r"non-empty module path pattern.*got ''"),
        ({int: "f32"}, TypeError, r"Module subclass.*got <class 'int'>"),
        ({"head": 3}, TypeError, r"rules\['head'\] must be a Policy or a policy spec.*got 3"),
        ({"head": "c=f17"}, ValueError, r"Unknown dtype 'f17'.*accepted dtype names"),
        ({"head": "c-f16"}, ValueError, r"'c-f16'"),
        ([("head", "f32")], TypeError, r"rules must be a mapping"),
    ],
    ids=["key-int", "key-empty", "key-class", "value-int", "value-dtype", "value-syntax", "list"],
)
def test_bad_rules_say_what_is_accepted(rules, error, message):
    with pytest.raises(error, match=message):
        with_policy(Chain().apply, "mixed_bfloat16", rules=rules)


def test_path_pattern_that_matches_no_module_is_an_error():
    model, x = AutoEncoder(), np.ones((2, 8), np.float32)
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    typo = {"encodr": "f32"}
    with pytest.raises(ValueError, match=r"pattern 'encodr' matches no module.*'encoder'"):
        jax.eval_shape(with_policy(model.apply, "mixed_bfloat16", rules=typo), variables, x)
    with pytest.raises(ValueError, match="'encodr'"):
        jax.eval_shape(with_policy(model.init, "mixed_bfloat16", rules=typo), jax.random.key(0), x)
    # Matched, or a `method=` call that runs only part of the model.
    good = with_policy(model.apply, "mixed_bfloat16", rules={"encoder": "f32"})
    jax.eval_shape(good, variables, x)
    partial = with_policy(model.apply, "mixed_bfloat16", rules={"decoder": "f32"})
    jax.eval_shape(lambda v: partial(v, x, method=AutoEncoder.encode), variables)


# --------------------------------------------------------------------------
# Lifted transforms.


@pytest.mark.parametrize(
    ("model", "count"),
    [
        # The loop bodies of the forward and backward scans appear once each.
        (ScanLM(), LM_DOTS),
        # The block's forward dots run again in the backward pass.
        (RematLM(), None),
        # Ensemble Dense and head, each forward and two backward.
        (VmapLM(), 6),
    ],
    ids=["scan", "remat", "vmap"],
)
def test_lifted_transforms_contract_in_half_with_float32_grads(model, count):
    found = lowered_train_step(model, "mixed_bfloat16")
    if count is None:
        assert len(found) > LM_DOTS
    else:
        assert len(found) == count
    assert compute_dtypes(found) == [BF16] * len(found)

    tokens = _tokens()
    params = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), tokens)[
        "params"
    ]
    apply = with_policy(model.apply, "mixed_bfloat16")
    loss = lambda p: apply({"params": p}, tokens, rngs={"dropout": jax.random.key(1)}).sum()
    grads = jax.eval_shape(jax.grad(loss), params)
    assert _dtypes(params) == _dtypes(grads) == {F32}
    if isinstance(model, ScanLM):
        assert params["blocks"]["Block_0"]["Dense_0"]["kernel"].shape == (2, FEATURES, 4 * FEATURES)
    if isinstance(model, VmapLM):
        assert params["VmapDense_0"]["kernel"].shape == (3, FEATURES, FEATURES)


def test_rules_reach_modules_inside_scan():
    # The float32 MLP's result meets the half residual: standard promotion, as
    # in the hand-written model with those two Dense in float32.
    with jax.numpy_dtype_promotion("standard"):
        found = lowered_train_step(ScanLM(), "mixed_bfloat16", rules={"blocks/*/Dense_*": "f32"})
    mlp = [c.has_dim(4 * FEATURES) for c in found]  # The MLP's two Dense.
    assert sum(mlp) == 6
    assert [c.operand_dtypes for c in found] == [
        (F32, F32) if is_mlp else (BF16, BF16) for is_mlp in mlp
    ]
