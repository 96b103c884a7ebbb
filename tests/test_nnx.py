"""Tests of `jmp_policy.nnx`: policies over Flax NNX modules.

Grouped like the module: the dtypes in the lowered program of a whole
`nnx.jit` train step (forward, backward and `nnx.Optimizer.update`), the dtypes
of parameters, gradients, outputs and batch statistics after training, rules
(classes, paths, precedence, inheritance, the norm default) and their errors,
training in float16 with dynamic loss scaling, the loss scale of an
`nnx.Optimizer`, copies and the jit cache.
"""

from __future__ import annotations

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx as jnnx

from helpers import contractions, hlo_ops

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

VOCAB, DIM, HEADS, SEQ, BATCH = 32, 16, 2, 8, 4


class Head(nnx.Linear):
    """The logits layer: a subclass, so class rules can name it alone."""


class Net(nnx.Module):
    """A small Transformer-like block with every layer kind the policy must handle.

    Attention has dropout, so Flax takes its einsum path: `jax.nn.
    dot_product_attention` (its path without dropout) rejects half inputs
    under strict dtype promotion.
    """

    def __init__(self, rngs: nnx.Rngs, attention_dropout: float = 0.1):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.conv = nnx.Conv(DIM, DIM, kernel_size=(3,), rngs=rngs)
        self.norm1 = nnx.LayerNorm(DIM, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS,
            DIM,
            decode=False,
            dropout_rate=attention_dropout,
            deterministic=False,
            rngs=rngs,
        )
        self.norm2 = nnx.LayerNorm(DIM, rngs=rngs)
        self.mlp_in = nnx.Linear(DIM, 2 * DIM, rngs=rngs)
        self.bn = nnx.BatchNorm(2 * DIM, use_running_average=False, rngs=rngs)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.mlp_out = nnx.Linear(2 * DIM, DIM, rngs=rngs)
        self.head = Head(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):
        h = self.embed(tokens)
        h = h + self.conv(h)
        h = h + self.attn(self.norm1(h))
        z = nnx.relu(self.bn(self.mlp_in(self.norm2(h))))
        h = h + self.mlp_out(self.dropout(z))
        return self.head(h)


def make_net(attention_dropout: float = 0.1) -> Net:
    return Net(nnx.Rngs(0, dropout=1), attention_dropout)


TOKENS = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)
TARGETS = jax.random.randint(jax.random.key(2), (BATCH, SEQ), 0, VOCAB)


def train_step(model, optimizer, tokens, targets):
    loss_scale = jnnx.get_loss_scale(optimizer)

    def loss_fn(model):
        logits = model(tokens)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
        return loss_scale.scale(loss), (loss, logits)

    grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
    (_, (loss, logits)), grads = grad_fn(model)
    optimizer.update(model, grads)
    return loss, logits, grads, nnx.state(model, nnx.Param), nnx.state(model, nnx.BatchStat)


def make_optimizer(model, loss_scale=None, learning_rate=0.05):
    # SGD: optax's Adam bias correction (`decay**count`) fails under strict promotion.
    inner = optax.sgd(learning_rate, momentum=0.9)
    tx = jmp.loss_scaled(inner, loss_scale or jmp.NoOpLossScale())
    return nnx.Optimizer(model, tx, wrt=nnx.Param)


_ALGORITHM = re.compile(r"algorithm = <lhs_precision_type = (\w+), rhs_precision_type = (\w+)")


def matmul_operand_dtypes(model, optimizer) -> dict[str, collections.Counter]:
    """Counts (lhs, rhs) dtypes of every dot_general and convolution of the step.

    A dot with an explicit algorithm counts as (lhs, rhs, "algorithm lhs x rhs").
    """
    text = nnx.jit(train_step).lower(model, optimizer, TOKENS, TARGETS).as_text()
    counts = {"dot_general": collections.Counter(), "convolution": collections.Counter()}
    for op in hlo_ops(text, tuple(counts)):  # Raises if one escaped the parser.
        key = op.operand_types
        if algorithm := _ALGORITHM.search(op.line):
            key += ("algorithm {} x {}".format(*algorithm.groups()),)
        counts[op.name][key] += 1
    return counts


# Forward: attention's query, key, value and output projections and its two
# einsums, plus mlp_in, mlp_out and head: 9 dots. Backward: two each (the
# input's and the weight's gradient): 18. The conv: 1 forward, 2 backward.
N_DOTS, N_ATTENTION_DOTS, N_HEAD_DOTS, N_CONVS = 27, 18, 3, 3


# --- The lowered train step ------------------------------------------------


def test_train_step_matmuls_all_take_compute_dtype():
    model = jnnx.PolicyModule(make_net(), "mixed_bfloat16")
    counts = matmul_operand_dtypes(model, make_optimizer(model))
    assert counts["dot_general"] == {("bf16", "bf16"): N_DOTS}
    assert counts["convolution"] == {("bf16", "bf16"): N_CONVS}


def test_train_step_keeps_params_grads_stats_in_float32():
    model = jnnx.PolicyModule(make_net(), "mixed_bfloat16")
    optimizer = make_optimizer(model)
    # Dtypes are static: the step's abstract evaluation shows them without a compile.
    loss, logits, grads, params, batch_stats = nnx.jit(train_step).eval_shape(
        model, optimizer, TOKENS, TARGETS
    )
    assert loss.dtype == F32
    assert logits.dtype == F32  # the output dtype
    assert {x.dtype for x in jax.tree.leaves(grads)} == {F32}
    assert {x.dtype for x in jax.tree.leaves(params)} == {F32}  # after the update
    assert {x.dtype for x in jax.tree.leaves(batch_stats)} == {F32}
    net = model.module
    assert net.mlp_in.dtype == net.attn.query.dtype == net.embed.dtype == BF16
    assert net.conv.dtype == net.head.dtype == BF16
    assert net.norm1.dtype == net.bn.dtype == F32  # the norm default
    assert net.mlp_in.param_dtype == net.bn.param_dtype == F32


@pytest.mark.parametrize("rules", [{"head": "f32"}, {Head: "f32"}], ids=["path", "class"])
def test_rule_keeps_exactly_the_head_in_float32(rules):
    model = jnnx.PolicyModule(make_net(), "mixed_bfloat16", rules=rules)
    counts = matmul_operand_dtypes(model, make_optimizer(model))
    assert counts["dot_general"] == {
        ("bf16", "bf16"): N_DOTS - N_HEAD_DOTS,
        ("f32", "f32"): N_HEAD_DOTS,
    }
    assert model.module.head.dtype == F32 and model.module.mlp_out.dtype == BF16


def test_class_rule_is_inherited_and_next_layers_stay_half():
    # Attention's output is float32 here, so the residual sum is float32: only
    # standard promotion allows that sum. The layers after it cast it back.
    model = jnnx.PolicyModule(make_net(), "mixed_bfloat16", rules={nnx.MultiHeadAttention: "f32"})
    with jax.numpy_dtype_promotion("standard"):
        counts = matmul_operand_dtypes(model, make_optimizer(model))
    assert counts["dot_general"] == {
        ("f32", "f32"): N_ATTENTION_DOTS,
        ("bf16", "bf16"): N_DOTS - N_ATTENTION_DOTS,
    }
    assert counts["convolution"] == {("bf16", "bf16"): N_CONVS}
    attn = model.module.attn
    assert attn.dtype == attn.query.dtype == attn.out.dtype == F32  # inherited
    assert model.module.mlp_in.dtype == BF16


def test_attention_without_dropout_computes_in_half_too():
    # Without attention dropout Flax calls `jax.nn.dot_product_attention`, which
    # rejects half inputs under strict promotion (`promote_types(bf16, f32)`).
    # Under standard promotion its dots ask for float32 results of bf16
    # operands, by the BF16_BF16_F32 algorithm: all multiply in bf16, the
    # logits' gradient too (where the CPU form runs them, it drops the
    # algorithm and casts the operands).
    model = jnnx.PolicyModule(make_net(attention_dropout=0.0), "mixed_bfloat16")
    with jax.numpy_dtype_promotion("standard"):
        counts = matmul_operand_dtypes(model, make_optimizer(model))
    dots = counts["dot_general"]
    assert sum(dots.values()) == N_DOTS
    by_algorithm = ("algorithm bf16 x bf16",)
    assert all(k[:2] == ("bf16", "bf16") or k[2:] == by_algorithm for k in dots), dots


# --- Float16 with dynamic loss scaling -------------------------------------


def test_float16_with_dynamic_loss_scale_trains():
    model = jnnx.PolicyModule(make_net(), "mixed_float16")
    # 2**24 overflows float16 gradients: the first steps are skipped and the
    # scale backs off until it fits.
    optimizer = make_optimizer(model, jmp.DynamicLossScale(2.0**24))
    step = nnx.jit(train_step)
    losses = []
    for _ in range(12):
        loss, logits, grads, _, _ = step(model, optimizer, TOKENS, TARGETS)
        losses.append(float(loss))

    state = optimizer.opt_state
    loss_scale = jnnx.get_loss_scale(optimizer)
    assert isinstance(loss_scale, jmp.DynamicLossScale)
    assert isinstance(loss_scale.loss_scale, jax.Array)
    assert loss_scale.loss_scale.dtype == F32
    skipped = int(state.total_notfinite[...])
    assert 0 < skipped < 12
    # Each skipped step halved the scale (no growth within `period` steps).
    assert float(loss_scale.loss_scale) * 2.0**skipped == 2.0**24
    assert losses[-1] < losses[0] - 0.5
    assert all(np.isfinite(losses))
    assert model.module.mlp_in.dtype == F16
    assert logits.dtype == F32 and {x.dtype for x in jax.tree.leaves(grads)} == {F32}
    params = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {x.dtype for x in params} == {F32}
    assert all(np.isfinite(x).all() for x in params)
    bn = model.module.bn
    assert bn.mean.dtype == bn.var.dtype == F32
    assert not np.allclose(bn.mean[...], 0.0)  # the statistics were updated


def test_get_loss_scale_of_nnx_optimizer():
    model = nnx.Linear(2, 2, rngs=nnx.Rngs(0))
    tx = optax.chain(optax.clip(1.0), jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(8.0)))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    # The core function finds it too (today with nnx.Optimizer's OptState
    # variables as its leaves, which still scale and convert).
    core = jmp.get_loss_scale(optimizer.opt_state)
    assert float(core.loss_scale) == 8.0 and float(core.scale(jnp.float32(2.0))) == 16.0
    for found in (jnnx.get_loss_scale(optimizer), jnnx.get_loss_scale(optimizer.opt_state)):
        assert isinstance(found, jmp.DynamicLossScale)
        assert isinstance(found.loss_scale, jax.Array) and float(found.loss_scale) == 8.0
        assert int(found.counter) == 0
    with pytest.raises(ValueError, match="exactly one LossScaledState"):
        jnnx.get_loss_scale(nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param))


# --- Rules -------------------------------------------------------------------


class Inner(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(2, 2, rngs=rngs)
        self.embed = nnx.Embed(2, 2, rngs=rngs)
        self.norm = nnx.LayerNorm(2, rngs=rngs)


class Outer(nnx.Module):
    def __init__(self, rngs):
        self.first = Inner(rngs)
        self.second = Inner(rngs)
        self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs), Head(2, 2, rngs=rngs)])


def _dtypes(model) -> dict[str, np.dtype]:
    return {
        "/".join(map(str, path)): np.dtype(module.dtype)
        for path, module in nnx.iter_modules(model)
        if getattr(module, "dtype", None) is not None
    }


def test_rule_precedence_and_inheritance():
    model = jnnx.with_policy(
        Outer(nnx.Rngs(0)),
        "mixed_bfloat16",
        rules={
            nnx.Linear: "f16",  # every Linear, Head included...
            Head: "f32",  # ...but the nearer class in Head's MRO wins
            "second": "f16",  # a path: children without a rule inherit it
            "second/dense": "f32",  # more literal characters win...
            "*dense": "bf16",  # ...and any path beats any class
            "first/dens?": "f32",  # a tie (10 literal characters each):
            "first/?ense": "f16",  # the rule listed first wins
        },
    )
    assert _dtypes(model) == {
        "first/dense": F32,
        "first/embed": BF16,  # the policy
        "first/norm": F32,  # the norm default
        "second/dense": F32,
        "second/embed": F16,  # inherited from "second"
        "second/norm": F32,  # inherited, computing in at least float32
        "layers/0": F16,
        "layers/1": F32,
    }
    assert model.second.norm.param_dtype == F16  # its parent's param dtype


def test_rule_naming_a_norm_overrides_the_default():
    model = jnnx.with_policy(
        Outer(nnx.Rngs(0)), "mixed_bfloat16", rules={"first/norm": "mixed_bfloat16"}
    )
    assert model.first.norm.dtype == BF16 and model.second.norm.dtype == F32
    # Flax's norms take half inputs only under standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        assert model.first.norm(jnp.ones((1, 2), BF16)).dtype == BF16
    assert model.second.norm(jnp.ones((1, 2), BF16)).dtype == F32


def test_rule_param_dtype_casts_that_modules_params():
    model = jnnx.with_policy(Outer(nnx.Rngs(0)), "mixed_bfloat16", rules={"layers/1": "bf16"})
    assert model.layers[1].kernel.dtype == model.layers[1].bias.dtype == BF16
    assert model.layers[1].param_dtype == BF16
    others = nnx.state(model.first, nnx.Param), nnx.state(model.layers[0], nnx.Param)
    assert {x.dtype for x in jax.tree.leaves(others)} == {F32}


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ([(nnx.Linear, "f32")], TypeError, "rules must be a mapping"),
        ({nn.Dense: "f32"}, TypeError, "flax.nnx.Module subclass"),
        ({3: "f32"}, TypeError, "path pattern"),
        ({"": "f32"}, TypeError, "non-empty"),
        ({nnx.Linear: 3}, TypeError, "Policy or a policy spec"),
        ({nnx.Linear: "f8"}, ValueError, "Unknown dtype"),
        ({"frist/*": "f32"}, ValueError, "matches no module of the model"),
    ],
)
def test_bad_rules_raise(rules, error, match):
    with pytest.raises(error, match=match):
        jnnx.with_policy(Outer(nnx.Rngs(0)), "mixed_bfloat16", rules=rules)
    with pytest.raises(error, match=match):
        jnnx.PolicyModule(Outer(nnx.Rngs(0)), "mixed_bfloat16", rules=rules)


@pytest.mark.parametrize("module", [nn.Dense(2), lambda x: x, None])
def test_with_policy_rejects_non_nnx_modules(module):
    # One line naming the type (not the model's repr) and what to use.
    for wrap in (jnnx.with_policy, jnnx.PolicyModule):
        with pytest.raises(TypeError, match="expects a flax.nnx.Module, got a ") as e:
            wrap(module, "mixed_bfloat16")
        assert "\n" not in str(e.value) and "jmp_policy.with_policy(" in str(e.value)


def test_bad_policy_raises():
    with pytest.raises(ValueError, match="Unknown dtype"):
        jnnx.with_policy(Outer(nnx.Rngs(0)), "c=f8")


# --- Copies, boundaries and the jit cache ------------------------------------


def test_original_module_is_left_unchanged():
    original = nnx.Linear(2, 3, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(0))
    kernel = original.kernel[...]
    mixed = jnnx.with_policy(original, "mixed_bfloat16")
    assert type(mixed) is nnx.Linear and mixed is not original
    assert original.dtype is None and original.param_dtype == jnp.bfloat16
    assert original.kernel.dtype == BF16 and mixed.kernel.dtype == F32
    np.testing.assert_array_equal(mixed.kernel[...], kernel.astype(F32))
    # Same state paths (checkpoints fit), but separate variables.
    assert nnx.to_flat_state(nnx.state(mixed)).paths == nnx.to_flat_state(nnx.state(original)).paths
    mixed.bias[...] = jnp.ones(3, F32)
    assert (original.bias[...] == 0).all()


def test_policy_module_casts_at_its_boundary():
    class Scale(nnx.Module):
        def __init__(self):
            self.w = nnx.Param(jnp.full((3,), 2.0))
            self.dtype = None

        def __call__(self, x, tokens, *, bias):
            # A layer casts what it computes with (its inputs arrive as given).
            w = self.w[...].astype(self.dtype)
            y = x.astype(self.dtype) * w + bias.astype(self.dtype)
            return {"y": y, "tokens": tokens, "x_dtype": x.dtype}

    model = jnnx.PolicyModule(Scale(), "p=f32,c=bf16,o=f16")

    @nnx.jit
    def call(model, x, tokens, bias):
        out = model(x, tokens, bias=bias)
        return out["y"], out["tokens"]

    y, tokens = call(model, jnp.ones(3), jnp.arange(3), jnp.zeros(3))
    assert y.dtype == F16 and tokens.dtype == jnp.int32
    assert model(jnp.ones(3), 0, bias=jnp.zeros(3))["x_dtype"] == F32  # Not cast.
    assert model.module(jnp.ones(3, BF16), 0, bias=jnp.zeros(3, BF16))["x_dtype"] == BF16
    assert model.module.w.dtype == F32
    assert nnx.to_flat_state(nnx.state(model, nnx.Param)).paths == (("module", "w"),)


def test_jitted_step_retraces_for_each_policy():
    original = nnx.Linear(2, 3, rngs=nnx.Rngs(0))
    models = {
        None: original,
        "mixed_bfloat16": jnnx.with_policy(original, "mixed_bfloat16"),
        "f16": jnnx.PolicyModule(original, "f16"),
    }
    expected = {None: F32, "mixed_bfloat16": BF16, "f16": F16}
    forward = nnx.jit(lambda model, x: model(x))
    x = jnp.ones((1, 2))
    for order in (list(models), list(reversed(models))):
        for name in order:
            assert forward(models[name], x).dtype == expected[name], name


# --- Issue 10: the architectures people write ---------------------------------


class LayerScaleBlock(nnx.Module):
    def __init__(self, rngs):
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.proj = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x):
        return x + self.proj(self.norm(x))


class ScannedStack(nnx.Module):
    """Three blocks with stacked parameters, run through `nnx.scan`."""

    def __init__(self, rngs, cast_carry=False):
        self.cast_carry = cast_carry
        self.inp = nnx.Linear(5, 8, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return LayerScaleBlock(rngs)

        self.blocks = make(rngs)
        self.out = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def body(x, block):
            return block(x).astype(x.dtype) if self.cast_carry else block(x)

        return self.out(body(self.inp(x), self.blocks))


def test_nnx_scan_runs_under_a_policy_and_a_rule_that_mixes_its_carry_says_what_to_do():
    # Issue 10, point 2 for NNX. Without rules the scanned carry stays in
    # half (NNX layers cast their inputs). A rule putting one layer of the
    # scanned block in float32 changes the carry's dtype; NNX has no method
    # interceptors to cast it back, so this is refused with an error naming
    # the module and the fix, not JAX's bare scan type error.
    model, x = ScannedStack(nnx.Rngs(0)), jnp.ones((2, 5))
    expected = model(x)
    with jax.numpy_dtype_promotion("standard"):
        out = jnnx.PolicyModule(model, "mixed_bfloat16")(x)
        np.testing.assert_allclose(out, expected, atol=3e-2)
        assert out.dtype == F32
        mixed = jnnx.PolicyModule(model, "mixed_bfloat16", rules={"blocks/proj": "f32"})
        with pytest.raises(TypeError, match=r"\('blocks/proj',\).*cast the carry back"):
            mixed(x)
        # The fix the message gives: the body casts its carry back.
        model.cast_carry = True
        fixed = jnnx.PolicyModule(model, "mixed_bfloat16", rules={"blocks/proj": "f32"})
        np.testing.assert_allclose(fixed(x), expected, atol=3e-2)


class ScanOverLayers(nnx.Module):
    """Flax's scan over layers: the model's float32 input is the carry."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return nnx.Linear(8, 8, rngs=rngs)

        self.blocks = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def body(block, h):
            return jnp.tanh(block(h))

        return body(self.blocks, x)


def test_a_carry_the_policys_fields_would_change_keeps_its_dtype():
    # The layers' bfloat16 fields would make the float32 carry bfloat16 (the
    # model's own half config fails here): the call runs again with the
    # fields as written, the engine taking the products to bfloat16.
    model, x = ScanOverLayers(nnx.Rngs(0)), jnp.linspace(-1, 1, 32).reshape(4, 8)
    expected = model(x)
    mixed = jnnx.PolicyModule(model, "mixed_bfloat16")
    with pytest.warns(RuntimeWarning, match="carry input and carry output"):
        out = mixed(x)
        text = jax.jit(lambda x: mixed(x)).lower(x).as_text()
    assert out.dtype == F32
    np.testing.assert_allclose(out, expected, atol=3e-2)
    assert {d for c in contractions(text) for d in c.operand_dtypes} == {BF16}


class PostNormBlock(nnx.Module):
    """Post-LN: `norm(x + f(x))`, its result the carry."""

    def __init__(self, rngs):
        self.proj = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)

    def __call__(self, x):
        return self.norm(x + jax.nn.gelu(self.proj(x)))


class PostNormStack(ScanOverLayers):
    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return PostNormBlock(rngs)

        self.blocks = make(rngs)


def test_a_scanned_post_norm_block_keeps_its_carry():
    # The run with the fields as written keeps the norms as written too (it
    # set them to the compute dtype again, and the norm made the carry bf16).
    model, x = PostNormStack(nnx.Rngs(0)), jnp.linspace(-1, 1, 32).reshape(4, 8)
    expected = model(x)
    mixed = jnnx.PolicyModule(model, "mixed_bfloat16")
    # `x + f(x)` adds its float32 input to the layer's bf16 result.
    with jax.numpy_dtype_promotion("standard"), pytest.warns(RuntimeWarning, match="carry input"):
        out = mixed(x)
        grads = nnx.grad(lambda m, x: jnp.sum(m(x).astype(jnp.float32) ** 2))(mixed, x)
        text = jax.jit(lambda x: mixed(x)).lower(x).as_text()
    assert out.dtype == F32
    np.testing.assert_allclose(out, expected, atol=5e-2)
    assert {d for c in contractions(text) for d in c.operand_dtypes} == {BF16}
    kernel = grads.module.blocks.proj.kernel.value
    assert kernel.dtype == F32 and bool(jnp.all(jnp.isfinite(kernel)))


class SinusoidalEmbedding(nnx.Module):
    """Plain `jnp` (no `dtype` attribute)."""

    def __call__(self, t):
        # The values it is called with (the call is traced: read them back by callback).
        jax.debug.callback(lambda v: SEEN.update(timesteps=v), t)
        freqs = jnp.exp(-np.log(10000.0) * jnp.arange(32, dtype=jnp.float32) / 32)
        angles = t[:, None] * freqs.astype(t.dtype)[None]
        return jnp.concatenate([jnp.sin(angles), jnp.cos(angles)], axis=-1)


class Denoiser(nnx.Module):
    def __init__(self, rngs, layer_dtype=None):
        self.embedding = SinusoidalEmbedding()
        self.t1 = nnx.Linear(64, 64, dtype=layer_dtype, rngs=rngs)
        self.x1 = nnx.Linear(8, 64, dtype=layer_dtype, rngs=rngs)
        self.h1 = nnx.Linear(64, 64, dtype=layer_dtype, rngs=rngs)
        self.out = nnx.Linear(64, 8, dtype=layer_dtype, rngs=rngs)

    def __call__(self, x, t):
        h = nnx.gelu(self.x1(x) + self.t1(self.embedding(t)))
        return self.out(nnx.gelu(self.h1(h)))


TIMESTEPS = np.array([999, 998, 997, 513, 3], np.float32)
SEEN: dict = {}  # What modules saw while called.


def test_policy_module_gives_plain_jnp_modules_their_inputs_as_given():
    # Issue 10, point 4 for NNX: the timesteps became [1000, 1000, 996, 512, 3].
    x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 8)), F32)
    model = Denoiser(nnx.Rngs(0))
    expected = model(x, TIMESTEPS)
    hand = Denoiser(nnx.Rngs(0), layer_dtype=jnp.bfloat16)
    errors = {}
    for name, m in [
        ("hand-written", hand),
        ("PolicyModule", jnnx.PolicyModule(model, "mixed_bfloat16")),
        ("root rule", jnnx.PolicyModule(model, "mixed_bfloat16", rules={Denoiser: "f32"})),
    ]:
        out = m(x, TIMESTEPS)
        seen = SEEN["timesteps"]
        np.testing.assert_array_equal(seen, TIMESTEPS, err_msg=name)
        assert seen.dtype == F32
        errors[name] = float(jnp.max(jnp.abs(out.astype(F32) - expected)))
    assert 0 < errors["PolicyModule"] <= 1.5 * errors["hand-written"], errors
    assert errors["root rule"] < 1e-6, errors


def test_policy_module_keep_inputs():
    class Layer(nnx.Module):
        def __init__(self):
            self.dtype = None  # A layer: it casts what it computes with.

        def __call__(self, x, t):
            SEEN["x"], SEEN["t"] = x.dtype, t.dtype
            return x

    for keep, kwargs in [("t", {}), (("t",), {"t": jnp.ones(2)})]:
        module = jnnx.PolicyModule(Layer(), "mixed_bfloat16", keep_inputs=keep)
        module(jnp.ones(2), *([] if kwargs else [jnp.ones(2)]), **kwargs)
        assert (SEEN["x"], SEEN["t"]) == (F32, F32)
    # Issue 19, point 1: a layer root's inputs were cast unless keep_inputs
    # named them; as in its own half-precision config, they are as given.
    jnnx.PolicyModule(Layer(), "mixed_bfloat16")(jnp.ones(2), jnp.ones(2))
    assert (SEEN["x"], SEEN["t"]) == (F32, F32)
    # A rule naming the root casts its inputs, keep_inputs aside.
    jnnx.PolicyModule(Layer(), "mixed_bfloat16", rules={Layer: "mixed_bfloat16"}, keep_inputs="t")(
        jnp.ones(2), jnp.ones(2)
    )
    assert (SEEN["x"], SEEN["t"]) == (BF16, F32)
    with pytest.raises(ValueError, match=r"keep_inputs names 'time'.*\['x', 't'\]"):
        jnnx.PolicyModule(Layer(), "mixed_bfloat16", keep_inputs="time")


class ComplexNet(nnx.Module):
    def __init__(self, rngs):
        self.complex = nnx.Linear(5, 4, dtype=jnp.complex64, param_dtype=jnp.complex64, rngs=rngs)
        self.real = nnx.Linear(4, 2, rngs=rngs)

    def __call__(self, z):
        return self.real(jnp.abs(self.complex(z)))


@pytest.mark.parametrize("policy", ["float32", "mixed_bfloat16"])
def test_complex_layers_stay_complex(policy):
    # Issue 10, point 6 for NNX.
    model = ComplexNet(nnx.Rngs(0))
    rng = np.random.default_rng(1)
    z = jax.lax.complex(*(jnp.asarray(rng.standard_normal((3, 5)), F32) for _ in range(2)))
    mixed = jnnx.PolicyModule(model, policy)
    assert mixed.module.complex.dtype == jnp.complex64
    assert mixed.module.complex.kernel.dtype == jnp.complex64
    np.testing.assert_allclose(mixed(z), model(z), atol=3e-2)


class _QKNormAttention(nnx.Module):
    """Attention with q/k-norm (Qwen3's) decoding into a dict cache."""

    def __init__(self, d, rngs, dtype=None):
        self.q, self.k, self.v = (nnx.Linear(d, d, dtype=dtype, rngs=rngs) for _ in range(3))
        self.q_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)
        self.k_norm = nnx.RMSNorm(d, dtype=dtype, rngs=rngs)

    def __call__(self, x, cache):
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        pos = cache["pos"]
        keys = jax.lax.dynamic_update_slice(cache["k"], k, (0, pos, 0))
        values = jax.lax.dynamic_update_slice(cache["v"], v, (0, pos, 0))
        scores = jnp.einsum("bqd,bkd->bqk", q, keys)
        scores = jnp.where(jnp.arange(keys.shape[1]) <= pos, scores, -1e9)
        out = jnp.einsum("bqk,bkd->bqd", jax.nn.softmax(scores, -1), values)
        return out, {"k": keys, "v": values, "pos": pos + 1}


@jax.numpy_dtype_promotion("standard")  # As such models run (and the hand config needs).
def test_q_k_norm_keys_fit_the_values_cache_as_in_the_hand_written_config():
    d, steps = 8, 4
    xs = jax.random.normal(jax.random.key(1), (steps, 2, 1, d))

    def decode(model, dtype):
        cache = {"k": jnp.zeros((2, steps, d), dtype), "v": jnp.zeros((2, steps, d), dtype)}
        cache["pos"] = jnp.int32(0)
        outs = []
        for x in xs:
            out, cache = model(x, cache)
            outs.append(out)
        return jnp.concatenate(outs, 1), cache

    plain = _QKNormAttention(d, nnx.Rngs(0))
    want, _ = decode(plain, jnp.float32)
    hand_out, hand_cache = decode(_QKNormAttention(d, nnx.Rngs(0), jnp.bfloat16), jnp.bfloat16)
    for policy in ("mixed_bfloat16", "p=f32,c=bf16,o=f32,m=bf16"):
        out, cache = decode(jnnx.PolicyModule(plain, policy), jnp.bfloat16)
        assert {k: v.dtype for k, v in cache.items()} == {k: v.dtype for k, v in hand_cache.items()}
        assert out.dtype == jnp.float32
        err, hand_err = (float(jnp.max(jnp.abs(o - want))) for o in (out, hand_out))
        assert err <= 1.5 * hand_err + 1e-3, (policy, err, hand_err)


def test_a_float32_cache_under_a_half_policy_is_named_with_the_fix():
    # Flax's `init_cache` makes float32 by default: lax's own error names neither.
    mha = nnx.MultiHeadAttention(
        num_heads=2, in_features=8, qkv_features=8, decode=True, rngs=nnx.Rngs(0)
    )
    mha.init_cache((1, 4, 8))
    with pytest.raises(TypeError, match=r"cache variables 'cached_key' \(float32\).*init_cache"):
        jnnx.PolicyModule(mha, "mixed_bfloat16")(jnp.ones((1, 1, 8)))
    with pytest.raises(RuntimeError, match="mine"):  # The user's own error passes unchanged.
        jnnx.PolicyModule(_Raises(), "mixed_bfloat16")(jnp.ones((1, 1, 8)))


class _Raises(nnx.Module):
    def __call__(self, x):
        raise RuntimeError("mine")


class _Normed(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        self.linear = nnx.Linear(4, 4, rngs=rngs)
        self.norm = nnx.LayerNorm(4, rngs=rngs)

    def __call__(self, x):
        return self.norm(self.linear(x))


def _norm_result_dtype(model, x):
    """The dtype the norm returns in, before the policy's output cast."""
    jaxpr = jax.make_jaxpr(model)(x).jaxpr
    last = jaxpr.eqns[-1]
    assert last.outvars[0] is jaxpr.outvars[0] and last.primitive.name == "convert_element_type"
    return last.invars[0].aval.dtype


def test_policy_module_norms_follow_the_promotion_in_force_when_called():
    """Flax's NNX norms run in half only under standard promotion: read when called, not made."""
    x = jnp.ones((2, 4))
    made_strict = jnnx.PolicyModule(_Normed(nnx.Rngs(0)), "p=f32,c=bf16,o=f16")
    with jax.numpy_dtype_promotion("standard"):
        made_standard = jnnx.PolicyModule(_Normed(nnx.Rngs(0)), "p=f32,c=bf16,o=f16")
        assert _norm_result_dtype(made_strict, x) == BF16  # The hand config's.
        assert made_standard(x).dtype == np.float16
    # Made under standard promotion, called under strict: the norm in float32, no error.
    assert _norm_result_dtype(made_standard, x) == F32
    assert made_standard(x).dtype == np.float16
    assert nnx.jit(lambda m, x: m(x))(made_standard, x).dtype == np.float16
    # The module held is configured once, as `with_policy` made it; calls change only their copy.
    assert made_strict.module.norm.dtype == F32 and made_standard.module.norm.dtype == BF16


class _Dropped(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(4, 4, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.dense(x))


@pytest.mark.parametrize("front_end", ["policy_module", "autocast"])
def test_grad_over_a_merge_inside_the_loss_with_an_rngs_stream(front_end):
    # EasyDeL's trainer: `state.merge(tree)` inside `jax.value_and_grad`, the
    # non-parameter state (Dropout's `Rngs` counts) behind `stop_gradient`.
    model = _Dropped(nnx.Rngs(0, dropout=1))
    if front_end == "policy_module":
        model = jnnx.PolicyModule(model, "mixed_bfloat16")
    graphdef, params, other = nnx.split(model, nnx.Param, ...)
    x = jnp.ones((2, 4))

    def loss(params):
        rest = jax.tree.map(jax.lax.stop_gradient, other)
        merged = nnx.merge(graphdef, params, rest)
        call = merged if front_end == "policy_module" else jmp.autocast(merged, "mixed_bfloat16")
        return jnp.mean(jnp.square(call(x).astype(jnp.float32)))

    for step in (jax.grad(loss), jax.jit(jax.grad(loss))):
        grads = step(params)
        leaves = jax.tree.leaves(grads)
        assert leaves and all(bool(jnp.all(jnp.isfinite(g))) for g in leaves)
        assert any(bool(jnp.any(g != 0)) for g in leaves)


def test_a_scoped_module_keeps_its_class_in_the_callers_model():
    # A rule giving a layer other products than its parent's scopes its
    # methods on the copy the traced call merges, not on the caller's modules.
    model = nnx.Sequential(nnx.Linear(3, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 2, rngs=nnx.Rngs(1)))
    mixed = jnnx.PolicyModule(model, "mixed_bfloat16", rules={"layers/1": "m=bf16,r=f32"})
    x = jnp.ones((2, 3))
    eager, jitted = mixed(x), nnx.jit(lambda m, x: m(x))(mixed, x)
    assert eager.dtype == jitted.dtype == jnp.float32
    assert [type(m) for m in mixed.module.layers] == [nnx.Linear, nnx.Linear]
    assert [type(m) for m in model.layers] == [nnx.Linear, nnx.Linear]


@pytest.mark.parametrize("front_end", ["PolicyModule", "autocast"])
def test_state_merged_inside_grad_is_written_back_only_where_the_call_wrote(front_end):
    # EasyDeL's trainer: parameters and the rest split, merged inside the
    # loss. The `Rngs` count a Dropout of rate 0 never draws from belongs to
    # the outer trace: writing it back (unchanged) raised TraceContextError.
    model = nnx.Sequential(nnx.Linear(3, 3, rngs=nnx.Rngs(0)), nnx.Dropout(0.0, rngs=nnx.Rngs(1)))
    call = lambda m: m(jnp.ones((2, 3)))  # noqa: E731
    if front_end == "PolicyModule":
        model = jnnx.PolicyModule(model, "mixed_bfloat16")
    else:
        call = jmp.autocast(call, "mixed_bfloat16")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    grads = jax.jit(jax.grad(lambda p: call(nnx.merge(graphdef, p, rest)).sum()))(params)
    assert all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))
