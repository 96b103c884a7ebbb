"""`with_policy` on the linen architectures people write (issue 10 and after):
one section per finding, each with its reproduction.
Strict dtype promotion, as in `test_linen.py`.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from linen_models import (
    BF16,
    F32,
    FEATURES,
    SEEN,
    _dtypes,
    compute_dtypes,
)

from jmp_policy import with_policy

from helpers import contractions

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


def test_apply_reads_the_dtypes_its_policys_init_recorded():
    # The dtypes `with_policy(model.init)` made the parameters in serve the
    # `apply`s under the same policy: no abstract `init` runs again for them.
    traces: list = []

    class Traced(nn.Module):
        @nn.compact
        def __call__(self, x):
            traces.append(1)  # Python: once per trace.
            return nn.Dense(2)(x)

    model, x = Traced(), jnp.ones((1, 3), F32)  # Records live as long as the model.
    variables = with_policy(model.init, "mixed_bfloat16")(jax.random.key(0), x)
    traces.clear()
    assert with_policy(model.apply, "mixed_bfloat16")(variables, x).dtype == F32
    assert len(traces) == 1  # Was 2: an abstract init, then the call.
    with_policy(model.apply, "bf16")(variables, x)  # Another policy: its own init.
    assert len(traces) == 3
