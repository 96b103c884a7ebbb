"""A ResNet-style CNN: convolutions, BatchNorm, residual blocks, Dropout (linen and NNX)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from zoo import LinenSpec, NnxSpec

WIDTH, CLASSES, BATCH, SIZE = 16, 4, 8, 8


class ResBlock(nn.Module):
    features: int
    strides: int = 1
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool):
        norm = lambda **kw: nn.BatchNorm(
            use_running_average=not train, momentum=0.9, dtype=self.dtype, **kw
        )
        y = nn.Conv(self.features, (3, 3), self.strides, use_bias=False, dtype=self.dtype)(x)
        y = nn.relu(norm()(y))
        y = nn.Conv(self.features, (3, 3), use_bias=False, dtype=self.dtype)(y)
        y = norm(scale_init=nn.initializers.zeros)(y)
        if x.shape != y.shape:
            x = nn.Conv(self.features, (1, 1), self.strides, use_bias=False, dtype=self.dtype)(x)
            x = norm()(x)
        return nn.relu(x + y)


class ResNet(nn.Module):
    dtype: Any = None

    @nn.compact
    def __call__(self, x, train: bool = True):
        x = nn.Conv(WIDTH, (3, 3), use_bias=False, dtype=self.dtype)(x)
        x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=self.dtype)(x))
        x = ResBlock(WIDTH, dtype=self.dtype)(x, train)
        x = ResBlock(2 * WIDTH, strides=2, dtype=self.dtype)(x, train)
        x = jnp.mean(x, axis=(1, 2))
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(CLASSES, dtype=self.dtype)(x)


def make(dtype=None):
    return ResNet(dtype=dtype)


def data():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, SIZE, SIZE, 3)).astype(np.float32)
    y = rng.integers(0, CLASSES, BATCH).astype(np.int32)
    return {"init": ((x,), {"train": False}), "batch": {"x": x, "y": y}}


def loss(apply, variables, batch, rng):
    logits, state = apply(
        variables, batch["x"], train=True, rngs={"dropout": rng}, mutable=["batch_stats"]
    )
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return ce.mean(), state


LINEN = [LinenSpec("resnet", make, data, loss)]


class NnxResNet(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, dtype=None):
        conv = lambda i, o, s=1, k=3: nnx.Conv(
            i, o, (k, k), strides=s, use_bias=False, dtype=dtype, rngs=rngs
        )
        norm = lambda n: nnx.BatchNorm(n, momentum=0.9, dtype=dtype, rngs=rngs)
        self.stem, self.stem_norm = conv(3, WIDTH), norm(WIDTH)
        self.conv1, self.norm1 = conv(WIDTH, 2 * WIDTH, 2), norm(2 * WIDTH)
        self.conv2, self.norm2 = conv(2 * WIDTH, 2 * WIDTH), norm(2 * WIDTH)
        self.shortcut, self.shortcut_norm = conv(WIDTH, 2 * WIDTH, 2, 1), norm(2 * WIDTH)
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(2 * WIDTH, CLASSES, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        x = nnx.relu(self.stem_norm(self.stem(x)))
        y = nnx.relu(self.norm1(self.conv1(x)))
        y = self.norm2(self.conv2(y))
        x = nnx.relu(self.shortcut_norm(self.shortcut(x)) + y)
        return self.head(self.dropout(jnp.mean(x, axis=(1, 2))))


def make_nnx(rngs, dtype=None):
    return NnxResNet(rngs, dtype)


def nnx_loss(model, batch):
    logits = model(batch["x"])
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["y"])
    return ce.mean()


NNX = [
    NnxSpec(
        "resnet_nnx",
        make_nnx,
        data,
        nnx_loss,
    )
]
