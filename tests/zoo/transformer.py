"""A pre-norm Transformer LM: blocks under `nn.scan` + `nn.remat`, LayerScale (CaiT/ConvNeXt).

Linen, and NNX with `nnx.scan` over `nnx.vmap`-created blocks.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo import LinenSpec, NnxSpec

VOCAB, DIM, HEADS, LAYERS, BATCH, LENGTH = 16, 16, 2, 2, 8, 8


class LayerScale(nn.Module):
    """`x * gamma`, a learned per-channel scale initialised small (Touvron et al., 2021)."""

    init_value: float = 0.1
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        gamma = self.param("gamma", nn.initializers.constant(self.init_value), (x.shape[-1],))
        x, gamma = nn.dtypes.promote_dtype(x, gamma, dtype=self.dtype)
        return x * gamma


class Block(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x, _):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.SelfAttention(HEADS, dtype=self.dtype, deterministic=True)(h, mask=mask)
        x = x + LayerScale(dtype=self.dtype)(h)
        h = nn.LayerNorm(dtype=self.dtype)(x)
        h = nn.Dense(DIM, dtype=self.dtype)(nn.gelu(nn.Dense(4 * DIM, dtype=self.dtype)(h)))
        return x + LayerScale(dtype=self.dtype)(h), None


class TransformerLM(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, dtype=self.dtype)(tokens)
        blocks = nn.scan(
            nn.remat(Block),
            variable_axes={"params": 0},
            split_rngs={"params": True},
            length=LAYERS,
        )
        x, _ = blocks(dtype=self.dtype, name="blocks")(x, None)
        x = nn.LayerNorm(dtype=self.dtype)(x)
        return nn.Dense(VOCAB, dtype=self.dtype, name="head")(x)


def data():
    # Next-token prediction on sequences counting up by a per-row stride.
    rng = np.random.default_rng(2)
    start, stride = rng.integers(0, VOCAB, (BATCH, 1)), rng.integers(1, 4, (BATCH, 1))
    seq = ((start + stride * np.arange(LENGTH + 1)) % VOCAB).astype(np.int32)
    return {"init": ((seq[:, :-1],), {}), "batch": {"x": seq[:, :-1], "y": seq[:, 1:]}}


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


def loss(apply, variables, batch, rng):
    del rng
    return _ce(apply(variables, batch["x"]), batch["y"]), {}


# The policies keep the output layer in float32 by a rule, a common choice for
# the logits: its matmul, forward and two gradients, keeps float32 operands.
HEAD_F32 = {"head": "f32"}
LINEN = [
    LinenSpec(
        "transformer_scan",
        TransformerLM,
        data,
        loss,
        rules=HEAD_F32,
        kept_f32={"mixed_bfloat16": 3, "mixed_float16": 3},
    )
]


class NnxBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.norm1 = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            HEADS, DIM, dtype=dtype, decode=False, deterministic=True, rngs=rngs
        )
        self.gamma1 = nnx.Param(jnp.full((DIM,), 0.1))
        self.norm2 = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.up = nnx.Linear(DIM, 4 * DIM, dtype=dtype, rngs=rngs)
        self.down = nnx.Linear(4 * DIM, DIM, dtype=dtype, rngs=rngs)
        self.gamma2 = nnx.Param(jnp.full((DIM,), 0.1))
        self.dtype = dtype

    def __call__(self, x):
        mask = nnx.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32))
        h, g = nnx.nn.dtypes.promote_dtype(
            (self.attn(self.norm1(x), mask=mask), self.gamma1[...]), dtype=self.dtype
        )
        x = x + h * g
        h = self.down(nnx.gelu(self.up(self.norm2(x))))
        h, g = nnx.nn.dtypes.promote_dtype((h, self.gamma2[...]), dtype=self.dtype)
        return x + h * g


class NnxTransformerLM(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.embed = nnx.Embed(VOCAB, DIM, dtype=dtype, rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs):
            return NnxBlock(rngs, dtype)

        self.blocks = make_blocks(rngs)
        self.norm = nnx.LayerNorm(DIM, dtype=dtype, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        @nnx.remat
        def forward(x, block):
            return block(x)

        x = forward(self.embed(tokens), self.blocks)
        return self.head(self.norm(x))


def nnx_loss(model, batch):
    return _ce(model(batch["x"]), batch["y"])


# Not jmp_policy's: Flax NNX attention calls jax.nn.dot_product_attention, which
# asks float16 queries for the F16_F16_F32 dot algorithm, and JAX before 0.12.1
# refuses to lower that for a CPU under jit (eagerly it falls back); the same
# model written by hand with dtype=jnp.float16 fails identically. Under a matmul dtype
# ("p=f32,c=f16,o=f32,m=f16") or autocast, jmp_policy makes those products
# itself, and they run.
CPU_F16 = "The precision 'F16_F16_F32' is not supported by dot_general on CPU"
NNX = [
    NnxSpec(
        "transformer_scan_nnx",
        NnxTransformerLM,
        data,
        nnx_loss,
        cpu_error={"mixed_float16": CPU_F16},
    )
]
