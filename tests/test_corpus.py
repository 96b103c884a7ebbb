"""Models nobody here wrote, under every policy, against their own half config.

bonsai's Qwen3 (NNX, vendored), penzai's llamalike transformer, Haiku's
ResNet and DeepMind's gemma (linen; in a process of its own); recurrentgemma
is in test_recurrentgemma.py, Flax's examples in test_examples.py. Each
model, with a tiny config and random weights, under `mixed_bfloat16`,
`mixed_float16` (with a `DynamicLossScale`), `p=f32,c=bf16,o=f32,m=bf16`,
`mixed_float8`, `mixed_float8_rowwise`, `mixed_mxfp8` and `mixed_nvfp4`:
forward error against float32 at most 1.5x the model's own half config's
(FP8 and FP4, which no model has a config for: scaled by the ratio of the
formats' unit roundoffs; `corpus/checks.py`), a few training
steps finite, cached decoding with a cache in the compute dtype as uncached,
no more float32 products than the own config, and under a matmul dtype every
product in it but those the author keeps in float32.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx

from corpus import checks
from corpus.bonsai_qwen3 import modeling as qwen3
from helpers import contractions

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True, scope="module")
def standard_promotion():
    with jax.numpy_dtype_promotion("standard"):  # What these models are written for.
        yield


# --------------------------------------------------------------------------
# jax-ml/bonsai's Qwen3 (NNX, q/k-norm, GQA, a KV cache of nnx.Cache
# variables). Its own half config is its parameters in bfloat16 (the
# checkpoint's dtype) and a bfloat16 cache; it has no float16 one: its mask
# constant is bfloat16's minimum, which turns float16 scores float32.

QWEN3 = qwen3.ModelConfig(
    num_layers=2,
    vocab_size=64,
    emb_dim=32,
    mlp_dim=64,
    num_heads=4,
    head_dim=8,
    num_kv_heads=2,
    rope_theta=10_000,
    rope_scaling_factor=1,
    local_rope_theta=1e4,
    norm_eps=1e-6,
    tie_word_embeddings=False,
)
B, T, PROMPT = 2, 8, 4
TOKENS = jax.random.randint(jax.random.key(1), (B, T), 1, QWEN3.vocab_size)


@nnx.jit
def qwen3_logits(model, cache, tokens):
    return model(tokens, cache=cache, segment_ids=jnp.ones(tokens.shape, jnp.int32))


def qwen3_forward(model, dtype, tokens=TOKENS):
    """Logits of `tokens` from an empty cache in `dtype`, as bonsai's `forward`."""
    return qwen3_logits(model, qwen3.init_cache(QWEN3, B, tokens.shape[1], 0, dtype), tokens)


def qwen3_text(model, dtype):
    graph, state = nnx.split(model)

    def forward(state):
        return qwen3_forward(nnx.merge(graph, state), dtype)

    return checks.jit(forward).lower(state).as_text()


@pytest.fixture(scope="module")
def qwen3_own():
    """The float32 model, its logits, and the own bf16 config's error and program."""
    model = qwen3.Qwen3(QWEN3, rngs=nnx.Rngs(0))
    ref = qwen3_forward(model, jnp.float32)
    own = nnx.clone(model)
    nnx.update(own, checks.cast_floats(nnx.state(own, nnx.Param), jnp.bfloat16))
    errors = {checks.BF16: checks.relative_error(qwen3_forward(own, jnp.bfloat16), ref)}
    return model, ref, errors, {checks.BF16: qwen3_text(own, jnp.bfloat16)}


def test_qwen3_own_config_has_no_float16():
    # What `error_bound` assumes of it: the hand-written float16 Qwen3 fails.
    model = qwen3.Qwen3(QWEN3, rngs=nnx.Rngs(0))
    nnx.update(model, checks.cast_floats(nnx.state(model, nnx.Param), jnp.float16))
    with pytest.raises(TypeError, match="dynamic_update_slice"):
        qwen3_forward(model, jnp.float16)


@pytest.mark.parametrize("policy", checks.POLICIES)
def test_qwen3(qwen3_own, policy):
    model, ref, own_errors, own_texts = qwen3_own
    dtype = checks.compute_dtype(policy)
    mixed = jmp_policy.nnx.PolicyModule(model, policy)
    out = qwen3_forward(mixed, dtype)
    assert out.dtype == jnp.float32
    assert checks.relative_error(out, ref) <= checks.error_bound(policy, own_errors)
    text = qwen3_text(mixed, dtype)
    checks.assert_products(policy, text, own_texts.get(dtype))
    # The same dtype for every product through autocast: one engine decides.
    graph, state = nnx.split(model)

    def via_autocast(state):
        def forward(model, cache):
            return model(TOKENS, cache=cache, segment_ids=jnp.ones(TOKENS.shape, jnp.int32))

        cache = qwen3.init_cache(QWEN3, B, T, 0, dtype)
        return jmp.autocast(forward, policy)(nnx.merge(graph, state), cache)

    autocast_text = checks.jit(via_autocast).lower(state).as_text()
    assert sorted(op.operand_types for op in contractions(text)) == sorted(
        op.operand_types for op in contractions(autocast_text)
    )

    graph, params, rest = nnx.split(mixed, nnx.Param, ...)

    def loss_fn(params):
        logits = qwen3_forward(nnx.merge(graph, params, rest), dtype)
        labels = jnp.roll(TOKENS, -1, axis=1)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    checks.assert_trains(*checks.train(loss_fn, params, policy))

    # A prefill, then a token a step into a cache in the compute dtype.
    cache = qwen3.init_cache(QWEN3, B, PROMPT, T - PROMPT, dtype)
    steps = [qwen3_logits(mixed, cache, TOKENS[:, :PROMPT])]
    steps += [qwen3_logits(mixed, cache, TOKENS[:, i : i + 1]) for i in range(PROMPT, T)]
    assert {x.dtype for x in jax.tree.leaves(nnx.state(cache, nnx.Cache))} == {dtype}
    checks.assert_decodes_as_uncached(policy, jnp.concatenate(steps, 1), out, own_errors)


# --------------------------------------------------------------------------
# penzai's llamalike transformer (plain JAX pytrees, named axes), under
# `autocast`; its own half config is `parameter_dtype` and `activation_dtype`
# in half (as `llamalike_from_huggingface_model` builds a bf16 checkpoint),
# whose KV caches are in that dtype.

pz = pytest.importorskip("penzai.pz")
llamalike = pytest.importorskip("penzai.models.transformer.variants.llamalike_common")
sampling_mode = pytest.importorskip("penzai.models.transformer.sampling_mode")


def llamalike_model(dtype):
    config = llamalike.LlamalikeTransformerConfig(
        num_kv_heads=2,
        query_head_multiplier=2,
        embedding_dim=32,
        projection_dim=8,
        mlp_hidden_dim=64,
        num_decoder_blocks=2,
        vocab_size=64,
        mlp_variant="swiglu",
        tie_embedder_and_logits=False,
        parameter_dtype=dtype,
        activation_dtype=dtype,
    )
    return llamalike.build_llamalike_transformer(config, init_base_rng=jax.random.key(0))


def unwrap_logits(logits):
    return logits.unwrap("batch", "seq", "vocabulary")


def pz_forward_of(model):
    """`(pure forward of (params, tokens), params)` of a penzai model."""
    unbound, params = pz.unbind_params(model, freeze=True)

    def forward(params, tokens):
        bound = pz.bind_variables(unbound, params)
        return unwrap_logits(bound(pz.nx.wrap(tokens).tag("batch", "seq")))

    return forward, params


@pytest.fixture(scope="module")
def llamalike_own():
    forward, params = pz_forward_of(llamalike_model(jnp.float32))
    ref = checks.jit(forward)(params, TOKENS)
    errors, texts = {}, {}
    for dtype in (checks.BF16, checks.F16):
        own_forward, _ = pz_forward_of(llamalike_model(dtype))
        own_params = checks.cast_floats(params, dtype)  # The same weights, rounded.
        errors[dtype] = checks.relative_error(checks.jit(own_forward)(own_params, TOKENS), ref)
        texts[dtype] = checks.jit(own_forward).lower(own_params, TOKENS).as_text()
    return forward, params, ref, errors, texts


@pytest.mark.parametrize("policy", checks.POLICIES)
def test_penzai_llamalike(llamalike_own, policy):
    forward, params, ref, own_errors, own_texts = llamalike_own
    dtype = checks.compute_dtype(policy)
    mixed = checks.jit(jmp.autocast(forward, policy))
    out = mixed(params, TOKENS)
    assert out.dtype == jnp.float32
    assert checks.relative_error(out, ref) <= checks.error_bound(policy, own_errors)
    checks.assert_products(policy, mixed.lower(params, TOKENS).as_text(), own_texts.get(dtype))

    def loss_fn(params):
        labels = jnp.roll(TOKENS, -1, axis=1)
        logits = jmp.autocast(forward, policy)(params, TOKENS)
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    checks.assert_trains(*checks.train(loss_fn, params, policy))

    # penzai's own KV-caching mode, its caches made in the compute dtype.
    caching = sampling_mode.KVCachingTransformerLM.from_uncached(
        pz.bind_variables(pz.unbind_params(llamalike_model(jnp.float32))[0], params),
        cache_len=T,
        batch_axes={"batch": B},
    )
    unbound, variables = pz.unbind_variables(caching, freeze=True)
    variables = [
        v if isinstance(v, pz.ParameterValue) else checks.cast_floats(v, dtype) for v in variables
    ]

    @checks.jit
    @functools.partial(jmp.autocast, policy=policy)
    def decode(variables, tokens):
        bound = pz.bind_variables(unbound, [v.unfreeze_as_copy() for v in variables])
        logits = unwrap_logits(bound(pz.nx.wrap(tokens).tag("batch", "seq")))
        return logits, pz.unbind_variables(bound, freeze=True)[1]

    logits, variables = decode(variables, TOKENS[:, :PROMPT])
    steps = [logits]
    for i in range(PROMPT, T):
        logits, variables = decode(variables, TOKENS[:, i : i + 1])
        steps.append(logits)
    caches = [v for v in variables if not isinstance(v, pz.ParameterValue)]
    assert {x.dtype for x in jax.tree.leaves(caches) if jnp.issubdtype(x.dtype, jnp.floating)} == {
        dtype
    }
    checks.assert_decodes_as_uncached(policy, jnp.concatenate(steps, 1), out, own_errors)


# --------------------------------------------------------------------------
# Haiku's ResNet (convolutions, BatchNorm state), under `autocast`; its own
# half config is Haiku's: `hk.mixed_precision.set_policy` with a jmp policy.

hk = pytest.importorskip("haiku")
IMAGES = jax.random.normal(jax.random.key(3), (4, 16, 16, 3))
LABELS = jnp.arange(4) % 10


def resnet_fn(x, is_training):
    net = hk.nets.ResNet(
        [1, 1, 1, 1], num_classes=10, channels_per_group=(8, 16, 16, 16),
        bottleneck=False, resnet_v2=False, initial_conv_config={"output_channels": 8},
    )  # fmt: skip
    return net(x, is_training=is_training)


def perturbed(params, key):
    """Random weights away from their initial values, as after training."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [p + 0.1 * jax.random.normal(k, p.shape) for p, k in zip(leaves, keys)]
    )


@pytest.fixture(scope="module")
def resnet_own():
    net = hk.transform_with_state(resnet_fn)
    params, state = checks.jit(net.init, static_argnums=2)(jax.random.key(1), IMAGES, True)
    params = checks.jit(perturbed)(params, jax.random.key(2))
    ref, _ = checks.jit(net.apply, static_argnums=4)(params, state, None, IMAGES, False)
    errors, texts = {}, {}
    for dtype, spec in ((checks.BF16, "p=f32,c=bf16,o=f32"), (checks.F16, "p=f32,c=f16,o=f32")):
        hk.mixed_precision.set_policy(hk.nets.ResNet, jmp.get_policy(spec))
        try:
            own = checks.jit(hk.transform_with_state(resnet_fn).apply, static_argnums=4)
            errors[dtype] = checks.relative_error(own(params, state, None, IMAGES, False)[0], ref)
            texts[dtype] = own.lower(params, state, None, IMAGES, False).as_text()
        finally:
            hk.mixed_precision.clear_policy(hk.nets.ResNet)
    return net, params, state, ref, errors, texts


@pytest.mark.parametrize("policy", checks.POLICIES)
def test_haiku_resnet(resnet_own, policy):
    net, params, state, ref, own_errors, own_texts = resnet_own
    apply = jmp.autocast(net.apply, policy)
    forward = checks.jit(apply, static_argnums=4)
    out, _ = forward(params, state, None, IMAGES, False)
    assert out.dtype == jnp.float32
    assert checks.relative_error(out, ref) <= checks.error_bound(policy, own_errors)
    text = forward.lower(params, state, None, IMAGES, False).as_text()
    checks.assert_products(policy, text, own_texts.get(checks.compute_dtype(policy)))

    def loss_fn(params):
        logits, _ = apply(params, state, None, IMAGES, True)
        return optax.softmax_cross_entropy_with_integer_labels(logits, LABELS).mean()

    checks.assert_trains(*checks.train(loss_fn, params, policy))
    # BatchNorm's statistics come back float32, as Haiku keeps them.
    _, new_state = checks.jit(apply, static_argnums=4)(params, state, None, IMAGES, True)
    assert jax.tree.map(lambda a: a.dtype, new_state) == jax.tree.map(lambda a: a.dtype, state)
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(new_state))


# --------------------------------------------------------------------------
# Google DeepMind's gemma (PyPI): in a process of its own, with its imports
# first on the path (`./run` installs them in .venv/gemma; see gemma_check.py).

GEMMA = ROOT / ".venv" / "gemma"


@pytest.mark.skipif(not (GEMMA / "gemma").is_dir(), reason="./run installs gemma in .venv/gemma")
def test_gemma():
    path = os.pathsep.join([str(GEMMA), str(ROOT / "tests"), str(ROOT)])
    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "corpus" / "gemma_check.py")],
        env={**os.environ, "PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "3"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout + run.stderr[-4000:]
    assert "every check holds" in run.stdout, run.stdout
