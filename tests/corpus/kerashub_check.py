"""keras-hub (PyPI `keras-hub` 0.32, Keras 3 on its JAX backend): a tiny
`GemmaBackbone`, run functionally by Keras' own `stateless_call`, under
`autocast` against Keras' own half config, the `mixed_bfloat16` dtype policy.

`python kerashub_check.py` prints one JSON object: the max abs error of the
backbone's output against float32 (the same weights) for

- `keras_mixed`: the backbone built with `dtype="mixed_bfloat16"`;
- `autocast[SPEC]`: `jmp_policy.autocast(stateless_call, SPEC)` on the
  float32 backbone;

at `len1024` (one sequence, positions 0..1023, the backbone's own call) and
`pos8192` (a window of tokens at positions 8192.., the way keras-hub decodes:
its `GemmaCausalLM.call_with_cache` with `cache_update_index=8192`; the
backbone's own call takes no start position). The window's key/value cache of
positions 0..8191 is filled once, by the float32 model in chunks; Keras' mixed
model gets it in its cache dtype (bfloat16), `autocast` in float32, as each
model's own cache is. keras-hub's `RotaryEmbedding` computes its angles
(`einsum("bi,j->bij", positions, inverse_freq)`) in float32 on purpose.

`train`: one Adam step through `autocast(stateless_call, "mixed_bfloat16")`
of the causal LM (logits through the tied embedding) with
`jmp_policy.loss_scaled` and a `DynamicLossScale(2**15)`: whether the loss,
the gradients and the update are finite.

Run by tests/test_kerashub.py in a process of its own, with keras-hub and
Keras first on the path (`./run` installs them apart, in .venv/kerashub) and
`KERAS_BACKEND=jax`.
"""

from __future__ import annotations

import json
import os
import sys
import time

os.environ["KERAS_BACKEND"] = "jax"
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import keras  # noqa: E402
import keras_hub  # noqa: E402
import optax  # noqa: E402

import jmp_policy as jmp  # noqa: E402

from corpus import checks  # noqa: E402

POLICIES = ("mixed_bfloat16", "mixed_bfloat16,m=bf16", "mixed_float8")
CONFIG = dict(
    vocabulary_size=256,
    num_layers=2,
    num_query_heads=2,
    num_key_value_heads=1,
    hidden_dim=64,
    intermediate_dim=128,
    head_dim=32,
)
LENGTH = 1024  # len1024: positions 0..LENGTH-1
START, WINDOW, CHUNK = 8192, 64, 1024  # pos8192: positions START..START+WINDOW-1
TRAIN_B, TRAIN_T = 2, 128


def backbone(dtype: str) -> keras_hub.models.GemmaBackbone:
    keras.utils.set_random_seed(0)
    return keras_hub.models.GemmaBackbone(**CONFIG, dtype=dtype)


def state(model: keras.Model) -> tuple[list, list]:
    return [v.value for v in model.trainable_variables], [
        v.value for v in model.non_trainable_variables
    ]


def full(model: keras.Model):
    """`(tv, ntv, inputs) -> output` of the backbone's own call."""

    def forward(tv, ntv, inputs):
        return model.stateless_call(tv, ntv, inputs)[0]

    return forward


def windowed(lm: keras_hub.models.GemmaCausalLM):
    """`(tv, ntv, tokens, cache) -> (hidden, cache)`: keras-hub's own cached call
    of the tokens at positions START.., as its `generate` runs it."""
    model = lm.backbone

    def forward(tv, ntv, tokens, cache):
        mapping = list(zip(model.trainable_variables, tv)) + list(
            zip(model.non_trainable_variables, ntv)
        )
        with keras.StatelessScope(state_mapping=mapping):
            _, hidden, cache = lm.call_with_cache(tokens, cache, START)
        return hidden, cache

    return forward


def prefix_cache(lm: keras_hub.models.GemmaCausalLM, tv, ntv, tokens) -> jax.Array:
    """The float32 model's key/value cache of positions 0..START-1, by chunks."""
    model = lm.backbone

    @jax.jit
    def chunk(tv, ntv, tokens, cache, index):
        mapping = list(zip(model.trainable_variables, tv)) + list(
            zip(model.non_trainable_variables, ntv)
        )
        with keras.StatelessScope(state_mapping=mapping):
            return lm.call_with_cache(tokens, cache, index)[2]

    shape = (1, CONFIG["num_layers"], 2, START + WINDOW, 1, CONFIG["head_dim"])
    cache = jnp.zeros(shape, jnp.float32)
    for lo in range(0, START, CHUNK):
        cache = chunk(tv, ntv, tokens[:, lo : lo + CHUNK], cache, jnp.int32(lo))
    return cache


def train_step(lm: keras_hub.models.GemmaCausalLM, policy: str) -> dict:
    tv, ntv = state(lm)
    logits_of = jmp.autocast(lambda tv, ntv, x: lm.stateless_call(tv, ntv, x), policy)
    tx = jmp.loss_scaled(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(tv)
    tokens = jax.random.randint(jax.random.key(2), (TRAIN_B, TRAIN_T + 1), 0, 256)
    inputs = {
        "token_ids": tokens[:, :-1],
        "padding_mask": jnp.ones((TRAIN_B, TRAIN_T), jnp.int32),
    }

    @jax.jit
    def step(tv, ntv, opt_state):
        scale = jmp.get_loss_scale(opt_state)

        def loss_fn(tv):
            logits, _ = logits_of(tv, ntv, inputs)
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), tokens[:, 1:]
            ).mean()
            return scale.scale(loss), loss

        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
        updates, opt_state = tx.update(grads, opt_state, tv)
        return loss, scale.unscale(grads), updates, opt_state

    loss, grads, updates, opt_state = step(tv, ntv, opt_state)
    return {
        "policy": policy,
        **checks.step_figures(loss, grads, updates, opt_state),
    }


def main() -> int:
    begin = time.perf_counter()
    ref = backbone("float32")
    mixed = backbone("mixed_bfloat16")
    mixed.set_weights(ref.get_weights())
    tv, ntv = state(ref)
    tv_mixed, ntv_mixed = state(mixed)
    assert all(a.dtype == b.dtype for a, b in zip(tv, tv_mixed)), "mixed weights not float32"
    lm = keras_hub.models.GemmaCausalLM(backbone=ref, preprocessor=None)
    lm_mixed = keras_hub.models.GemmaCausalLM(backbone=mixed, preprocessor=None)

    tokens = jax.random.randint(jax.random.key(1), (1, START + WINDOW), 0, 256)
    inputs = {
        "token_ids": tokens[:, :LENGTH],
        "padding_mask": jnp.ones((1, LENGTH), jnp.int32),
    }
    window = tokens[:, START:]
    cache = prefix_cache(lm, tv, ntv, tokens)

    want_full = jax.jit(full(ref))(tv, ntv, inputs)
    want_window, _ = jax.jit(windowed(lm))(tv, ntv, window, cache)
    results: dict = {}
    got_full = jax.jit(full(mixed))(tv_mixed, ntv_mixed, inputs)
    got_window, _ = jax.jit(windowed(lm_mixed))(
        tv_mixed, ntv_mixed, window, cache.astype(jnp.bfloat16)
    )
    results["keras_mixed"] = {
        "len1024": checks.max_error(got_full, want_full),
        "pos8192": checks.max_error(got_window, want_window),
        "output_dtype": str(got_full.dtype),
    }
    for policy in POLICIES:
        got_full = jax.jit(jmp.autocast(full(ref), policy))(tv, ntv, inputs)
        got_window, _ = jax.jit(jmp.autocast(windowed(lm), policy))(tv, ntv, window, cache)
        results[f"autocast[{policy}]"] = {
            "len1024": checks.max_error(got_full, want_full),
            "pos8192": checks.max_error(got_window, want_window),
            "output_dtype": str(got_full.dtype),
        }
    results["reference_scale"] = {
        "len1024": float(jnp.max(jnp.abs(want_full))),
        "pos8192": float(jnp.max(jnp.abs(want_window))),
    }
    results["train"] = train_step(lm, "mixed_bfloat16")
    results["seconds"] = round(time.perf_counter() - begin, 1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
