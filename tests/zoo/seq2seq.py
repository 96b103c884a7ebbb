"""An encoder-decoder Transformer: cross-attention, greedy decoding through `mutable=["cache"]`.

The decoder's self-attention is `nn.SelfAttention(decode=self.decode)`: with
`decode=True` it keeps its keys and values in the "cache" collection and
takes one token per call, as in Flax's WMT example. Task: reverse the source.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

VOCAB, DIM, HEADS, BATCH, LENGTH, BOS = 12, 16, 2, 8, 8, 0


class EncoderDecoder(nn.Module):
    dtype: Any = None
    decode: bool = False

    def setup(self):
        dense = lambda n: nn.Dense(n, dtype=self.dtype)
        norm = lambda: nn.LayerNorm(dtype=self.dtype)
        self.embed = nn.Embed(VOCAB, DIM, dtype=self.dtype)
        self.pos = self.param("pos", nn.initializers.normal(0.02), (LENGTH, DIM))
        self.enc_norm1, self.enc_norm2, self.enc_out = norm(), norm(), norm()
        self.enc_attn = nn.SelfAttention(HEADS, dtype=self.dtype, deterministic=True)
        self.enc_up, self.enc_down = dense(2 * DIM), dense(DIM)
        self.dec_norm1, self.dec_norm2, self.dec_norm3 = norm(), norm(), norm()
        self.self_attn = nn.SelfAttention(
            HEADS, dtype=self.dtype, deterministic=True, decode=self.decode
        )
        self.cross_attn = nn.MultiHeadDotProductAttention(
            HEADS, dtype=self.dtype, deterministic=True
        )
        self.dec_up, self.dec_down, self.head = dense(2 * DIM), dense(DIM), dense(VOCAB)
        if self.decode:
            # One token per call: the position is a counter in the cache.
            self.pos_index = self.variable("cache", "pos_index", lambda: jnp.array(0, jnp.int32))

    def _positions(self, length: int):
        pos = jnp.asarray(self.pos, self.dtype)
        if not self.decode or self.is_initializing():
            return pos[:length]
        i = self.pos_index.value
        self.pos_index.value = i + 1
        return jax.lax.dynamic_slice_in_dim(pos, i, 1)

    def encode(self, src):
        x = self.embed(src) + jnp.asarray(self.pos, self.dtype)[: src.shape[1]]
        x = x + self.enc_attn(self.enc_norm1(x))
        x = x + self.enc_down(nn.gelu(self.enc_up(self.enc_norm2(x))))
        return self.enc_out(x)

    def decode_step(self, encoded, tgt):
        x = self.embed(tgt) + self._positions(tgt.shape[1])
        mask = None if self.decode else nn.make_causal_mask(tgt)
        x = x + self.self_attn(self.dec_norm1(x), mask=mask)
        x = x + self.cross_attn(self.dec_norm2(x), encoded)
        x = x + self.dec_down(nn.gelu(self.dec_up(self.dec_norm3(x))))
        return self.head(x)

    def __call__(self, src, tgt):
        return self.decode_step(self.encode(src), tgt)


def make(dtype=None):
    return EncoderDecoder(dtype=dtype)


def data():
    rng = np.random.default_rng(8)
    src = rng.integers(1, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    tgt = src[:, ::-1]
    tgt_in = np.concatenate([np.full((BATCH, 1), BOS), tgt[:, :-1]], axis=1).astype(np.int32)
    batch = {"src": src, "tgt_in": tgt_in, "tgt": np.ascontiguousarray(tgt)}
    return {"init": ((src, tgt_in), {}), "batch": batch}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["src"], batch["tgt_in"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["tgt"]).mean(), {}


def greedy(apply, decoder_init, decoder_apply, params, src):
    """`(cached, uncached)` greedy decodes of `src`, each `[batch, LENGTH]` int32.

    `apply` runs the training model (full causal decoder, every prefix again
    for each token); `decoder_init`/`decoder_apply` are the `decode=True`
    model's, whose "cache" collection carries the keys and values.
    """
    b = src.shape[0]
    encoded = apply({"params": params}, src, method="encode")
    cache = decoder_init(jax.random.key(0), src, jnp.zeros((b, LENGTH), jnp.int32))["cache"]
    bos = jnp.full((b,), BOS, jnp.int32)

    def cached_step(i, carry):
        cache, token, out = carry
        logits, variables = decoder_apply(
            {"params": params, "cache": cache}, encoded, token[:, None],
            method="decode_step", mutable=["cache"],
        )  # fmt: skip
        token = jnp.argmax(logits[:, 0], -1).astype(jnp.int32)
        return variables["cache"], token, out.at[:, i].set(token)

    def uncached_step(i, out):
        tgt_in = jnp.concatenate([bos[:, None], out[:, :-1]], axis=1)
        logits = apply({"params": params}, encoded, tgt_in, method="decode_step")
        return out.at[:, i].set(jnp.argmax(logits[:, i], -1).astype(jnp.int32))

    zeros = jnp.zeros((b, LENGTH), jnp.int32)
    cached = jax.lax.fori_loop(0, LENGTH, cached_step, (cache, bos, zeros))[2]
    uncached = jax.lax.fori_loop(0, LENGTH, uncached_step, zeros)
    return cached, uncached


LINEN = [LinenSpec("seq2seq", make, data, loss)]
