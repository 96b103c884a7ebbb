"""A model whose own modules do float32 maths: a hand-written RMSNorm and float32 output logits.

Both are common in LLM code (T5's and Llama's RMSNorm compute their
statistics in float32; many LMs compute the output logits in float32).
They have no `dtype` attribute: the hand config keeps them in float32, and so
does every policy: the logits' product widens its half operand, which the
program shows (`jmp_policy.engine.intent`).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

VOCAB, DIM, BATCH, LENGTH = 16, 16, 8, 8


class RMSNorm(nn.Module):
    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],))
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + 1e-6)
        return (x32 * scale).astype(x.dtype)


class Float32Logits(nn.Module):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], VOCAB))
        return jnp.dot(x.astype(jnp.float32), kernel.astype(jnp.float32))


class Model(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, dtype=self.dtype)(tokens)
        x = x + nn.Dense(DIM, dtype=self.dtype)(
            nn.gelu(nn.Dense(2 * DIM, dtype=self.dtype)(RMSNorm()(x)))
        )
        return Float32Logits()(RMSNorm()(x))


def data():
    rng = np.random.default_rng(10)
    x = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    return {"init": ((x,), {}), "batch": {"x": x, "y": ((5 * x + 3) % VOCAB).astype(np.int32)}}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["x"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


# Float32Logits' matmul, forward and its two gradients, stays float32 under
# every policy, as in its hand-written bf16 config: the author widens its
# operand from the half activation (`x.astype(jnp.float32)`).
KEPT = {
    variant: 3
    for variant in ("handwritten_bf16", "mixed_bfloat16", "mixed_float16",
                    "p=f32,c=bf16,o=f32,m=bf16", "mixed_float8")
}  # fmt: skip
LINEN = [LinenSpec("f32_math", Model, data, loss, kept_f32=KEPT)]
