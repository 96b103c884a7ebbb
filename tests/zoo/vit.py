"""A Vision Transformer: patch convolution, class token, learned position embeddings."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

DIM, HEADS, LAYERS, PATCH, SIZE, CLASSES, BATCH = 16, 2, 1, 4, 8, 4, 8


class EncoderBlock(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.LayerNorm(dtype=self.dtype)(x)
        x = x + nn.MultiHeadDotProductAttention(HEADS, dtype=self.dtype, deterministic=True)(h, h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        return x + nn.Dense(DIM, dtype=self.dtype)(nn.gelu(nn.Dense(2 * DIM, dtype=self.dtype)(h)))


class ViT(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, images):
        x = nn.Conv(DIM, (PATCH, PATCH), strides=PATCH, padding="VALID", dtype=self.dtype)(images)
        b, h, w, c = x.shape
        x = x.reshape(b, h * w, c)
        cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
        pos = self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w + 1, c))
        x, cls, pos = nn.dtypes.promote_dtype(x, cls, pos, dtype=self.dtype)
        x = jnp.concatenate([jnp.tile(cls, (b, 1, 1)), x], axis=1) + pos
        for _ in range(LAYERS):
            x = EncoderBlock(dtype=self.dtype)(x)
        x = nn.LayerNorm(dtype=self.dtype)(x[:, 0])
        return nn.Dense(CLASSES, dtype=self.dtype)(x)


def data():
    rng = np.random.default_rng(3)
    x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return {"init": ((x,), {}), "batch": {"x": x, "y": y}}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


LINEN = [LinenSpec("vit", ViT, data, loss)]
