"""A diffusion denoiser (DDPM epsilon prediction) with a sinusoidal timestep embedding in plain jnp.

The timesteps are given as floats, as in most diffusion code bases: the
embedding multiplies them by frequencies down to 1/10000, so a timestep of
999 must stay exact (bfloat16 holds integers exactly only up to 256).
Linen and NNX.
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo import LinenSpec, NnxSpec

DIM, HIDDEN, EMBED, BATCH, T = 8, 32, 16, 8, 1000


def timestep_embedding(t, dim: int = EMBED):
    """The Transformer/DDPM sinusoidal embedding of (float) timesteps `t`."""
    half = dim // 2
    freqs = jnp.exp(-math.log(10000.0) * jnp.arange(half) / half)
    args = t[:, None] * freqs[None]
    return jnp.concatenate([jnp.sin(args), jnp.cos(args)], axis=-1)


class Denoiser(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x_t, t):
        emb = nn.Dense(HIDDEN, dtype=self.dtype)(timestep_embedding(t))
        h = nn.Dense(HIDDEN, dtype=self.dtype)(x_t) + nn.silu(emb)
        h = nn.Dense(HIDDEN, dtype=self.dtype)(nn.silu(h))
        return nn.Dense(DIM, dtype=self.dtype)(nn.silu(h))


def data():
    rng = np.random.default_rng(4)
    betas = np.linspace(1e-4, 0.02, T)
    alpha_bar = np.cumprod(1.0 - betas)
    x0 = rng.standard_normal((BATCH, DIM))
    t = np.array([999, 998, 997, 513, 3, 260, 700, 100])  # late steps need exact timesteps
    eps = rng.standard_normal((BATCH, DIM))
    ab = alpha_bar[t][:, None]
    x_t = np.sqrt(ab) * x0 + np.sqrt(1 - ab) * eps
    batch = {
        "x_t": x_t.astype(np.float32),
        "t": t.astype(np.float32),
        "eps": eps.astype(np.float32),
    }
    return {"init": ((batch["x_t"], batch["t"]), {}), "batch": batch}


def loss(apply, variables, batch, rng):
    del rng
    pred = apply(variables, batch["x_t"], batch["t"]).astype(jnp.float32)
    return jnp.mean((pred - batch["eps"]) ** 2), {}


# The root has a `dtype` field, as most Flax models: its timesteps reach the
# plain-jnp embedding as given (no module boundary casts), with no rule.
LINEN = [LinenSpec("diffusion", Denoiser, data, loss)]


class NnxDenoiser(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.t_proj = nnx.Linear(EMBED, HIDDEN, dtype=dtype, rngs=rngs)
        self.x_proj = nnx.Linear(DIM, HIDDEN, dtype=dtype, rngs=rngs)
        self.hidden = nnx.Linear(HIDDEN, HIDDEN, dtype=dtype, rngs=rngs)
        self.out = nnx.Linear(HIDDEN, DIM, dtype=dtype, rngs=rngs)

    def __call__(self, x_t, t):
        h = self.x_proj(x_t) + nnx.silu(self.t_proj(timestep_embedding(t)))
        return self.out(nnx.silu(self.hidden(nnx.silu(h))))


def nnx_loss(model, batch):
    pred = model(batch["x_t"], batch["t"]).astype(jnp.float32)
    return jnp.mean((pred - batch["eps"]) ** 2)


NNX = [NnxSpec("diffusion_nnx", NnxDenoiser, data, nnx_loss)]
