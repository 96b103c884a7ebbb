"""DeepMind's recurrentgemma (Griffin), a tiny config and no weights, under every policy.

Griffin keeps its RG-LRU state in float32 and asserts it, returns `(logits,
cache)` with attention keys/values and a convolution state in the compute
dtype, and writes its einsums in model code: each step of the path from
training to cached decoding meets one of issue 19's points. Install with
`pip install --no-deps recurrentgemma einops "typeguard<3" sentencepiece`
(its own pins, numpy<2.4 and absl-py<2, are older than this project's).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jmp_policy as jmp

from corpus import checks
from helpers import compiler_options, contractions

griffin = pytest.importorskip("recurrentgemma.jax")

pytestmark = pytest.mark.slow

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
CONFIG = griffin.GriffinConfig(
    vocab_size=32,
    width=16,
    mlp_expanded_width=32,
    num_heads=2,
    block_types=(griffin.TemporalBlockType.RECURRENT, griffin.TemporalBlockType.ATTENTION),
    embeddings_scale_by_sqrt_dim=True,
    attention_window_size=8,
    logits_soft_cap=30.0,
    scan_type=griffin.ScanType.LINEAR_NATIVE,
)
B, L, PROMPT = 2, 8, 4
# jax arrays: Griffin type-checks its arguments (jaxtyping).
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, CONFIG.vocab_size, (B, L)), jnp.int32)
POS = jnp.broadcast_to(jnp.arange(L, dtype=jnp.int32), (B, L))
OPTIONS = compiler_options()
POLICIES = [
    "float32",
    "mixed_bfloat16",
    "mixed_float16",
    "p=f32,c=bf16,o=f32,m=bf16",
    "mixed_float8",
    "mixed_float8_rowwise",
    "autocast",
]


def apply_fn(policy):
    # Griffin returns `(logits, cache)`. The cache a prefill makes is no
    # argument's: said to be state, it comes back as the model made it (a
    # decode step's, written from the one given, would keep its dtypes anyway).
    model, state = griffin.Griffin(CONFIG), (None, True)
    if policy == "autocast":
        return jmp.autocast(model.apply, "mixed_bfloat16", returns_state=state)
    return jmp.with_policy(model.apply, policy, returns_state=state)


@pytest.fixture(scope="module")
def params():
    model = griffin.Griffin(CONFIG)
    with jax.numpy_dtype_promotion("standard"):  # Griffin is written for it.
        return model.init(jax.random.key(0), TOKENS, POS)["params"]


def _dtypes(tree):
    return jax.tree.map(lambda x: x.dtype, tree)


@pytest.mark.parametrize("policy", POLICIES)
def test_griffin_trains_and_decodes_with_its_cache_as_uncached(params, policy):
    # Point 2: under with_policy the first cached step failed with Griffin's
    # bare AssertionError (the RG-LRU state rounded to bf16); point 3: the
    # returned cache was float32.
    apply = apply_fn(policy)
    scale = jmp.DynamicLossScale(2.0**15) if policy == "mixed_float16" else jmp.NoOpLossScale()
    tx = jmp.loss_scaled(optax.adam(1e-2), scale)
    with jax.numpy_dtype_promotion("standard"):

        def loss_fn(p):
            logits, _ = apply({"params": p}, TOKENS, POS, return_cache=False)
            labels = jnp.roll(TOKENS, -1, axis=1)
            return optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(F32), labels
            ).mean()

        @jax.jit(compiler_options=OPTIONS)
        def step(p, opt_state):
            loss_scale = jmp.get_loss_scale(opt_state)
            loss, grads = jax.value_and_grad(lambda p: loss_scale.scale(loss_fn(p)))(p)
            updates, opt_state = tx.update(grads, opt_state, p)
            return optax.apply_updates(p, updates), opt_state, loss_scale.unscale(loss), grads

        p, opt_state = params, tx.init(params)
        losses = []
        for _ in range(3):
            p, opt_state, loss, grads = step(p, opt_state)
            losses.append(float(loss))
        assert np.isfinite(losses).all() and losses[-1] < losses[0], losses
        assert set(jax.tree.leaves(_dtypes(grads))) == {F32}

        # Prefill the prompt, then decode greedily one token at a time.
        prefill = jax.jit(compiler_options=OPTIONS)(lambda t, s: apply({"params": params}, t, s))
        decode = jax.jit(compiler_options=OPTIONS)(
            lambda t, s, c: apply({"params": params}, t, s, c)
        )
        full = jax.jit(compiler_options=OPTIONS)(
            lambda t: apply({"params": params}, t, POS, return_cache=False)[0]
        )
        logits, cache = prefill(TOKENS[:, :PROMPT], POS[:, :PROMPT])
        cached = np.array(TOKENS)
        cache_dtypes = _dtypes(cache)
        for i in range(PROMPT, L):
            cached[:, i] = np.argmax(logits[:, -1], -1)
            logits, cache = decode(jnp.asarray(cached[:, i : i + 1]), POS[:, i : i + 1], cache)
            assert _dtypes(cache) == cache_dtypes
        uncached = np.array(TOKENS)
        for i in range(PROMPT, L):
            uncached[:, i] = np.argmax(full(jnp.asarray(uncached))[:, i - 1], -1)
    np.testing.assert_array_equal(cached, uncached)
    if policy in ("mixed_bfloat16", "p=f32,c=bf16,o=f32,m=bf16", "mixed_float8"):
        # The hand-written bf16 Griffin's cache: bf16 keys, values and conv
        # state, a float32 RG-LRU state (half the memory of a float32 cache).
        hand = griffin.Griffin(CONFIG, dtype=jnp.bfloat16)
        with jax.numpy_dtype_promotion("standard"):  # Griffin is written for it.
            _, hand_cache = jax.eval_shape(
                lambda: hand.apply({"params": params}, TOKENS[:, :PROMPT], POS[:, :PROMPT])
            )
        assert cache_dtypes == _dtypes(hand_cache)
        assert BF16 in jax.tree.leaves(cache_dtypes) and F32 in jax.tree.leaves(cache_dtypes)


@pytest.mark.parametrize("policy", checks.POLICIES)
def test_griffin_forward_and_products_no_worse_than_its_own_half_config(params, policy):
    # Griffin's own half config: `Griffin(config, dtype=...)` on float32
    # parameters (its `param_dtype`).
    with jax.numpy_dtype_promotion("standard"):  # Griffin is written for it.

        def forward(model):
            return checks.jit(
                lambda p: model.apply({"params": p}, TOKENS, POS, return_cache=False)[0]
            )

        ref = forward(griffin.Griffin(CONFIG))(params)
        dtype = checks.compute_dtype(policy)
        own = forward(griffin.Griffin(CONFIG, dtype=dtype))
        own_errors = {dtype: checks.relative_error(own(params), ref)}
        mixed = checks.jit(
            lambda p: jmp.with_policy(griffin.Griffin(CONFIG).apply, policy)(
                {"params": p}, TOKENS, POS, return_cache=False
            )[0]
        )
        out = mixed(params)
        assert out.dtype == F32
        assert checks.relative_error(out, ref) <= checks.error_bound(policy, own_errors)
        own_text = own.lower(params).as_text()
        text = mixed.lower(params).as_text()
        checks.assert_products(policy, text, own_text)
        # The same dtype for every product through autocast: one engine decides.
        via_autocast = checks.jit(
            lambda p: jmp.autocast(griffin.Griffin(CONFIG).apply, policy)(
                {"params": p}, TOKENS, POS, return_cache=False
            )[0]
        )
        autocast_text = via_autocast.lower(params).as_text()
        assert sorted(op.operand_types for op in contractions(text)) == sorted(
            op.operand_types for op in contractions(autocast_text)
        )
