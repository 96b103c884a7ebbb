"""A mixture-of-experts layer: softmax router, `lax.top_k` routing, einsum dispatch and combine."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, BATCH, LENGTH = 16, 16, 32, 4, 2, 8, 8


class MoE(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal(batch_axis=(0,))
        w_in = self.param("w_in", init, (EXPERTS, DIM, HIDDEN))
        w_out = self.param("w_out", init, (EXPERTS, HIDDEN, DIM))
        x, w_in, w_out = nn.dtypes.promote_dtype(x, w_in, w_out, dtype=self.dtype)
        probs = jax.nn.softmax(nn.Dense(EXPERTS, use_bias=False, dtype=self.dtype)(x))
        gates, experts = jax.lax.top_k(probs, TOP_K)  # [b, t, k]
        gates = gates / gates.sum(-1, keepdims=True)
        dispatch = jax.nn.one_hot(experts, EXPERTS, dtype=x.dtype)  # [b, t, k, e]
        combine = jnp.einsum("btk,btke->bte", gates, dispatch)
        expert_in = jnp.einsum("btd,btke->ebtd", x, dispatch)
        h = nn.gelu(jnp.einsum("ebtd,edh->ebth", expert_in, w_in))
        expert_out = jnp.einsum("ebth,ehd->ebtd", h, w_out)
        # Switch Transformer's load-balancing loss: fraction routed x mean probability.
        load = jnp.mean(dispatch.sum(2), axis=(0, 1)) * jnp.mean(probs, axis=(0, 1))
        self.sow("intermediates", "aux_loss", EXPERTS * load.sum())
        return jnp.einsum("ebtd,bte->btd", expert_out, combine)


class MoEClassifier(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(VOCAB, DIM, dtype=self.dtype)(tokens)
        x = x + MoE(dtype=self.dtype)(nn.LayerNorm(dtype=self.dtype)(x))
        return nn.Dense(VOCAB, dtype=self.dtype)(x)


def data():
    rng = np.random.default_rng(6)
    x = rng.integers(0, VOCAB, (BATCH, LENGTH)).astype(np.int32)
    return {"init": ((x,), {}), "batch": {"x": x, "y": ((x * 3 + 1) % VOCAB).astype(np.int32)}}


def loss(apply, variables, batch, rng):
    del rng
    logits, state = apply(variables, batch["x"], mutable=["intermediates"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    (aux,) = state["intermediates"]["MoE_0"]["aux_loss"]
    return ce.mean() + 0.01 * aux.astype(jnp.float32), {}


LINEN = [LinenSpec("moe", MoEClassifier, data, loss)]
