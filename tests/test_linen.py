"""Tests of `jmp_policy.with_policy` on real Flax linen models.

Grouped by concept: the contractions (`dot_general`, convolution) of whole
lowered train steps, the dtypes of parameters, gradients, outputs and
`batch_stats`, the linen entry points (`init`, `init_with_output`, `method=`,
`rngs`, `mutable`), rules and their specificity, lifted transforms, the jit
cache, plain functions, the user's module attributes, and training numerics.

Everything runs under strict dtype promotion (see `conftest.py`), so a silent
float32 upcast inside a model is an error rather than a slow matmul. Dtype
checks use `jax.eval_shape` and `.lower()` where they can: nothing is compiled
that a shape or a program text can answer.
"""

from __future__ import annotations

import functools
import re
import warnings
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jmp_policy import Policy, with_policy
from jmp_policy.core.diagnostics import saved_residuals

from helpers import HloOp, contractions

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

VOCAB = 24  # No other dimension of the models below is 24: it marks the head.
FEATURES = 16
SEQ = 8
BATCH = 2
SEEN: dict[str, Any] = {}  # What modules saw while traced.


# --------------------------------------------------------------------------
# Reading contractions out of lowered StableHLO (`helpers.contractions`).


def compute_dtypes(found: list[HloOp]) -> list[np.dtype]:
    """The operand dtype of each contraction; both operands must agree."""
    dtypes = []
    for c in found:
        lhs, rhs = c.operand_dtypes
        assert lhs == rhs, f"mixed operands in {c}"
        dtypes.append(lhs)
    return dtypes


# --------------------------------------------------------------------------
# Models.


class Block(nn.Module):
    """A pre-norm Transformer block: LayerNorm, attention, LayerNorm, MLP, residuals."""

    features: int = FEATURES
    num_heads: int = 2
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32), dtype=bool)
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dropout_rate=self.dropout_rate, deterministic=not train
        )(h, mask=mask)
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * self.features)(h))
        h = nn.Dense(self.features)(h)
        return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class Head(nn.Dense):
    """The logits layer; its own class so that a class rule can single it out."""


class LM(nn.Module):
    """Token and position embeddings, one `Block`, a final LayerNorm and a `Head`."""

    vocab_size: int = VOCAB
    features: int = FEATURES
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        positions = jnp.arange(tokens.shape[-1])
        x = nn.Embed(self.vocab_size, self.features)(tokens)
        x = x + nn.Embed(SEQ, self.features)(positions)
        x = Block(self.features, dropout_rate=self.dropout_rate)(x, train)
        x = nn.LayerNorm()(x)
        return Head(self.vocab_size, name="head")(x)


def _tokens(seed=0, shape=(BATCH, SEQ)):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.int32)


def _dtypes(tree) -> set[np.dtype]:
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def materialize(shapes, seed: int = 0):
    """Concrete variables shaped and typed like `shapes` (from `jax.eval_shape`).

    Compiling Flax's random initialisers costs seconds on CPU; these tests need
    plausible values (fan-in scaled kernels, unit scales and variances), not
    Flax's. The dtypes are those `with_policy(model.init, ...)` chose.
    """
    rng = np.random.default_rng(seed)

    def value(path, leaf):
        name = path[-1].key
        if name in ("kernel", "embedding"):
            fan_in = leaf.shape[-1] if name == "embedding" else np.prod(leaf.shape[:-1])
            x = rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
        elif name in ("scale", "var"):
            x = np.ones(leaf.shape)
        else:
            x = np.zeros(leaf.shape)
        return x.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(value, shapes)


def make_train_step(apply, tx):
    """A whole train step: value_and_grad through `apply`, then an optax update."""

    def train_step(params, opt_state, tokens, targets, key):
        def loss_fn(p):
            logits = apply({"params": p}, tokens, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return train_step


# optax.adam's bias correction (`decay ** count`, float ** int32) fails under
# strict promotion; SGD with momentum does not, and is enough here.
TX = optax.sgd(0.1, momentum=0.9)


def lowered_train_step(model, policy, rules=None) -> list[HloOp]:
    """The contractions of `model`'s whole jitted train step under `policy`."""
    tokens = _tokens()
    init = with_policy(model.init, policy, rules=rules)
    params = jax.eval_shape(init, jax.random.key(0), tokens)["params"]
    opt_state = jax.eval_shape(TX.init, params)
    step = make_train_step(with_policy(model.apply, policy, rules=rules), TX)
    lowered = jax.jit(step).lower(params, opt_state, tokens, tokens, jax.random.key(1))
    return contractions(lowered.as_text())


# --------------------------------------------------------------------------
# Every contraction of a whole train step, forward and backward.

# Per Dense-like layer, one forward dot and two backward ones (input and weight
# gradients); the LM has q, k, v, out, two MLP Dense and the head (7 x 3 = 21)
# and two attention einsums, logits and weighted values (2 x 3 = 6).
LM_DOTS = 27
HEAD_DOTS = 3


@pytest.mark.parametrize(("policy", "half"), [("mixed_bfloat16", BF16), ("mixed_float16", F16)])
def test_train_step_contracts_only_in_half(policy, half):
    found = lowered_train_step(LM(), policy)
    assert len(found) == LM_DOTS
    assert {c.name for c in found} == {"dot_general"}
    assert compute_dtypes(found) == [half] * LM_DOTS


def test_train_step_without_policy_contracts_in_float32():
    # The baseline the test above must differ from.
    found = lowered_train_step(LM(), "f32")
    assert compute_dtypes(found) == [F32] * LM_DOTS


@pytest.mark.parametrize(
    "rules",
    [{"head": "f32"}, {Head: "f32"}, {"head": Policy(F32, F32, F32)}],
    ids=["path", "class", "Policy-value"],
)
def test_float32_rule_on_head_makes_exactly_its_dots_float32(rules):
    found = lowered_train_step(LM(), "mixed_bfloat16", rules)
    assert len(found) == LM_DOTS
    head = [c.has_dim(VOCAB) for c in found]
    assert sum(head) == HEAD_DOTS
    assert [c.operand_dtypes for c in found] == [
        (F32, F32) if is_head else (BF16, BF16) for is_head in head
    ]


def test_float32_layernorm_rule_keeps_the_next_matmuls_in_half():
    # A float32 LayerNorm emits float32; the modules after it still get half inputs.
    found = lowered_train_step(LM(), "mixed_bfloat16", {nn.LayerNorm: "f32"})
    assert compute_dtypes(found) == [BF16] * LM_DOTS

    model = LM()
    tokens = _tokens()
    variables = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), tokens)
    apply = with_policy(model.apply, "mixed_bfloat16", rules={nn.LayerNorm: "f32"})
    _, state = jax.eval_shape(
        lambda v, t: apply(v, t, capture_intermediates=True), variables, tokens
    )
    out = jax.tree.map(lambda x: x.dtype, state["intermediates"])
    assert out["LayerNorm_0"]["__call__"] == (F32,)
    assert out["Block_0"]["LayerNorm_0"]["__call__"] == (F32,)
    assert out["Block_0"]["LayerNorm_1"]["__call__"] == (F32,)
    assert out["Block_0"]["Dense_0"]["__call__"] == (BF16,)
    assert out["Block_0"]["MultiHeadDotProductAttention_0"]["__call__"] == (BF16,)
    assert out["head"]["__call__"] == (BF16,)


class Residual(nn.Module):
    """A container doing its own arithmetic on its input: no dtype attribute."""

    @nn.compact
    def __call__(self, x):
        SEEN["residual input"] = x.dtype
        return x + nn.Dense(x.shape[-1])(x)


def test_module_without_dtype_gets_what_it_is_given_unless_a_rule_names_it():
    # The input rule: a module doing its own `jnp` maths (no `dtype` attribute)
    # computes on what it is given, as in a hand-written model: after a float32
    # LayerNorm, its residual is float32 (standard promotion), while its Dense
    # still multiplies in half. A rule naming the module casts its inputs.
    model = nn.Sequential([nn.LayerNorm(), Residual(), nn.Dense(4)])
    x = jnp.ones((2, 8))
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    for rules, residual in [
        ({nn.LayerNorm: "f32"}, F32),
        ({nn.LayerNorm: "f32", Residual: "mixed_bfloat16"}, BF16),
    ]:
        apply = with_policy(model.apply, "mixed_bfloat16", rules=rules)
        SEEN.clear()
        with jax.numpy_dtype_promotion("standard"):
            _, state = jax.eval_shape(lambda v: apply(v, x, capture_intermediates=True), variables)
            found = contractions(jax.jit(apply).lower(variables, x).as_text())
        out = state["intermediates"]
        assert SEEN["residual input"] == residual
        assert out["layers_0"]["__call__"][0].dtype == F32
        assert out["layers_1"]["__call__"][0].dtype == residual
        assert compute_dtypes(found) == [BF16, BF16]


def test_train_step_keeps_params_grads_and_optimizer_state_in_param_dtype():
    model = LM()
    tokens = _tokens()
    init = with_policy(model.init, "mixed_bfloat16")
    params = jax.eval_shape(init, jax.random.key(0), tokens)["params"]
    opt_state = jax.eval_shape(TX.init, params)
    step = make_train_step(with_policy(model.apply, "mixed_bfloat16"), TX)
    new_params, new_opt_state, loss, grads = jax.eval_shape(
        step, params, opt_state, tokens, tokens, jax.random.key(1)
    )
    assert _dtypes(params) == {F32}
    assert _dtypes(new_params) == {F32}
    assert _dtypes(grads) == {F32}
    assert _dtypes(new_opt_state) == {F32}
    assert loss.dtype == F32
    assert jax.tree.structure(grads) == jax.tree.structure(params)


def test_bf16_policy_gives_bf16_params_and_grads():
    model = LM()
    tokens = _tokens()
    params = jax.eval_shape(with_policy(model.init, "bf16"), jax.random.key(0), tokens)["params"]
    apply = with_policy(model.apply, "bf16")
    grads = jax.eval_shape(
        jax.grad(lambda p: apply({"params": p}, tokens).astype(F32).sum()), params
    )
    assert _dtypes(params) == {BF16}
    assert _dtypes(grads) == {BF16}


# --------------------------------------------------------------------------
# Parameters, outputs and the linen entry points.


class Scale(nn.Module):
    """A custom module with no `dtype`/`param_dtype` attributes."""

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        return x * scale.astype(x.dtype)  # It casts its parameter itself.


class ScaledMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(Scale()(nn.Dense(8)(x)))


@pytest.mark.parametrize(
    ("policy", "param"),
    [("mixed_bfloat16", F32), ("mixed_float16", F32), ("bf16", BF16), ("f16", F16)],
)
@pytest.mark.parametrize("model", [LM(), ScaledMLP()], ids=["LM", "custom-module"])
def test_init_creates_params_in_param_dtype(model, policy, param):
    x = _tokens() if isinstance(model, LM) else jnp.ones((2, 3))
    variables = jax.eval_shape(with_policy(model.init, policy), jax.random.key(0), x)
    assert _dtypes(variables["params"]) == {param}


def test_init_without_policy_gives_float32_params():
    # So that the "bf16" cases above cannot pass by accident.
    variables = jax.eval_shape(ScaledMLP().init, jax.random.key(0), jnp.ones((2, 3)))
    assert _dtypes(variables) == {F32}


@pytest.mark.parametrize(
    ("rules", "modules"),
    [({"head": "bf16"}, ["head"]), ({nn.Embed: "bf16"}, ["Embed_0", "Embed_1"])],
    # nn.Embed creates its parameter in `setup`, not in a compact `__call__`.
    ids=["compact-module", "setup-module"],
)
def test_rule_with_another_param_dtype_stores_that_module_in_it(rules, modules):
    variables = jax.eval_shape(
        with_policy(LM().init, "mixed_bfloat16", rules=rules), jax.random.key(0), _tokens()
    )
    params = dict(variables["params"])
    assert _dtypes([params.pop(name) for name in modules]) == {BF16}
    assert _dtypes(params) == {F32}


@pytest.mark.parametrize(
    ("policy", "output"),
    [("mixed_bfloat16", F32), ("mixed_float16", F32), ("bf16", BF16), ("p=f32,c=bf16", BF16)],
)
def test_apply_returns_output_dtype(policy, output):
    model = LM()
    tokens = _tokens()
    variables = jax.eval_shape(with_policy(model.init, policy), jax.random.key(0), tokens)
    logits = jax.eval_shape(with_policy(model.apply, policy), variables, tokens)
    assert logits.dtype == output


@pytest.mark.parametrize(("policy", "dtype"), [("mixed_bfloat16", F32), ("bf16", BF16)])
def test_init_with_output(policy, dtype):
    init = jax.jit(with_policy(LM().init_with_output, policy))
    out, variables = jax.eval_shape(init, jax.random.key(0), _tokens())
    assert out.dtype == dtype
    assert _dtypes(variables["params"]) == {dtype}
    # Forward only: q, k, v, logits, weighted values, out, two MLP Dense, head.
    found = contractions(init.lower(jax.random.key(0), _tokens()).as_text())
    assert compute_dtypes(found) == [BF16] * 9


def test_variables_and_rngs_by_keyword():
    model, x = nn.Dense(4), np.ones((2, 3), np.float32)
    init = with_policy(model.init, "bf16")
    variables = jax.eval_shape(lambda: init(rngs=jax.random.key(0), inputs=x))
    assert _dtypes(variables) == {BF16}
    out = jax.eval_shape(
        lambda v: with_policy(model.apply, "bf16")(variables=v, inputs=x), variables
    )
    assert out.dtype == BF16
    with pytest.raises(TypeError, match="apply\\(\\) missing its first argument, 'variables'"):
        with_policy(model.apply, "bf16")(inputs=x)


class AutoEncoder(nn.Module):
    def setup(self):
        self.encoder = nn.Dense(4)
        self.decoder = nn.Dense(8)

    def encode(self, x):
        return self.encoder(x)

    def __call__(self, x):
        return self.decoder(self.encode(x))


@pytest.mark.parametrize("method", [AutoEncoder.encode, "encode"], ids=["function", "name"])
def test_method_argument(method):
    model = AutoEncoder()
    x = jnp.ones((2, 8))
    variables = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), x)
    encode = jax.jit(lambda v, x: with_policy(model.apply, "mixed_bfloat16")(v, x, method=method))
    assert jax.eval_shape(encode, variables, x).shape == (2, 4)
    assert jax.eval_shape(encode, variables, x).dtype == F32
    found = contractions(encode.lower(variables, x).as_text())
    assert [c.results for c in found] == [("2x4xbf16",)]  # The encoder's dot only.


def test_embed_attend_through_method():
    # Weight tying: logits from the embedding matrix, through `method=`.
    embed = nn.Embed(VOCAB, FEATURES)
    variables = jax.eval_shape(
        with_policy(embed.init, "mixed_bfloat16"), jax.random.key(0), _tokens()
    )
    assert _dtypes(variables) == {F32}
    query = jnp.ones((2, FEATURES))
    apply = with_policy(embed.apply, "mixed_bfloat16")
    attend = jax.jit(lambda v, q: apply(v, q, method=nn.Embed.attend))
    assert jax.eval_shape(attend, variables, query).dtype == F32
    found = contractions(attend.lower(variables, query).as_text())
    assert [c.operands for c in found] == [("2x16xbf16", "16x24xbf16")]


def test_modules_whose_dtype_is_none_compute_in_compute_dtype():
    model = nn.Dense(4)
    assert model.dtype is None  # Flax's default: promote inputs and params.
    x = jnp.ones((2, 3))
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    plain = contractions(jax.jit(model.apply).lower(variables, x).as_text())
    wrapped = jax.jit(with_policy(model.apply, "mixed_bfloat16"))
    found = contractions(wrapped.lower(variables, x).as_text())
    assert compute_dtypes(plain) == [F32]
    assert compute_dtypes(found) == [BF16]


# --------------------------------------------------------------------------
# Mutable collections and dropout: these run.


class ConvNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Conv(8, (3, 3))(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(x))
        x = nn.Conv(8, (3, 3), strides=2)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.5)(x))
        return nn.Dense(10)(x.mean((1, 2)))


@pytest.mark.parametrize(("policy", "half"), [("mixed_bfloat16", BF16), ("mixed_float16", F16)])
def test_convnet_train_step_contracts_in_half_with_float32_batch_stats(policy, half):
    model = ConvNet()
    x = jnp.ones((4, 8, 8, 3))
    labels = jnp.arange(4)
    variables = jax.eval_shape(with_policy(model.init, policy), jax.random.key(0), x)
    apply = with_policy(model.apply, policy)

    def grads_and_stats(params, batch_stats):
        def loss_fn(p):
            logits, state = apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
            return loss, state

        (_, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        return grads, state["batch_stats"]

    args = variables["params"], variables["batch_stats"]
    grads, batch_stats = jax.eval_shape(grads_and_stats, *args)
    assert _dtypes(grads) == {F32}
    assert _dtypes(batch_stats) == {F32}
    found = contractions(jax.jit(grads_and_stats).lower(*args).as_text())
    # Two convolutions forward; backward, the weight gradient of both and the
    # input gradient of the second (the first's input is data). The Dense: 3.
    assert sorted(c.name for c in found) == ["convolution"] * 5 + ["dot_general"] * 3
    assert compute_dtypes(found) == [half] * 8


def test_batch_stats_are_float32_and_updated():
    model = ConvNet()
    x = np.random.default_rng(1).standard_normal((4, 8, 8, 3)).astype(np.float32)
    shapes = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), x)
    before = materialize(shapes)
    apply = with_policy(model.apply, "mixed_bfloat16")
    out, state = jax.jit(
        lambda v, x: apply(
            v,
            x,
            train=True,
            mutable=["batch_stats", "intermediates"],
            capture_intermediates=lambda m, _: isinstance(m, nn.Conv),
        )
    )(before, x)
    after = state["batch_stats"]
    assert out.dtype == F32
    assert _dtypes(shapes["batch_stats"]) == _dtypes(after) == {F32}
    # The Conv fed its BatchNorm half precision activations; the running mean
    # moved half way (momentum 0.5) from 0 to their batch mean. (XLA may skip
    # the bf16 rounding inside the fusion: hence the tolerance.)
    (conv,) = state["intermediates"]["Conv_0"]["__call__"]
    assert conv.dtype == BF16
    batch_mean = conv.astype(F32).mean((0, 1, 2))
    np.testing.assert_allclose(after["BatchNorm_0"]["mean"], 0.5 * batch_mean, rtol=2e-2, atol=2e-4)
    assert not np.allclose(after["BatchNorm_0"]["var"], before["batch_stats"]["BatchNorm_0"]["var"])


def test_dropout_rngs():
    model = nn.Sequential([nn.Dense(64), nn.Dropout(0.5, deterministic=False)])
    x = jnp.ones((4, 8))
    shapes = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), x)
    apply = with_policy(model.apply, "mixed_bfloat16")
    run = jax.jit(lambda v, key: apply(v, x, rngs={"dropout": key}))
    variables = materialize(shapes)
    a = run(variables, jax.random.key(1))
    b = run(variables, jax.random.key(1))
    c = run(variables, jax.random.key(2))
    assert a.dtype == F32
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert 0.3 < np.mean(np.asarray(a) == 0) < 0.7  # About half dropped.


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


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x, True), None


class ScanLM(nn.Module):
    """Two Blocks through `nn.scan`, parameters stacked on a leading axis."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        blocks = nn.scan(
            ScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=2,
        )
        x, _ = blocks(name="blocks")(x, None)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))


class RematLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        x = nn.remat(Block, static_argnums=(2,))()(x, train)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))


class VmapLM(nn.Module):
    """An ensemble of three Dense through `nn.vmap`, averaged."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        ensemble = nn.vmap(
            nn.Dense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            out_axes=0,
            axis_size=3,
        )
        x = ensemble(FEATURES)(x).mean(0)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))


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


# --------------------------------------------------------------------------
# Half-precision norms are rematerialised: recomputed, not saved, for backward.


class Norms(nn.Module):
    """The three parameter-only Flax norms, each after a Dense."""

    @nn.compact
    def __call__(self, x):
        x = nn.LayerNorm()(nn.Dense(FEATURES)(x))
        x = nn.RMSNorm()(nn.Dense(FEATURES)(x))
        x = nn.GroupNorm(num_groups=4)(nn.Dense(FEATURES)(x))
        return nn.Dense(4)(x)


NORMS_X = np.random.default_rng(3).standard_normal((BATCH, SEQ, FEATURES)).astype(np.float32)


def norms_loss(policy, **kwargs):
    apply = with_policy(Norms().apply, policy, **kwargs)
    return lambda params: jnp.mean(jnp.square(apply({"params": params}, NORMS_X)))


def norms_params():
    shapes = jax.eval_shape(Norms().init, jax.random.key(0), NORMS_X)
    return materialize(shapes["params"], seed=4)


def saved(loss, params) -> list[tuple[Any, str]]:
    return saved_residuals(loss, params)


def checkpoints(loss, params) -> int:
    """The `jax.checkpoint` equations of the forward program (named remat2 or checkpoint)."""
    return len(re.findall(r"= (?:remat2|checkpoint)\[", str(jax.make_jaxpr(loss)(params))))


def from_norms(residuals, dtype) -> list:
    return [a for a, where in residuals if a.dtype == dtype and "normalization.py" in where]


def test_half_norms_save_no_float32_intermediates():
    params = norms_params()
    plain = saved(norms_loss("mixed_bfloat16", remat_norms=False), params)
    remat = saved(norms_loss("mixed_bfloat16"), params)
    # Without remat, each norm saves float32 copies of its [2, 8, 16] input.
    assert len([a for a in from_norms(plain, F32) if a.shape == NORMS_X.shape]) >= 3
    assert from_norms(remat, F32) == []
    nbytes = lambda res: sum(a.size * a.dtype.itemsize for a, _ in res)
    assert nbytes(remat) < nbytes(plain)
    assert checkpoints(norms_loss("mixed_bfloat16"), params) == 3


def test_rematerialised_norms_give_the_same_values_and_grads():
    params = norms_params()
    value_and_grad = lambda loss: jax.value_and_grad(loss)(params)
    remat, plain = jax.jit(
        lambda: (
            value_and_grad(norms_loss("mixed_bfloat16")),
            value_and_grad(norms_loss("mixed_bfloat16", remat_norms=False)),
        )
    )()
    for a, b in zip(jax.tree.leaves(remat), jax.tree.leaves(plain)):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


class DeepNorms(nn.Module):
    """Four LayerNorms of one shape, one with another epsilon, between Dense layers."""

    @nn.compact
    def __call__(self, x):
        for i in range(4):
            x = nn.LayerNorm(epsilon=1e-3 if i == 2 else 1e-6)(nn.Dense(FEATURES)(x))
        return nn.Dense(4)(x)


def test_norms_of_one_program_share_one_rematerialised_trace():
    params = materialize(jax.eval_shape(DeepNorms().init, jax.random.key(0), NORMS_X)["params"])

    def loss(remat_norms):
        apply = with_policy(DeepNorms().apply, "mixed_bfloat16", remat_norms=remat_norms)
        return lambda p: jnp.mean(jnp.square(apply({"params": p}, NORMS_X)))

    eqns = jax.make_jaxpr(loss(True))(params).eqns
    bodies = [e.params["jaxpr"] for e in eqns if e.primitive.name in ("remat2", "checkpoint")]
    # Each norm is its own checkpoint, with its own parameters; the three with
    # the same epsilon run one program, the fourth its own.
    assert len(bodies) == 4
    assert len({id(b) for b in bodies}) == 2
    assert bodies[0] is bodies[1] is bodies[3]
    # Compiled apart, the same bits. (In one jit, XLA 0.12 merges and fuses
    # the two programs' common work, so they differ in bf16 rounding.)
    shared, plain = (jax.jit(jax.value_and_grad(loss(r)))(params) for r in (True, False))
    for a, b in zip(jax.tree.leaves(shared), jax.tree.leaves(plain)):
        np.testing.assert_array_equal(a, b)
    # Every norm's parameters get their own gradient.
    grads = shared[1]
    scales = [grads[f"LayerNorm_{i}"]["scale"] for i in range(4)]
    assert all(not np.allclose(scales[i], scales[j]) for i in range(4) for j in range(i))


def _scaled_tangent(scale):
    """The identity, whose derivative is `scale`: a rule the printed program does not show."""

    @jax.custom_jvp
    def f(x):
        return x

    f.defjvp(lambda primals, tangents: (primals[0], tangents[0] * scale))
    return f


def _scaled_by_callback(scale):
    """Times `scale`, through a host callback: its function prints like any other."""
    return lambda y: jax.pure_callback(
        lambda v: (v * scale).astype(v.dtype), jax.ShapeDtypeStruct(y.shape, y.dtype), y
    )


class NormsUnderRules(nn.Module):
    """Two LayerNorms whose outputs an inner interceptor passes through a
    different function each, made by `wrap(a number)`."""

    wrap: Any

    @nn.compact
    def __call__(self, x):
        def rule(next_fun, args, kwargs, context):
            return self.wrap(float(len(context.module.name)))(next_fun(*args, **kwargs))

        with nn.intercept_methods(rule):
            a = nn.LayerNorm(name="n")(x)
            b = nn.LayerNorm(name="norm")(x)
        return jnp.sum(a) + jnp.sum(b * b)


@pytest.mark.parametrize(
    ("wrap", "transform"),
    [(_scaled_tangent, jax.value_and_grad), (_scaled_by_callback, lambda f: f)],
    ids=["jvp-rule", "callback"],  # A callback has no derivative: values only.
)
def test_norms_whose_programs_print_alike_keep_their_own(wrap, transform):
    model = NormsUnderRules(wrap)
    params = materialize(jax.eval_shape(model.init, jax.random.key(0), NORMS_X)["params"])
    results = [
        jax.jit(transform(lambda p: with_policy(
            model.apply, "mixed_bfloat16", remat_norms=r)({"params": p}, NORMS_X)))(params)
        for r in (True, False)
    ]  # fmt: skip
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(results[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


class TaggedNorms(nn.Module):
    @nn.compact
    def __call__(self, x):
        from jax.experimental.xla_metadata import set_xla_metadata

        with set_xla_metadata(tagged="yes"):
            a = nn.LayerNorm(name="tagged")(x)
        return a, nn.LayerNorm(name="plain")(x)


def test_norms_in_another_context_keep_it():
    # An equation's context (XLA metadata, compute_on) is not in its text.
    params = TaggedNorms().init(jax.random.key(0), NORMS_X)
    for remat in (True, False):
        apply = with_policy(TaggedNorms().apply, "mixed_bfloat16", remat_norms=remat)
        lines = jax.jit(apply).lower(params, NORMS_X).as_text().splitlines()
        rsqrt = [line for line in lines if "stablehlo.rsqrt" in line]
        assert len(rsqrt) == 2 and sum('tagged = "yes"' in line for line in rsqrt) == 1, remat


def test_norms_with_parameters_as_literals_keep_their_own(monkeypatch):
    # Under jax_use_simplified_jaxpr_constants, concrete parameters (closed
    # over by a jit) are array literals of the program, printed without
    # their values: same-shaped norms must not share them.
    model = DeepNorms()
    params = jax.tree.map(np.asarray, model.init(jax.random.key(0), NORMS_X))["params"]
    params["LayerNorm_1"] = jax.tree.map(lambda v: v * 3 + 1, params["LayerNorm_1"])
    flag = "jax_use_simplified_jaxpr_constants"
    saved = getattr(jax.config, flag)
    jax.config.update(flag, True)
    try:
        outs = [
            jax.jit(lambda x: with_policy(model.apply, "mixed_bfloat16", remat_norms=r)(
                {"params": params}, x))(NORMS_X)
            for r in (True, False)
        ]  # fmt: skip
    finally:
        jax.config.update(flag, saved)
    np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    ("policy", "kwargs"),
    [
        ("f32", {}),  # float32 norms: the program is the user's own
        ("mixed_bfloat16", {"remat_norms": False}),
        (
            "mixed_bfloat16",
            {"rules": {nn.LayerNorm: "f32", nn.RMSNorm: "f32", nn.GroupNorm: "f32"}},
        ),
    ],
    ids=["float32", "off", "float32-rule"],
)
def test_norms_not_rematerialised(policy, kwargs):
    assert checkpoints(norms_loss(policy, **kwargs), norms_params()) == 0


def test_rematerialised_norms_inside_scan_and_remat():
    # LayerNorm, LayerNorm in the scanned Block, the final LayerNorm.
    for model, expected in ((ScanLM(), 3), (RematLM(), 3)):
        tokens = _tokens()
        init = with_policy(model.init, "mixed_bfloat16")
        params = materialize(jax.eval_shape(init, jax.random.key(0), tokens)["params"])
        apply = with_policy(model.apply, "mixed_bfloat16")
        loss = lambda p: apply({"params": p}, tokens, rngs={"dropout": jax.random.key(1)}).sum()
        assert checkpoints(loss, params) >= expected
        grads = jax.jit(jax.grad(loss))(params)
        assert _dtypes(grads) == {F32}
        assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))


def test_user_interceptors_see_each_norm_once():
    # The norm runs once, through the whole interceptor chain, under remat.
    seen = []

    def log_and_shift(next_fun, args, kwargs, context):
        seen.append((type(context.module).__name__, context.module.path))
        out = next_fun(*args, **kwargs)
        return out + 1 if isinstance(context.module, nn.LayerNorm) else out

    params = norms_params()
    apply = with_policy(Norms().apply, "mixed_bfloat16")
    with nn.intercept_methods(log_and_shift):
        shifted = jax.jit(lambda p: apply({"params": p}, NORMS_X))(params)
    assert [name for name, _ in seen].count("LayerNorm") == 1
    assert ("LayerNorm", ("LayerNorm_0",)) in seen
    plain = jax.jit(lambda p: apply({"params": p}, NORMS_X))(params)
    assert not np.allclose(shifted, plain)


def test_apply_that_creates_parameters_is_not_rematerialised():
    # Flax cannot create variables inside a JAX transform: an apply with
    # mutable params (as init) runs the norms as they are.
    apply = with_policy(Norms().apply, "mixed_bfloat16")
    rngs = {"params": jax.random.key(0)}
    _, created = jax.eval_shape(lambda: apply({}, NORMS_X, rngs=rngs, mutable=True))
    assert set(created["params"]) == set(norms_params())
    # A tree that gains a norm: the existing ones are read, the new one created.
    existing = {k: v for k, v in norms_params().items() if k != "GroupNorm_0"}
    _, grown = apply({"params": existing}, NORMS_X, rngs=rngs, mutable=["params"])
    assert _dtypes(grown["params"]["GroupNorm_0"]) == {F32}


def test_remat_norms_must_be_a_bool():
    with pytest.raises(TypeError, match="remat_norms must be True or False"):
        with_policy(Norms().apply, "mixed_bfloat16", remat_norms="yes")


# --------------------------------------------------------------------------
# The jit cache: linen interceptors are not part of jax.jit's cache key.


@pytest.mark.parametrize("order", ["ABAB", "BABA"])
def test_jitted_wrapped_and_unwrapped_apply_keep_their_own_dtypes(order):
    model = nn.Sequential([nn.Dense(8), nn.LayerNorm(), nn.Dense(4)])  # Fresh per order.
    x = jnp.ones((2, 3))
    variables = materialize(jax.eval_shape(model.init, jax.random.key(0), x))
    calls = {
        "A": jax.jit(with_policy(model.apply, "p=f32,c=bf16")),  # Output bf16.
        "B": jax.jit(model.apply),
    }
    expected = {"A": BF16, "B": F32}
    for name in order:
        assert calls[name](variables, x).dtype == expected[name], f"{name} in {order}"


def test_two_policies_of_one_apply_keep_their_own_dtypes():
    model = nn.Dense(4)
    x = jnp.ones((2, 3))
    variables = materialize(jax.eval_shape(model.init, jax.random.key(0), x))
    bf16 = jax.jit(with_policy(model.apply, "p=f32,c=bf16"))
    f16 = jax.jit(with_policy(model.apply, "p=f32,c=f16"))
    assert [f(variables, x).dtype for f in (bf16, f16, bf16, f16)] == [BF16, F16, BF16, F16]


@pytest.mark.parametrize("fn", [lambda x: x, nn.Dense(4).apply], ids=["function", "apply"])
def test_jitted_function_is_refused(fn):
    with pytest.raises(TypeError, match=r"jit the result instead: jax.jit\(with_policy"):
        with_policy(jax.jit(fn), "mixed_bfloat16")


# --------------------------------------------------------------------------
# Plain functions.


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_plain_function_casts_floats_only(jit):
    seen = {}

    def f(x, n, key, flag, scale, *, y):
        seen.update(x=x.dtype, n=n.dtype, key=key.dtype, y=y.dtype, flag=flag, scale=scale)
        return {"sum": x * scale + y, "n": n + 1, "key": key}

    wrapped = with_policy(f, "mixed_bfloat16")
    if jit:
        wrapped = jax.jit(wrapped, static_argnums=(3, 4))
    key = jax.random.key(0)
    out = wrapped(jnp.ones(3), jnp.arange(3), key, True, 2.0, y=jnp.ones(3, F16))
    assert seen["x"] == seen["y"] == BF16
    assert seen["n"] == np.dtype(np.int32)
    assert seen["key"] == key.dtype
    assert seen["flag"] is True and type(seen["scale"]) is float
    assert out["sum"].dtype == F32
    np.testing.assert_array_equal(out["sum"], np.full(3, 3.0))
    assert out["n"].dtype == np.dtype(np.int32)
    assert out["key"].dtype == key.dtype


# --------------------------------------------------------------------------
# The user's module attributes.


class Failing(nn.Module):
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x):
        raise ValueError("boom")


class Parent(nn.Module):
    dtype: Any = None

    def setup(self):
        self.child = nn.Dense(4, dtype=jnp.float32)  # The user asked for float32.
        self.failing = Failing()

    def __call__(self, x):
        SEEN["parent"] = self.dtype
        y = self.child(x)
        SEEN["child after its call"] = self.child.dtype
        try:
            self.failing(x)
        except ValueError:
            SEEN["failing after its error"] = self.failing.dtype
        return y


def test_module_attributes_are_overridden_inside_and_restored_after():
    model = Parent()
    x = jnp.ones((2, 3))
    variables = jax.eval_shape(with_policy(model.init, "mixed_bfloat16"), jax.random.key(0), x)
    SEEN.clear()
    apply = jax.jit(with_policy(model.apply, "mixed_bfloat16"))
    found = contractions(apply.lower(variables, x).as_text())
    # The explicit float32 Dense computes in bf16 inside the call...
    assert compute_dtypes(found) == [BF16]
    assert SEEN["parent"] == BF16
    # ...and has the user's dtype back afterwards, also after an error.
    assert SEEN["child after its call"] == jnp.float32
    assert SEEN["failing after its error"] == jnp.float32
    assert model.dtype is None
    # Without the policy the same module computes in float32.
    assert compute_dtypes(contractions(jax.jit(model.apply).lower(variables, x).as_text())) == [F32]


def test_policy_is_restored_after_an_error():
    model = nn.Dense(4)
    x = jnp.ones((2, 3))
    variables = jax.eval_shape(model.init, jax.random.key(0), x)
    with pytest.raises(Exception):
        jax.eval_shape(with_policy(model.apply, "bf16"), variables, jnp.ones((2, 5)))
    # A later unwrapped call is untouched by the failed wrapped one.
    assert jax.eval_shape(model.apply, variables, x).dtype == F32


# --------------------------------------------------------------------------
# Numerics: a few hundred steps of training, float32 against mixed_bfloat16.


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.LayerNorm()(nn.Dense(64)(x)))
        x = nn.gelu(nn.Dense(64)(x))
        return nn.Dense(10)(x)


STEPS = 300


def train_mlp(policy):
    """Trains MLP on labels of a random linear teacher; returns params, grads, losses."""
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((STEPS, 64, 16)).astype(np.float32)
    labels = np.argmax(xs @ rng.standard_normal((16, 10)), -1).astype(np.int32)
    model = MLP()
    shapes = jax.eval_shape(with_policy(model.init, policy), jax.random.key(0), xs[0])
    params = materialize(shapes["params"], seed=1)
    apply = with_policy(model.apply, policy)

    def step(carry, batch):
        params, opt_state, _ = carry
        x, y = batch

        def loss_fn(p):
            logits = apply({"params": p}, x)
            return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = TX.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state, grads), loss

    @jax.jit
    def run(params, xs, labels):
        carry = (params, TX.init(params), params)
        (params, _, grads), losses = jax.lax.scan(step, carry, (xs, labels))
        return params, grads, losses

    return run(params, xs, labels)


@pytest.fixture(scope="module")
def trained():
    return {policy: train_mlp(policy) for policy in ("f32", "mixed_bfloat16")}


def test_mixed_bfloat16_training_matches_float32(trained):
    _, _, full = trained["f32"]
    _, _, mixed = trained["mixed_bfloat16"]
    full, mixed = np.asarray(full), np.asarray(mixed)
    # Both learn: the mean loss of the last 20 steps is a fraction of the first.
    assert full[-20:].mean() < 0.25 * full[:20].mean()
    # bf16 has 8 bits of mantissa: the loss after 300 steps is within 0.03
    # (about a tenth of its value) of float32's.
    assert abs(mixed[-20:].mean() - full[-20:].mean()) < 0.03
    # And the policy did something: the two runs are not the same computation.
    assert not np.array_equal(full, mixed)


def test_training_keeps_params_and_grads_in_param_dtype(trained):
    params, grads, losses = trained["mixed_bfloat16"]
    assert _dtypes(params) == _dtypes(grads) == {F32}
    assert losses.dtype == F32
    assert np.all(np.isfinite(losses))


# --------------------------------------------------------------------------
# Issue 10: the architectures people write. One section per finding, each
# with the reproduction.

# 1. Recurrent cells under nn.RNN: the carry keeps the dtype the model gives it.


class BiRNN(nn.Module):
    @nn.compact
    def __call__(self, x):
        rnn = nn.Bidirectional(nn.RNN(nn.LSTMCell(8)), nn.RNN(nn.GRUCell(8)))
        return nn.Dense(2)(rnn(x))


def _seq(seed=0, shape=(2, 5, 3)):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


@pytest.mark.parametrize(
    "model",
    [nn.RNN(nn.LSTMCell(8), return_carry=True), nn.RNN(nn.GRUCell(8), return_carry=True),
     nn.RNN(nn.OptimizedLSTMCell(8), return_carry=True), BiRNN()],
    ids=["LSTMCell", "GRUCell", "OptimizedLSTMCell", "bidirectional"],
)  # fmt: skip
def test_rnn_cells_keep_their_float32_carry_and_multiply_in_half(model):
    # Was: TypeError: scan body function carry input and carry output must have
    # equal types ... float32[2,8] ... bfloat16[2,8].
    x = _seq()
    variables = with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    apply = with_policy(model.apply, "mixed_bfloat16")
    out, expected = apply(variables, x), model.apply(variables, x)
    if isinstance(model, nn.RNN):
        (carry, out), (expected_carry, expected) = out, expected
        assert _dtypes(carry) == {F32}  # As `initialize_carry` made it.
        np.testing.assert_allclose(
            np.concatenate([np.ravel(c) for c in jax.tree.leaves(carry)]),
            np.concatenate([np.ravel(c) for c in jax.tree.leaves(expected_carry)]),
            atol=3e-2,
        )
    assert out.dtype == F32 and _dtypes(variables) == {F32}
    np.testing.assert_allclose(out, expected, atol=3e-2)
    found = contractions(jax.jit(apply).lower(variables, x).as_text())
    assert found and compute_dtypes(found) == [BF16] * len(found)


# 2. nn.scan'd blocks whose carry meets float32 (a LayerScale parameter, a
# float32 rule), and nn.while_loop.


class LayerScaleBlock(nn.Module):
    """ConvNeXt/CaiT style: `x + gamma * Dense(LN(x))`, `gamma` a float32 parameter."""

    @nn.compact
    def __call__(self, x, _):
        gamma = self.param("gamma", nn.initializers.constant(0.1), (x.shape[-1],))
        h = nn.Dense(x.shape[-1], name="proj")(nn.LayerNorm()(x))
        return x + gamma * h, None


class ScanStack(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(FEATURES)(x)
        blocks = nn.scan(
            nn.remat(LayerScaleBlock),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=3,
        )
        x, _ = blocks(name="blocks")(x, None)
        return nn.Dense(2)(x)


@pytest.mark.parametrize(
    ("rules", "float32_dots"),
    # proj under nn.remat: forward, its recomputation and two in the backward scan.
    [(None, 0), ({"blocks/proj": "f32"}, 4)],
    ids=["layerscale", "float32-rule-in-scan"],
)
def test_scanned_blocks_mixing_float32_into_the_carry(rules, float32_dots):
    # Was: TypeError: scan body function carry input and carry output must have
    # equal types. The model computes `gamma * h` in float32 (standard
    # promotion, as users run it); the carry stays in the dtype it entered.
    model, x = ScanStack(), _seq(1, (2, 4, 5))
    with jax.numpy_dtype_promotion("standard"):
        variables = with_policy(model.init, "mixed_bfloat16", rules=rules)(jax.random.key(0), x)
        apply = with_policy(model.apply, "mixed_bfloat16", rules=rules)
        out, expected = apply(variables, x), model.apply(variables, x)
        grad = jax.grad(lambda v: apply(v, x).sum())
        grads = jax.eval_shape(grad, variables)
        text = jax.jit(grad).lower(variables).as_text()
    assert out.dtype == F32 and _dtypes(variables) == _dtypes(grads) == {F32}
    np.testing.assert_allclose(out, expected, atol=5e-2)
    dtypes = compute_dtypes(contractions(text))
    assert dtypes.count(F32) == float32_dots and dtypes.count(BF16) == len(dtypes) - float32_dots


class Loop(nn.Module):
    """`nn.while_loop` with a float32 carry created inside the model."""

    @nn.compact
    def __call__(self, x):
        dense = nn.Dense(x.shape[-1])
        h = dense(x)
        carry = (
            jnp.zeros(x.shape, jnp.float32) + jnp.ones((), jnp.float32),
            jnp.zeros((), jnp.int32),
        )
        if self.is_initializing():
            return h
        body = lambda m, c: (jnp.tanh(m(c[0])), c[1] + 1)
        h, _ = nn.while_loop(lambda m, c: c[1] < 3, body, dense, carry)
        return h


class FnScan(nn.Module):
    """`nn.scan` of a function over the module itself, as Flax documents it."""

    @nn.compact
    def __call__(self, x, xs):
        dense = nn.Dense(x.shape[-1], name="dense")
        if self.is_initializing():
            dense(x)

        def body(module, c, xt):
            h = jnp.tanh(dense(c + xt))
            return h, h

        scan = nn.scan(body, variable_broadcast="params", split_rngs={"params": False})
        return scan(self, x, xs)


class WhileSelf(nn.Module):
    """`nn.while_loop` over the module itself, its layer read off it in the body."""

    def setup(self):
        self.dense = nn.Dense(4)

    def __call__(self, x):
        self.dense(x)
        body = lambda m, c: (jnp.tanh(m.dense(c[0])), c[1] + 1)  # noqa: E731
        return nn.while_loop(lambda m, c: c[1] < 3, body, self, (x, 0))[0]


@pytest.mark.parametrize("model", [FnScan(), WhileSelf()], ids=["nn.scan(fn)", "nn.while_loop"])
def test_loops_written_as_functions_keep_their_carry(model):
    # The policy's dtype fields would make the body's carry bfloat16 (the
    # model's own bf16 config fails here the same way): the call runs again
    # with every module's fields as written, the engine keeping the carry
    # and taking every product to bfloat16.
    x, xs = _seq(3, (2, 4)), _seq(4, (3, 2, 4))
    args = (x, xs) if isinstance(model, FnScan) else (x,)
    with pytest.warns(RuntimeWarning, match="carry input and carry output"):
        variables = with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), *args)
    apply = with_policy(model.apply, "mixed_bfloat16")
    with pytest.warns(RuntimeWarning, match="runs with them as written"):
        out = apply(variables, *args)
        text = jax.jit(apply).lower(variables, *args).as_text()
    assert _dtypes(variables) == {F32}
    assert jax.tree.leaves(out)[0].dtype == F32
    np.testing.assert_allclose(
        jax.tree.leaves(out)[0], jax.tree.leaves(model.apply(variables, *args))[0], atol=3e-2
    )
    assert set(compute_dtypes(contractions(text))) == {BF16}


def test_while_loop_carry_keeps_its_dtype():
    model, x = Loop(), _seq(2, (2, 4))
    variables = model.init(jax.random.key(0), x)
    out = with_policy(model.apply, "mixed_bfloat16")(variables, x)
    np.testing.assert_allclose(out, model.apply(variables, x), atol=3e-2)


# 4. Which inputs are cast: a diffusion denoiser's timesteps.

TIMESTEPS = np.array([999, 998, 997, 513, 3], np.float32)


class SinusoidalEmbedding(nn.Module):
    """Plain `jnp`: no `dtype` attribute, so it computes on what it is given."""

    dim: int = 64

    @nn.compact
    def __call__(self, t):
        # The values it is called with (the call is traced: read them back by callback).
        jax.debug.callback(lambda v: SEEN.update(timesteps=v), t)
        half = self.dim // 2
        freqs = jnp.exp(-np.log(10000.0) * jnp.arange(half, dtype=jnp.float32) / half)
        angles = t[:, None] * freqs.astype(t.dtype)[None]
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Denoiser(nn.Module):
    """A plain module (no `dtype` attribute) holding the layers, as people write it."""

    layer_dtype: Any = None  # Only the hand-written bfloat16 version sets it.

    @nn.compact
    def __call__(self, x, t):
        dense = lambda n: nn.Dense(n, dtype=self.layer_dtype)
        emb = dense(64)(nn.gelu(dense(64)(SinusoidalEmbedding()(t))))
        h = nn.gelu(dense(64)(x) + emb)
        return dense(x.shape[-1])(nn.gelu(dense(64)(h)))


class DenoiserLayer(Denoiser):
    """The same model, but a layer: it has a `dtype` attribute of its own."""

    dtype: Any = None


def _denoiser_errors():
    model, x = Denoiser(), _seq(3, (5, 8))
    variables = model.init(jax.random.key(0), x, TIMESTEPS)
    expected = model.apply(variables, x, TIMESTEPS)

    def error(apply, **kwargs):
        SEEN.clear()
        out = apply(variables, x, TIMESTEPS, **kwargs)
        return float(jnp.max(jnp.abs(out.astype(F32) - expected))), np.asarray(SEEN["timesteps"])

    return {
        "hand-written": error(Denoiser(layer_dtype=jnp.bfloat16).apply),
        "with_policy": error(with_policy(model.apply, "mixed_bfloat16")),
        "root rule": error(with_policy(model.apply, "mixed_bfloat16", rules={Denoiser: "f32"})),
        "layer root": error(with_policy(DenoiserLayer().apply, "mixed_bfloat16")),
        "layer root, keep_inputs": error(
            with_policy(DenoiserLayer().apply, "mixed_bfloat16", keep_inputs="t")
        ),
    }


def test_plain_jnp_module_gets_the_timesteps_as_given():
    # Was: the timesteps became [1000, 1000, 996, 512, 3] and the output erred
    # by 0.84 against float32, where the hand-written bfloat16 model errs by 0.010.
    errors = _denoiser_errors()
    # Issue 19, point 1: a root that is a layer (a `dtype` field, as almost
    # every Flax model has) had its inputs cast: [1000, 1000, 996, 512, 3] and
    # 5x the hand-written model's error. Now no module boundary casts.
    for name in errors:
        np.testing.assert_array_equal(errors[name][1], TIMESTEPS, err_msg=name)
        assert errors[name][1].dtype == F32, name
    hand_written = errors["hand-written"][0]
    for name in ("with_policy", "layer root", "layer root, keep_inputs"):
        assert 0 < errors[name][0] <= 1.5 * hand_written, (name, errors)
    assert errors["root rule"][0] < 1e-6  # The whole model in float32, inputs included.


def test_keep_inputs_names_must_be_arguments_of_the_model():
    model, x = Denoiser(), _seq(3, (5, 8))
    variables = jax.eval_shape(model.init, jax.random.key(0), x, TIMESTEPS)
    apply = with_policy(model.apply, "mixed_bfloat16", keep_inputs=("timesteps",))
    with pytest.raises(ValueError, match=r"keep_inputs names 'timesteps'.*\['x', 't'\]"):
        jax.eval_shape(apply, variables, x, TIMESTEPS)
    with pytest.raises(TypeError, match=r"keep_inputs must be an argument name"):
        with_policy(model.apply, "mixed_bfloat16", keep_inputs=[1])


# 5. A functools.partial of apply (or a lambda around it) keeps the variables'
# dtypes: BatchNorm's running statistics stay float32.


class Normed(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(2)(nn.BatchNorm(use_running_average=False, momentum=0.999)(x))


@pytest.mark.parametrize("form", ["partial", "lambda"])
def test_partial_or_lambda_around_apply_keeps_batch_stats_float32(form):
    # Was: batch_stats cast to bfloat16, the running mean stalled at -2.00 where
    # float32 reaches -4.70 (momentum 0.999: the increments are below bf16's step).
    model = Normed()
    x = jnp.full((4, 3), -5.0) + jnp.asarray(np.random.default_rng(0).standard_normal((4, 3)), F32)
    variables = model.init(jax.random.key(0), x)
    variables = {**variables, "batch_stats": {"BatchNorm_0": {
        "mean": jnp.full((3,), -2.0), "var": variables["batch_stats"]["BatchNorm_0"]["var"]}}}  # fmt: skip
    if form == "partial":
        apply = with_policy(
            functools.partial(model.apply, mutable=["batch_stats"]), "mixed_bfloat16"
        )
    else:
        apply = with_policy(
            lambda v, x: model.apply(v, x, mutable=["batch_stats"]), "mixed_bfloat16"
        )
    reference = functools.partial(model.apply, mutable=["batch_stats"])

    def run(apply_fn):
        def step(v, _):
            return {**v, **apply_fn(v, x)[1]}, None

        return jax.jit(lambda v: jax.lax.scan(step, v, length=200)[0])(variables)

    mean, expected = run(apply), run(reference)
    mean, expected = (v["batch_stats"]["BatchNorm_0"]["mean"] for v in (mean, expected))
    assert mean.dtype == F32
    np.testing.assert_allclose(mean, expected, rtol=1e-3)
    assert float(jnp.max(mean)) < -2.3  # It moved (in bfloat16 it stalls at -2.0).


# 6. Complex-valued layers stay complex.


class ComplexNet(nn.Module):
    @nn.compact
    def __call__(self, x):
        z = nn.Dense(4, dtype=jnp.complex64, param_dtype=jnp.complex64, name="complex")(x)
        return nn.Dense(2)(jnp.abs(z))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_complex_layers_keep_complex_dtypes(policy):
    # Was: the imaginary part dropped (a ComplexWarning only), real parameters from init.
    model = ComplexNet()
    x = jax.lax.complex(_seq(4, (3, 5)), _seq(5, (3, 5)))
    variables = with_policy(model.init, policy)(jax.random.key(0), x)
    assert variables["params"]["complex"]["kernel"].dtype == jnp.complex64
    assert variables["params"]["Dense_0"]["kernel"].dtype == F32
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's ComplexWarning would be an error.
        out = with_policy(model.apply, policy)(variables, x)
    np.testing.assert_allclose(out, model.apply(variables, x), atol=3e-2)


# 7. An NNX module given to the linen `with_policy`.


def test_linen_with_policy_refuses_nnx_modules():
    from flax import nnx

    layer = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
    for fn in (layer, layer.__call__):
        with pytest.raises(TypeError, match=r"jmp_policy\.nnx\.with_policy.*PolicyModule"):
            with_policy(fn, "mixed_bfloat16")
    with pytest.raises(TypeError, match=r"jmp_policy\.nnx\.with_policy"):
        with_policy(lambda m, x: m(x), "mixed_bfloat16")(layer, jnp.ones((1, 3)))


# 8. A custom parameter's dtype does not depend on rules for other modules.


class Tempered(nn.Module):
    @nn.compact
    def __call__(self, x):
        temperature = self.param("temperature", nn.initializers.ones, ())
        h = nn.Dense(8)(x)
        h = h / temperature.astype(h.dtype)
        return nn.Dense(2, name="head")(h)


@pytest.mark.parametrize(
    "rules", [None, {"head": "p=f32,c=f32,o=f32"}], ids=["no-rules", "head-rule"]
)
def test_custom_param_takes_its_module_param_dtype_whatever_other_rules_say(rules):
    # Was: float32 as soon as one rule had another param dtype.
    variables = jax.eval_shape(
        with_policy(Tempered().init, "p=bf16,c=bf16,o=f32", rules=rules),
        jax.random.key(0),
        jnp.ones((2, 3)),
    )
    params = variables["params"]
    assert params["temperature"].dtype == BF16
    assert params["Dense_0"]["kernel"].dtype == BF16
    assert params["head"]["kernel"].dtype == (BF16 if rules is None else F32)


def test_a_module_defining_getattr_runs_under_every_policy_and_rule():
    # Google DeepMind's gemma forwards unknown attributes to its config with
    # `__getattr__`, which Flax's interceptors wrap like any method.
    @flax.struct.dataclass
    class Config:
        width: int = 4

    class Block(nn.Module):
        config: Config

        def __getattr__(self, name):
            return getattr(self.config, name)

        @nn.compact
        def __call__(self, x):
            return nn.Dense(self.width)(x)

    class Net(nn.Module):
        config: Config

        def __getattr__(self, name):
            return getattr(self.config, name)

        def setup(self):
            self.block = Block(self.config)

        def __call__(self, x):
            return self.block(x).astype(x.dtype) @ jnp.ones((self.width, 2))

    model, x = Net(Config()), jnp.ones((2, 3))
    variables = with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    for policy, rules, want in [
        # The model's own `@` widens the block's half output back to float32
        # (`.astype(x.dtype)`): the author's float32, as its own half config
        # computes it; the block's product takes the policy. With the block
        # kept in float32 there is no widening, and `@` takes the policy.
        ("mixed_bfloat16", None, [("bf16", "bf16"), ("f32", "f32")]),
        ("p=f32,c=bf16,o=f32,m=bf16", None, [("bf16", "bf16"), ("f32", "f32")]),
        ("p=f32,c=bf16,o=f32,m=bf16", {"block": "f32"}, [("f32", "f32"), ("bf16", "bf16")]),
    ]:
        apply = with_policy(model.apply, policy, rules=rules)
        assert apply(variables, x).dtype == F32
        dots = contractions(jax.jit(apply).lower(variables, x).as_text())
        assert [d.operand_types for d in dots] == want, (policy, rules)


class _Jitted(nn.Module):
    """gemma's pattern: `__call__` under `nn.jit`, with a jitted layer used twice."""

    @nn.jit
    @nn.compact
    def __call__(self, x):
        x = _JittedLayer(name="layer_0")(x)
        x = _JittedLayer(name="layer_1")(x)
        return nn.Dense(2, name="head")(x)


class _JittedLayer(nn.Module):
    @nn.jit
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(x)


def test_nn_jit_methods_take_the_policy_and_its_rules_whatever_was_traced_before():
    model, x = _Jitted(), jnp.ones((2, 4))
    variables = model.init(jax.random.key(0), x)

    def operands(apply):
        return [d.operand_types for d in contractions(jax.jit(apply).lower(variables, x).as_text())]

    f32, bf16 = ("f32", "f32"), ("bf16", "bf16")
    # (Flax's trace of the plain layer serves both layers: one function, two calls.)
    assert set(operands(model.apply)) == {f32}  # nn.jit has traced the plain model.
    assert operands(with_policy(model.apply, "mixed_bfloat16")) == [bf16] * 3
    assert set(operands(model.apply)) == {f32}  # ... and the plain model is still plain.
    # Path rules reach inside nn.jit, also to one of two layers of one jitted class.
    rules = {"head": "f32", "layer_1": "mixed_float16"}
    ruled = with_policy(model.apply, "mixed_bfloat16", rules=rules)
    assert sorted(operands(ruled)) == [bf16, ("f16", "f16"), f32]
    out = ruled(variables, x)  # Eagerly, twice: each call sees its modules.
    np.testing.assert_array_equal(out, ruled(variables, x))
    with pytest.raises(ValueError, match="'nothere' matches no module"):
        with_policy(model.apply, "mixed_bfloat16", rules={"nothere": "f32"})(variables, x)


class _TiedLM(nn.Module):
    """A head applied by hand with the embedding's transpose (Gemma, T5, OPT)."""

    def setup(self):
        self.embed = nn.Embed(10, 8)
        self.block = nn.Dense(8)
        self.lm_head = nn.Dense(10, use_bias=False)

    def __call__(self, ids):
        h = self.block(self.embed(ids))
        return self.lm_head.apply({"params": {"kernel": self.embed.embedding.T}}, h)


def test_path_rules_reach_a_module_applied_by_hand():
    ids = jnp.zeros((2, 3), jnp.int32)
    variables = _TiedLM().init(jax.random.key(0), ids)
    apply = with_policy(_TiedLM().apply, "mixed_bfloat16", rules={"lm_head": "f32"})
    dots = contractions(jax.jit(apply).lower(variables, ids).as_text())
    assert [d.operand_types for d in dots] == [("bf16", "bf16"), ("f32", "f32")]
    plain = with_policy(_TiedLM().apply, "mixed_bfloat16")
    dots = contractions(jax.jit(plain).lower(variables, ids).as_text())
    assert [d.operand_types for d in dots] == [("bf16", "bf16")] * 2


class _ParamEinsum(nn.Module):
    """gemma's `Einsum`: `dtype` is its parameter's dtype; it multiplies it as stored."""

    shape: tuple
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, eqn, x):
        w = self.param("w", nn.initializers.normal(1.0), self.shape, self.dtype)
        return jnp.einsum(eqn, x, w)


class _ParamLM(nn.Module):
    """gemma's pattern: its `Embedder` and `Einsum`s make their parameters in `dtype`."""

    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, ids):
        table = self.param("embedding", nn.initializers.normal(1.0), (16, 8), self.dtype)
        x = table[ids]
        h = _ParamEinsum((8, 16), dtype=self.dtype)("btd,df->btf", x)
        x = x + _ParamEinsum((16, 8), dtype=self.dtype)("btf,fd->btd", jax.nn.gelu(h))
        return jnp.einsum("btd,vd->btv", x, table)


@jax.numpy_dtype_promotion("standard")  # As gemma runs (a float32 rule meets bf16).
def test_a_layer_that_makes_its_parameters_in_dtype_computes_as_its_own_half_config():
    # gemma's layers read `dtype` as their parameters' dtype and compute with
    # them as stored: the policy's parameters are read in the dtype the
    # model makes them in under it, so every product is bf16 as in gemma's
    # own bf16 config, while they are stored (and trained) in float32.
    model, ids = _ParamLM(), jnp.arange(12).reshape(2, 6) % 16
    variables = with_policy(model.init, "mixed_bfloat16")(jax.random.key(1), ids)
    assert _dtypes(variables) == {F32}
    apply = with_policy(model.apply, "mixed_bfloat16")
    dots = contractions(jax.jit(apply).lower(variables, ids).as_text())
    assert [d.operand_types for d in dots] == [("bf16", "bf16")] * 3
    grad = jax.jit(jax.grad(lambda v: apply(v, ids).sum()))
    assert _dtypes(grad(variables)) == {F32}
    # A model never inited through the policy (a checkpoint's parameters; its
    # `dtype` field differs, so nothing recorded by the init above serves it).
    other = _ParamLM(dtype=jnp.float16)
    loaded = model.init(jax.random.key(1), ids)
    again = with_policy(other.apply, "mixed_bfloat16")
    found = contractions(jax.jit(again).lower(loaded, ids).as_text())
    assert [(d.operands, d.results) for d in found] == [(d.operands, d.results) for d in dots]
    want = model.apply(variables, ids)
    hand = jax.tree.map(lambda a: a.astype(jnp.bfloat16), variables)
    hand_err = float(jnp.max(jnp.abs(_ParamLM(dtype=jnp.bfloat16).apply(hand, ids) - want)))
    err = float(jnp.max(jnp.abs(apply(variables, ids) - want)))
    assert apply(variables, ids).dtype == F32 and err <= 1.5 * hand_err, (err, hand_err)
    # A rule keeps a layer's parameters, and so its product, in float32; the
    # tied head it feeds a float32 residual multiplies in its own module's
    # compute dtype (the engine decides, not the operands).
    ruled = with_policy(model.apply, "mixed_bfloat16", rules={"_ParamEinsum_1": "f32"})
    dots = contractions(jax.jit(ruled).lower(variables, ids).as_text())
    assert [d.operand_types for d in dots] == [("bf16", "bf16"), ("f32", "f32"), ("bf16", "bf16")]


def test_a_mapping_with_params_left_uncast_must_be_a_models_variables():
    # The one guess of a plain function's inputs (a mapping with "params" is
    # Flax variables, left in its dtypes) fails loudly where it is wrong.
    model, x = nn.Dense(2), jnp.ones((1, 3), F32)
    variables = model.init(jax.random.key(0), x)
    for fn in (
        lambda v, x: model.apply(v, x),
        lambda v, x: jax.jit(model.apply)(v, x),  # Other arrays, the same variables.
        lambda v, x: model.apply({"params": v["params"]}, x),
    ):
        assert with_policy(fn, "mixed_bfloat16")(variables, x).dtype == F32
    not_variables = with_policy(lambda d, x: x @ d["params"], "mixed_bfloat16")
    with jax.numpy_dtype_promotion("standard"):  # Strict promotion refuses x @ params first.
        with pytest.raises(TypeError, match=r"argument 0 .* for Flax variables .* no linen model"):
            not_variables({"params": jnp.ones((3, 2), F32)}, x)


def test_an_init_that_cannot_run_with_the_calls_arguments_is_said():
    # with_policy reads the dtype each parameter is made in from an abstract
    # init with the call's arguments; where that init fails, it says so
    # (was: the stored dtypes, silently).
    class ScaledByAConstant(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(x) * self.get_variable("consts", "scale")

    model, x = ScaledByAConstant(), jnp.ones((1, 3), F32)
    params = nn.Dense(2).init(jax.random.key(0), x)["params"]
    variables = {"params": {"Dense_0": params}, "consts": {"scale": jnp.float32(2.0)}}
    assert model.apply(variables, x).dtype == F32  # The model itself runs.
    with pytest.raises(TypeError) as info:  # The model's own error, with a note.
        with_policy(model.apply, "mixed_bfloat16")(variables, x)
    assert any("running ScaledByAConstant.init abstractly" in n for n in info.value.__notes__)


class _DrawsInItsDtype(nn.Module):
    """Draws its weight in `dtype` (as gemma does) and takes inputs only in it."""

    dtype: Any = F32

    @nn.compact
    def __call__(self, x):
        if x.dtype != self.dtype:
            raise TypeError(f"expects {self.dtype} inputs, got {x.dtype}")
        return x @ self.param("w", nn.initializers.normal(1.0), (3, 2), self.dtype)


def test_init_runs_the_model_once_where_the_policys_draws_are_its_own():
    runs: list = []
    x = jnp.ones((1, 3), F32)

    class Counted(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool):
            jax.debug.callback(runs.append, 1)
            return nn.Dropout(0.5, deterministic=not train)(nn.Dense(2)(x))

    # A Python flag stays one in the abstract init that reads the draws' dtypes.
    variables = with_policy(Counted().init, "mixed_bfloat16")(jax.random.key(0), x, train=False)
    assert len(runs) == 1  # Was 2: the policy's init, then the plain one.
    own = Counted().init(jax.random.key(0), x, train=False)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), variables, own))


def test_init_draws_as_the_model_does_where_the_policy_would_draw_in_half():
    x = jnp.ones((1, 3), F32)
    own = _DrawsInItsDtype().init(jax.random.key(0), x)["params"]["w"]
    # The policy's model takes bf16 inputs; its own init, given them, refuses:
    # it draws with its floating arguments in float32 (was: the policy's bf16 draws).
    init = with_policy(_DrawsInItsDtype().init, "mixed_bfloat16")
    drawn = init(jax.random.key(0), x.astype(BF16))["params"]["w"]
    assert drawn.dtype == F32 and bool((drawn == own).all())
    half = with_policy(_DrawsInItsDtype().init, "bf16")(jax.random.key(0), x.astype(BF16))
    half = half["params"]["w"]
    assert half.dtype == BF16 and bool((half == own.astype(BF16)).all())


def test_init_draws_as_the_model_does_where_its_author_set_a_half_param_dtype():
    # The policy's float32 draws would be other random values than the bf16 ones.
    model = nn.Dense(4, param_dtype=BF16)
    x = jnp.ones((1, 3), F32)
    with jax.numpy_dtype_promotion("standard"):  # The plain model mixes bf16 and f32.
        own = model.init(jax.random.key(0), x)["params"]["kernel"]
        drawn = with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    drawn = drawn["params"]["kernel"]
    assert drawn.dtype == F32 and bool((drawn == own.astype(F32)).all())


def test_a_typed_prng_key_argument_passes_through():
    # Flax's VAE example takes its sampling key as an argument (`key<fry>`).
    class Samples(nn.Module):
        @nn.compact
        def __call__(self, x, key):
            return nn.Dense(2)(x + jax.random.normal(key, x.shape))

    x, key = jnp.ones((1, 3), F32), jax.random.key(1)
    variables = with_policy(Samples().init, "mixed_bfloat16")(jax.random.key(0), x, key)
    out = jax.jit(with_policy(Samples().apply, "mixed_bfloat16"))(variables, x, key)
    assert out.dtype == F32 and out.shape == (1, 2)


def test_an_init_whose_own_form_cannot_run_is_said():
    class OnlyInHalf(nn.Module):
        dtype: Any = F32

        @nn.compact
        def __call__(self, x):
            if self.dtype != BF16:
                raise ValueError("this model runs only in bfloat16")
            return nn.Dense(2, dtype=self.dtype)(x)

    init = with_policy(OnlyInHalf().init, "mixed_bfloat16")
    with pytest.raises(ValueError, match="only in bfloat16") as info:  # Was: the policy's draws.
        init(jax.random.key(0), jnp.ones((1, 3), F32))
    assert any("model's own init" in note for note in info.value.__notes__)
