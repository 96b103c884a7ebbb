"""A complex-valued network (complex64 Dense layers, as in signal processing) with a real head."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo import LinenSpec, NnxSpec

DIM, HIDDEN, CLASSES, BATCH = 8, 16, 4, 8
C64 = jnp.complex64


def mod_sigmoid(z):
    """A phase-preserving activation: z scaled by sigmoid(|z|)."""
    return z * jax.nn.sigmoid(jnp.abs(z) - 1.0)


class ComplexNet(nn.Module):
    dtype: Any = None  # the real head's: complex layers stay complex64

    @nn.compact
    def __call__(self, z):
        z = mod_sigmoid(nn.Dense(HIDDEN, dtype=C64, param_dtype=C64)(z))
        z = mod_sigmoid(nn.Dense(HIDDEN, dtype=C64, param_dtype=C64)(z))
        features = jnp.concatenate([z.real, z.imag], axis=-1)
        return nn.Dense(CLASSES, dtype=self.dtype)(features)


def data():
    # The class is the quadrant of the phase of a fixed projection: needs the imaginary part.
    rng = np.random.default_rng(9)
    z = (rng.standard_normal((BATCH, DIM)) + 1j * rng.standard_normal((BATCH, DIM))).astype(
        np.complex64
    )
    proj = z @ np.exp(1j * np.linspace(0, np.pi, DIM))
    y = (((np.angle(proj) + np.pi) // (np.pi / 2)) % CLASSES).astype(np.int32)
    return {"init": ((z,), {}), "batch": {"z": z, "y": y}}


def loss(apply, variables, batch, rng):
    del rng
    logits = apply(variables, batch["z"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean(), {}


# The complex matmuls (forward 2, backward: the first layer's kernel gradient,
# the second's kernel and input gradients) have no half-precision type.
COMPLEX_DOTS = 5
KEPT = {"mixed_bfloat16": COMPLEX_DOTS, "mixed_float16": COMPLEX_DOTS,
        "autocast": COMPLEX_DOTS, "handwritten_bf16": COMPLEX_DOTS}  # fmt: skip

LINEN = [LinenSpec("complex", ComplexNet, data, loss, kept_f32=KEPT)]


class NnxComplexNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        self.l1 = nnx.Linear(DIM, HIDDEN, dtype=C64, param_dtype=C64, rngs=rngs)
        self.l2 = nnx.Linear(HIDDEN, HIDDEN, dtype=C64, param_dtype=C64, rngs=rngs)
        self.head = nnx.Linear(2 * HIDDEN, CLASSES, dtype=dtype, rngs=rngs)

    def __call__(self, z):
        z = mod_sigmoid(self.l2(mod_sigmoid(self.l1(z))))
        return self.head(jnp.concatenate([z.real, z.imag], axis=-1))


def nnx_loss(model, batch):
    logits = model(batch["z"]).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()


NNX = [NnxSpec("complex_nnx", NnxComplexNet, data, nnx_loss, kept_f32=KEPT)]
