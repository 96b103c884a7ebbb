"""A variational autoencoder: the reparameterisation noise drawn with `self.make_rng("sample")`."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from zoo import LinenSpec

DIM, HIDDEN, LATENT, BATCH = 16, 32, 4, 8


class VAE(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x):
        h = nn.relu(nn.Dense(HIDDEN, dtype=self.dtype)(x))
        mean = nn.Dense(LATENT, dtype=self.dtype)(h)
        logvar = nn.Dense(LATENT, dtype=self.dtype)(h)
        noise = jax.random.normal(self.make_rng("sample"), mean.shape)
        z = mean + jnp.exp(0.5 * logvar) * noise
        h = nn.relu(nn.Dense(HIDDEN, dtype=self.dtype)(z))
        return nn.Dense(DIM, dtype=self.dtype)(h), mean, logvar


def data():
    rng = np.random.default_rng(5)
    protos = rng.random((4, DIM)) < 0.5
    x = protos[rng.integers(0, 4, BATCH)] ^ (rng.random((BATCH, DIM)) < 0.05)
    x = x.astype(np.float32)
    return {"init": ((x,), {}), "batch": {"x": x}}


def loss(apply, variables, batch, rng):
    logits, mean, logvar = jax.tree.map(
        lambda a: a.astype(jnp.float32), apply(variables, batch["x"], rngs={"sample": rng})
    )
    recon = optax.sigmoid_binary_cross_entropy(logits, batch["x"]).sum(-1)
    kl = 0.5 * jnp.sum(jnp.exp(logvar) + mean**2 - 1.0 - logvar, axis=-1)
    return jnp.mean(recon + kl), {}


LINEN = [LinenSpec("vae", VAE, data, loss, init_rngs=("sample",))]
