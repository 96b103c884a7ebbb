"""A message-passing graph network: gathers by edge, `jax.ops.segment_sum` to receivers."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

NODES, EDGES, FEATURES, HIDDEN, CLASSES, ROUNDS = 32, 96, 8, 16, 3, 2


class MessagePassing(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, nodes, senders, receivers):
        h = nn.Dense(HIDDEN, dtype=self.dtype)(nodes)
        for _ in range(ROUNDS):
            messages = nn.relu(
                nn.Dense(HIDDEN, dtype=self.dtype)(
                    jnp.concatenate([h[senders], h[receivers]], axis=-1)
                )
            )
            incoming = jax.ops.segment_sum(messages, receivers, num_segments=nodes.shape[0])
            h = h + nn.relu(
                nn.Dense(HIDDEN, dtype=self.dtype)(jnp.concatenate([h, incoming], axis=-1))
            )
        return nn.Dense(CLASSES, dtype=self.dtype)(h)


def data():
    rng = np.random.default_rng(7)
    nodes = rng.standard_normal((NODES, FEATURES)).astype(np.float32)
    senders = rng.integers(0, NODES, EDGES).astype(np.int32)
    receivers = rng.integers(0, NODES, EDGES).astype(np.int32)
    # A node's class depends on its neighbours' features.
    score = np.zeros(NODES)
    np.add.at(score, receivers, nodes[senders, 0])
    y = np.digitize(score, np.quantile(score, [1 / 3, 2 / 3])).astype(np.int32)
    batch = {"nodes": nodes, "senders": senders, "receivers": receivers, "y": y}
    return {"init": ((nodes, senders, receivers), {}), "batch": batch}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["nodes"], batch["senders"], batch["receivers"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return ce.mean(), {}


LINEN = [LinenSpec("gnn", MessagePassing, data, loss)]
