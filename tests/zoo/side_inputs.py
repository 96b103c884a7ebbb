"""A text classifier with integer and boolean side inputs: token type ids and a padding mask."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

VOCAB, TYPES, DIM, HEADS, CLASSES, BATCH, LENGTH = 16, 2, 16, 2, 3, 8, 8


class Classifier(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens, type_ids, mask):
        x = nn.Embed(VOCAB, DIM, dtype=self.dtype)(tokens)
        x = x + nn.Embed(TYPES, DIM, dtype=self.dtype)(type_ids)
        attn_mask = nn.make_attention_mask(mask, mask)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.SelfAttention(HEADS, dtype=self.dtype, deterministic=True)(h, mask=attn_mask)
        x = x + nn.Dense(DIM, dtype=self.dtype)(nn.relu(nn.Dense(2 * DIM, dtype=self.dtype)(x)))
        # Mean over the real tokens only.
        pooled = jnp.sum(jnp.where(mask[..., None], x, 0), axis=1) / jnp.sum(mask, 1, keepdims=True)
        return nn.Dense(CLASSES, dtype=self.dtype)(pooled)


def data():
    rng = np.random.default_rng(11)
    tokens = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    lengths = rng.integers(3, LENGTH + 1, BATCH)
    mask = np.arange(LENGTH)[None] < lengths[:, None]
    type_ids = (np.arange(LENGTH)[None] >= lengths[:, None] // 2).astype(np.int32)
    y = (np.where(mask, tokens, 0).sum(1) % CLASSES).astype(np.int32)
    batch = {"tokens": tokens, "type_ids": type_ids, "mask": mask, "y": y}
    return {"init": ((tokens, type_ids, mask), {}), "batch": batch}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["tokens"], batch["type_ids"], batch["mask"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return ce.mean(), {}


LINEN = [LinenSpec("side_inputs", Classifier, data, loss)]
