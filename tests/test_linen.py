"""Tests of `jmp_policy.with_policy` on real Flax linen models: the
contractions (`dot_general`, convolution) of whole lowered train steps, the
dtypes of parameters, gradients, outputs and `batch_stats`, the linen entry
points (`init`, `init_with_output`, `method=`, `rngs`, `mutable`), the jit
cache, plain functions, the user's module attributes, and training numerics.
Rules and lifted transforms: `test_linen_rules.py`; norms:
`test_linen_norms.py`; the architectures people write:
`test_linen_architectures.py`; the models they share: `linen_models.py`.

Everything runs under strict dtype promotion (see `conftest.py`), so a silent
float32 upcast inside a model is an error rather than a slow matmul. Dtype
checks use `jax.eval_shape` and `.lower()` where they can: nothing is compiled
that a shape or a program text can answer.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from linen_models import (
    BF16,
    F16,
    F32,
    FEATURES,
    HEAD_DOTS,
    LM,
    LM_DOTS,
    SEEN,
    TX,
    VOCAB,
    AutoEncoder,
    Head,
    _dtypes,
    _tokens,
    compute_dtypes,
    lowered_train_step,
    make_train_step,
    materialize,
)

from jmp_policy import Policy, with_policy

from helpers import contractions

# --------------------------------------------------------------------------
# Every contraction of a whole train step, forward and backward.


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
