"""Google DeepMind's `gemma` (PyPI, linen), a tiny Gemma3 config, under the five
policies against its own half config, by `corpus/checks.py`'s measures.

Run by tests/test_corpus.py in a process of its own, with `gemma` and what it
imports (kauldron, TensorFlow, typeguard 4) first on the path, as `./run`
installs them apart (`.venv/gemma`): their pins clash with this project's.
gemma's own half config is `Transformer(dtype=...)` on its parameters in that
dtype (gemma's layers read `dtype` as their parameters' dtype); its cache is
`config.init_cache(dtype=...)`. `autocast` runs it too, with a bf16 cache.
Exits non-zero with the failed check.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
import optax
from gemma.gm.nn import _config, _modules, _transformer

import jmp_policy as jmp

from corpus import checks
from helpers import contractions

L, G = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
CONFIG = _config.TransformerConfig(
    num_embed=64,
    embed_dim=32,
    hidden_dim=64,
    num_heads=2,
    head_dim=16,
    num_kv_heads=1,  # MQA, as Gemma3-270M
    final_logit_softcap=None,
    use_post_attn_norm=True,
    use_post_ffw_norm=True,
    use_qk_norm=True,
    attention_types=(L, G),
    sliding_window_size=4,
    transpose_gating_einsum=True,
    local_base_frequency=10_000,
    global_base_frequency=1_000_000,
    query_pre_attn_norm=_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
)
B, T, PROMPT, CACHE = 2, 8, 4, 8
TOKENS = jax.random.randint(jax.random.key(1), (B, T), 1, CONFIG.num_embed)
COLUMNS = jnp.arange(CACHE)


def model(dtype=jnp.float32):
    return _transformer.Transformer(config=CONFIG, dtype=dtype)


def cached_logits(apply, params, dtype):
    """A prefill of the prompt, then a token a step into a cache in `dtype`."""
    cache = CONFIG.init_cache(batch_size=B, dtype=dtype, cache_length=CACHE)
    positions = jnp.broadcast_to(jnp.arange(PROMPT), (B, PROMPT))
    mask = jnp.broadcast_to(COLUMNS[None] <= jnp.arange(PROMPT)[:, None], (B, PROMPT, CACHE))
    out = apply(params, TOKENS[:, :PROMPT], positions=positions, attention_mask=mask, cache=cache)
    steps = [out.logits]
    for i in range(PROMPT, T):
        out = apply(
            params,
            TOKENS[:, i : i + 1],
            positions=jnp.full((B, 1), i),
            attention_mask=jnp.broadcast_to(COLUMNS <= i, (B, 1, CACHE)),
            cache=out.cache,
        )
        steps.append(out.logits)
    dtypes = {x.dtype for x in jax.tree.leaves(out.cache) if jnp.issubdtype(x.dtype, jnp.floating)}
    assert dtypes == {dtype}, dtypes
    return jnp.concatenate(steps, 1)


def loss(logits_of, params):
    labels = jnp.roll(TOKENS, -1, axis=1)
    logits = logits_of(params, TOKENS).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main() -> int:
    params = model().init(jax.random.key(0), TOKENS)
    ref = checks.jit(model().apply)(params, TOKENS).logits
    own_errors, own_texts, own_learns = {}, {}, {}
    for dtype in (checks.BF16, checks.F16):
        own, own_params = checks.jit(model(dtype).apply), checks.cast_floats(params, dtype)
        own_errors[dtype] = checks.relative_error(own(own_params, TOKENS).logits, ref)
        own_texts[dtype] = own.lower(own_params, TOKENS).as_text()
        # gemma's mask constant (-2.4e38) is -inf in float16: its own float16
        # config's gradients are not finite, so it cannot train.
        own_learns[dtype] = checks.finite_gradients(
            lambda p, own=own: loss(lambda *a: own(*a).logits, p), own_params
        )
    print("own config's error:", {str(k): round(v, 5) for k, v in own_errors.items()})
    print("own config's gradients finite:", {str(k): v for k, v in own_learns.items()})
    texts = {}
    for policy in checks.POLICIES:
        dtype = checks.compute_dtype(policy)
        apply = jmp.with_policy(model().apply, policy)
        forward = checks.jit(apply)
        out = forward(params, TOKENS).logits
        error = checks.relative_error(out, ref)
        print(f"{policy}: error {error:.5f} (bound {checks.error_bound(policy, own_errors):.5f})")
        assert out.dtype == jnp.float32
        assert error <= checks.error_bound(policy, own_errors), policy
        texts[policy] = forward.lower(params, TOKENS).as_text()
        checks.assert_products(policy, texts[policy], own_texts[dtype])

        def loss_fn(params, apply=apply):
            return loss(lambda *a: apply(*a).logits, params)

        checks.assert_trains(*checks.train(loss_fn, params, policy), learns=own_learns[dtype])
        cached = cached_logits(forward, params, dtype)
        checks.assert_decodes_as_uncached(policy, cached, out, own_errors)
    # `autocast` on the same model: gemma's program is float32, its cache
    # bf16; the writes into the cache take its dtype.
    policy = "mixed_bfloat16"
    apply = checks.jit(jmp.autocast(model().apply, policy))
    out = apply(params, TOKENS).logits
    print(f"autocast {policy}: error {checks.relative_error(out, ref):.5f}")
    assert checks.relative_error(out, ref) <= checks.error_bound(policy, own_errors)
    # The same dtype for every product as through with_policy: one engine decides.
    products = [
        sorted(op.operand_types for op in contractions(text))
        for text in (texts[policy], apply.lower(params, TOKENS).as_text())
    ]
    assert products[0] == products[1], products
    checks.assert_decodes_as_uncached(
        policy, cached_logits(apply, params, checks.BF16), out, own_errors
    )
    print("gemma: every check holds under", ", ".join(checks.POLICIES), "and autocast")
    return 0


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):  # What gemma is written for.
        sys.exit(main())
