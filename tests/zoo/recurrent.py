"""Sequence models with `nn.RNN`: an LSTM tagger, a bidirectional GRU tagger (linen), an NNX LSTM."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo import LinenSpec, NnxSpec

VOCAB, HIDDEN, BATCH, LENGTH = 12, 16, 8, 8


def data():
    # Tag each token with (token + previous token) mod VOCAB: needs the recurrence.
    rng = np.random.default_rng(1)
    x = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    y = (x + np.pad(x, ((0, 0), (1, 0)))[:, :-1]) % VOCAB
    return {"init": ((x,), {}), "batch": {"x": x, "y": y.astype(np.int32)}}


def _ce(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), y).mean()


class LSTMTagger(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, HIDDEN, dtype=self.dtype)(tokens)
        x = nn.RNN(nn.LSTMCell(HIDDEN, dtype=self.dtype))(x)
        return nn.Dense(VOCAB, dtype=self.dtype)(x)


class BiGRUTagger(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, HIDDEN, dtype=self.dtype)(tokens)
        x = nn.Bidirectional(
            nn.RNN(nn.GRUCell(HIDDEN, dtype=self.dtype)),
            nn.RNN(nn.GRUCell(HIDDEN, dtype=self.dtype)),
        )(x)
        return nn.Dense(VOCAB, dtype=self.dtype)(x)


def loss(apply, variables, batch, rng):
    del rng
    return _ce(apply(variables, batch["x"]), batch["y"]), {}


LINEN = [
    LinenSpec("lstm", LSTMTagger, data, loss, learning_rate=1e-2),
    LinenSpec("bigru", BiGRUTagger, data, loss, learning_rate=1e-2),
]


class NnxLSTMTagger(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.embed = nnx.Embed(VOCAB, HIDDEN, dtype=dtype, rngs=rngs)
        self.rnn = nnx.RNN(nnx.LSTMCell(HIDDEN, HIDDEN, dtype=dtype, rngs=rngs))
        self.head = nnx.Linear(HIDDEN, VOCAB, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.rnn(self.embed(tokens)))


def nnx_loss(model, batch):
    return _ce(model(batch["x"]), batch["y"])


NNX = [
    NnxSpec(
        "lstm_nnx",
        NnxLSTMTagger,
        data,
        nnx_loss,
        learning_rate=1e-2,
    )
]
