"""A character-level linen Transformer LM: `jmp-policy doctor --fp8 transformer`'s model.

The same architecture, data and loss as `examples/transformer_lm.py` (so the
figures of both describe one model), shipped for the doctor. The repository's
benchmarks (`benchmarks/`) train it too, through the fields only they set:
`dtype` (Flax's hand-written bfloat16 variant), `dot_general`
(`jmp_policy.half_dot_general` in every matmul) and `dot_general_cls` (Flax's
FP8 ops in the Dense layers and attention projections).
"""

from __future__ import annotations

import argparse
import functools
import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

SEQ_LEN = 32
BATCH = 16
LEARNING_RATE = 3e-3


class Block(nn.Module):
    """A pre-LN Transformer block: causal self-attention then an MLP, each residual."""

    num_heads: int
    mlp_ratio: int = 4
    dtype: Any = None  # None: as the parameters (or as a policy sets it)
    dot_general: Any = None  # None: Flax's default `lax.dot_general`
    dot_general_cls: Any = None  # e.g. flax.linen.fp8_ops.Fp8DirectDotGeneralOp

    @nn.compact
    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        width = x.shape[-1]
        dense = functools.partial(
            nn.Dense,
            dtype=self.dtype,
            dot_general=self.dot_general,
            dot_general_cls=self.dot_general_cls,
        )
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads,
            dtype=self.dtype,
            qkv_dot_general=self.dot_general,
            out_dot_general=self.dot_general,
            qkv_dot_general_cls=self.dot_general_cls,
            out_dot_general_cls=self.dot_general_cls,
            attention_fn=functools.partial(
                nn.dot_product_attention, einsum_dot_general=self.dot_general
            ),
        )(h, mask=mask)
        x = x + h
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.gelu(dense(self.mlp_ratio * width)(h))
        return x + dense(width)(h)


class Embed(nn.Embed):
    """`nn.Embed` that also runs where types hold the tokens' sharding (a mesh
    with explicit axes): JAX's gather cannot infer its result's sharding
    there, so the lookup gives the tokens'."""

    def __call__(self, inputs: jax.Array) -> jax.Array:
        sharding = jax.typeof(inputs).sharding
        if jax.sharding.AxisType.Explicit not in sharding.mesh.axis_types:
            return super().__call__(inputs)
        (embedding,) = nn.dtypes.promote_dtype(self.embedding, dtype=self.dtype, inexact=False)
        spec = [*sharding.spec, *[None] * (inputs.ndim - len(sharding.spec))]
        return embedding.at[inputs].get(out_sharding=jax.sharding.PartitionSpec(*spec, None))


class TransformerLM(nn.Module):
    """Token and position embeddings, `depth` pre-LN blocks, final LayerNorm, logits."""

    vocab_size: int
    width: int = 64
    depth: int = 2
    num_heads: int = 4
    mlp_ratio: int = 4
    max_len: int = SEQ_LEN
    dtype: Any = None
    dot_general: Any = None
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, tokens: jax.Array) -> jax.Array:
        positions = jnp.arange(tokens.shape[-1])
        x = Embed(self.vocab_size, self.width, dtype=self.dtype, name="tok_embed")(tokens)
        x = x + Embed(self.max_len, self.width, dtype=self.dtype, name="pos_embed")(positions)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(
                self.num_heads,
                self.mlp_ratio,
                dtype=self.dtype,
                dot_general=self.dot_general,
                dot_general_cls=self.dot_general_cls,
            )(x, mask)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        dense = functools.partial(
            nn.Dense,
            dtype=self.dtype,
            dot_general=self.dot_general,
            dot_general_cls=self.dot_general_cls,
        )
        return dense(self.vocab_size, name="head")(x)


def make_model(vocab_size: int, **kwargs: Any) -> TransformerLM:
    """The model for a vocabulary of `vocab_size` characters; `kwargs` set its fields."""
    return TransformerLM(vocab_size=vocab_size, **kwargs)


def make_data(
    steps: int, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns `(train_batches, eval_batch, vocab_size)` from the stdlib `argparse` source.

    `train_batches` is int32 `[steps, batch, seq_len + 1]`: random windows of the
    first 90% of the text (inputs `[..., :-1]`, targets `[..., 1:]`);
    `eval_batch` is `[4 * batch, seq_len + 1]`, windows of the last 10%.
    """
    text = inspect.getsource(argparse)  # ships with every Python: no download
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    data = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    rng = np.random.default_rng(seed)
    window = np.arange(seq_len + 1)
    starts = rng.integers(0, len(train) - seq_len - 1, size=(steps, batch))
    eval_starts = rng.integers(0, len(held_out) - seq_len - 1, size=4 * batch)
    return train[starts[..., None] + window], held_out[eval_starts[:, None] + window], len(vocab)


def loss_fn(apply: Callable[..., jax.Array], params: Any, batch: jax.Array) -> jax.Array:
    """Mean next-character cross-entropy in nats (computed in float32)."""
    logits = apply({"params": params}, batch[:, :-1]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def init_params(model: TransformerLM, policy: Any, seed: int = 0) -> Any:
    """The initial parameters, created in the policy's param dtype (cached, as they
    depend only on the model, the param dtype and the seed)."""
    return _init_params(model, np.dtype(jmp_policy.get_policy(policy).param_dtype), seed)


@functools.cache
def _init_params(model: TransformerLM, param_dtype: Any, seed: int) -> Any:
    tokens = jnp.zeros((1, model.max_len), jnp.int32)
    init = jmp_policy.with_policy(
        model.init, jmp_policy.Policy(param_dtype, param_dtype, param_dtype)
    )
    return jax.jit(init)(jax.random.key(seed), tokens)["params"]
