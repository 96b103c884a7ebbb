"""Hugging Face's own Flax models (transformers 4.46.3; `./run` installs it in .venv/hf).

* LongT5 with transient-global attention under every FP8 and FP4 recipe:
  `with_policy(module.init)` on the (1, 1) inputs Hugging Face initialises
  with, and apply on a sequence shorter than `global_block_size`, where the
  global blocks are empty (zero-size products).
* `recommend_fp8_rules` on BERT: its rules name BERT's modules, and applied
  they bring the output within the tolerance.
* BERT through `with_policy` and `autocast`: the same dtype in every product.
"""

from __future__ import annotations

import pathlib
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jmp

from helpers import contractions

HF = pathlib.Path(__file__).resolve().parent.parent / ".venv" / "hf"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (HF / "transformers").is_dir(), reason="./run installs it in .venv/hf"),
]


@pytest.fixture(scope="module")
def transformers():
    if str(HF) not in sys.path:
        sys.path.append(str(HF))  # After the project's own packages.
    import transformers

    return transformers


@pytest.fixture(autouse=True)
def standard_promotion():
    # Hugging Face's code is written for JAX's standard dtype promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.fixture
def old_clip(monkeypatch):
    # LongT5's Flax code calls jnp.clip(a_max=), which jax 0.11 removed: the
    # model fails so on its own too. It is given the old keywords back.
    clip = jnp.clip

    def clip_with_old_keywords(x, min=None, max=None, a_min=None, a_max=None, **kw):
        return clip(x, a_min if min is None else min, a_max if max is None else max, **kw)

    monkeypatch.setattr(jnp, "clip", clip_with_old_keywords)


# The per-tensor recipe (where the crash was reported) and a block format; every
# recipe on empty operands: test_fp8.py.
@pytest.mark.parametrize("policy", ["mixed_float8", "mixed_nvfp4"])
def test_longt5_transient_global_init_and_short_inputs(transformers, old_clip, policy):
    config = transformers.LongT5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1,
        num_heads=4, encoder_attention_type="transient-global", global_block_size=16,
        local_radius=4,
    )  # fmt: skip
    module = transformers.FlaxLongT5Model(config, _do_init=False).module
    ones = jnp.ones((1, 1), jnp.int32)
    rngs = {"params": jax.random.key(0), "dropout": jax.random.key(1)}
    variables = jax.jit(jmp.with_policy(module.init, policy))(rngs, ones, ones, ones, ones)
    assert {x.dtype for x in jax.tree.leaves(variables)} == {np.dtype(np.float32)}
    ids = jnp.arange(10, dtype=jnp.int32)[None]  # shorter than a global block of 16
    mask = jnp.ones_like(ids)

    def apply(policy):
        fn = jmp.with_policy(module.apply, policy)
        return jax.jit(lambda v: fn(v, ids, mask, ids, mask).last_hidden_state)(variables)

    out, want = apply(policy), apply("float32")
    assert out.shape == (1, 10, 32) and np.isfinite(np.asarray(out)).all()
    # Within FP8's (FP4's) error of float32 (measured: 0.04 to 0.05; 0.15 for NVFP4).
    bound = 0.3 if policy == "mixed_nvfp4" else 0.1
    assert float(jnp.linalg.norm(out - want) / jnp.linalg.norm(want)) < bound


def test_fp8_doctor_on_bert(transformers):
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
        # BERT's own 0.02 leaves random layers' outputs small against the
        # embeddings, and FP8's error as small as bf16's: 0.2 makes them count.
        initializer_range=0.2,
    )  # fmt: skip
    model = transformers.FlaxBertModel(config, seed=0)
    module, params = model.module, {"params": model.params}
    ids = (jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) * 7) % 64
    mask, types, positions = jnp.ones_like(ids), jnp.zeros_like(ids), jnp.arange(16)[None]

    def apply(variables, ids):
        out = module.apply(variables, ids, mask, types, positions, None, deterministic=True)
        return out.last_hidden_state

    # Measured: bf16 0.0051, FP8 throughout 0.053.
    report = jmp.recommend_fp8_rules(apply, params, ids, tolerance=0.03, recipes=["mixed_float8"])
    (r,) = report.recipes
    assert "encoder/layer/0/attention/self/query" in report.products
    assert r.error > 0.03 and r.within and r.rules
    assert set(r.rules) <= set(report.products) | {f"{p}/*" for p in report.products}
    got = jax.jit(jmp.with_policy(apply, "mixed_float8", rules=r.rules))(params, ids)
    want = apply(params, ids)
    assert float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want)) <= 0.03


@pytest.mark.parametrize(
    "policy",
    ["mixed_bfloat16", "mixed_float16", "p=f32,c=bf16,o=f32,m=bf16", "mixed_float8", "mixed_mxfp8"],
)
def test_bert_products_take_one_dtype_through_with_policy_and_autocast(transformers, policy):
    # One engine decides: BERT's linen module through `with_policy` and its
    # apply function through `autocast` lower to the same operand dtypes in
    # every product; under `mixed_bfloat16`, those of Hugging Face's own
    # `dtype=bfloat16`.
    config = transformers.BertConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32,
    )  # fmt: skip
    model = transformers.FlaxBertModel(config, seed=0)
    variables = {"params": model.params}
    ids = (jnp.arange(2 * 16, dtype=jnp.int32).reshape(2, 16) * 7) % 64
    mask, types, positions = jnp.ones_like(ids), jnp.zeros_like(ids), jnp.arange(16)[None]

    def lowered_products(apply):
        def forward(variables):
            out = apply(variables, ids, mask, types, positions, None, deterministic=True)
            return out.last_hidden_state

        text = jax.jit(forward).lower(variables).as_text()
        return sorted(op.operand_types for op in contractions(text))

    through_with_policy = lowered_products(jmp.with_policy(model.module.apply, policy))
    through_autocast = lowered_products(jmp.autocast(model.module.apply, policy))
    assert through_with_policy == through_autocast
    assert len(through_with_policy) >= 8  # q, k, v, scores, values, out, MLP, pooler
    if policy == "mixed_bfloat16":
        own = transformers.FlaxBertModel(config, seed=0, dtype=jnp.bfloat16).module
        own_products = lowered_products(own.apply)
        assert through_with_policy == own_products  # every one bf16 x bf16
        assert set(own_products) == {("bf16", "bf16")}


def test_gpt2_cached_decoding_under_with_policy(transformers):
    # `with_policy(module.apply)` runs the model's `init` abstractly to learn its
    # parameters' dtypes; a decode step's arguments cannot initialise GPT-2
    # (its cache must exist): what `with_policy(module.init)`, which made the
    # cache, recorded for the same parameters serves. The module holds its
    # config, so it cannot be hashed: its records are kept by identity.
    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=16)
    model = transformers.FlaxGPT2LMHeadModel(config, seed=0)
    module, length = model.module, 8
    init_args = (jnp.ones((1, length), "i4"), jnp.ones((1, length), "i4"),
                 jnp.arange(length)[None])  # fmt: skip
    cache = jmp.with_policy(module.init, "mixed_bfloat16")(
        jax.random.key(0), *init_args, init_cache=True
    )["cache"]
    step = (jnp.array([[1]]), jnp.zeros((1, length), "i4").at[:, 0].set(1), jnp.array([[0]]))
    apply = jmp.with_policy(module.apply, "mixed_bfloat16")
    out, state = apply({"params": model.params, "cache": cache}, *step, init_cache=False,
                       deterministic=True, mutable=["cache"])  # fmt: skip
    full = module.apply({"params": model.params}, *step[:1], jnp.ones((1, 1), "i4"), step[2])
    assert out.logits.dtype == jnp.float32
    assert jax.tree.map(lambda x: x.dtype, state["cache"]) == jax.tree.map(lambda x: x.dtype, cache)
    np.testing.assert_allclose(out.logits, full.logits, atol=0.05)
