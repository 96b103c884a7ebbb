"""A Flax NNX MLP with BatchNorm and Dropout trained under three precision policies.

The NNX counterpart of `train_mlp.py`, on the same task (10 overlapping
Gaussian blobs in 32 dimensions, generated with NumPy, no download):

  float32          the reference
  mixed_bfloat16   float32 parameters, bfloat16 compute, no loss scaling
  mixed_float16    float32 parameters, float16 compute, DynamicLossScale(2**15)

The model is written without any thought for precision.
`jmp_policy.nnx.PolicyModule(model, policy)` sets every layer's `dtype` and
`param_dtype` (BatchNorm statistics stay float32) and casts the model's
inputs and output; `nnx.Optimizer` wraps `jmp_policy.loss_scaled(adam, ...)`,
and `jmp_policy.nnx.get_loss_scale(optimizer)` finds the scale in it.

Usage::

    .venv/bin/python examples/nnx_mlp.py             # 300 steps each, a few seconds
    .venv/bin/python examples/nnx_mlp.py --steps 1000
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import jax
import numpy as np
import optax
from flax import nnx

import jmp_policy
import jmp_policy.nnx as jnnx

CONFIGS = (  # (name, policy spec, initial loss scale or None for no scaling)
    ("float32", "float32", None),
    ("mixed_bfloat16", "mixed_bfloat16", None),
    ("mixed_float16", "mixed_float16", 2.0**15),
)
NUM_CLASSES, DIM, BATCH = 10, 32, 128
LEARNING_RATE = 1e-3


class MLP(nnx.Module):
    """Linear -> BatchNorm -> ReLU -> Dropout, twice, then a Linear classifier."""

    def __init__(self, rngs: nnx.Rngs, width: int = 256):
        self.hidden = nnx.List(
            [nnx.Linear(DIM, width, rngs=rngs), nnx.Linear(width, width, rngs=rngs)]
        )
        self.norms = nnx.List([nnx.BatchNorm(width, momentum=0.9, rngs=rngs) for _ in range(2)])
        self.dropout = nnx.Dropout(0.1, rngs=rngs)
        self.head = nnx.Linear(width, NUM_CLASSES, rngs=rngs)

    def __call__(self, x):
        for linear, norm in zip(self.hidden, self.norms):
            x = self.dropout(nnx.relu(norm(linear(x))))
        return self.head(x)


def make_data(seed: int = 0):
    """`(sample, (x_test, y_test))`: `sample(step)` draws a fresh training batch."""
    centres = 0.5 * np.random.default_rng(seed).standard_normal((NUM_CLASSES, DIM))

    def draw(rng, n):
        y = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
        return (centres[y] + rng.standard_normal((n, DIM))).astype(np.float32), y

    return (lambda step: draw(np.random.default_rng((seed, 0, step)), BATCH)), draw(
        np.random.default_rng((seed, 1)), 2048
    )


@nnx.jit
def train_step(model, optimizer, x, y):
    loss_scale = jnnx.get_loss_scale(optimizer)

    def loss_fn(model):
        logits = model(x)  # float32: the policy's output dtype
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
        return loss_scale.scale(loss), loss

    grads, loss = nnx.grad(loss_fn, has_aux=True)(model)
    optimizer.update(model, grads)  # unscales, skips non-finite steps, adjusts the scale
    return loss


@nnx.jit
def accuracy(model, x, y):
    return (model(x).argmax(-1) == y).mean()


def train(policy_spec: str, loss_scale: float | None, steps: int, seed: int = 0) -> dict:
    """Trains under one policy; returns losses, accuracy and loss-scale state."""
    sample, (x_test, y_test) = make_data(seed)
    model = jnnx.PolicyModule(MLP(nnx.Rngs(seed, dropout=seed + 1)), policy_spec)
    scale = (
        jmp_policy.NoOpLossScale()
        if loss_scale is None
        else jmp_policy.DynamicLossScale(loss_scale)
    )
    tx = jmp_policy.loss_scaled(optax.adam(LEARNING_RATE), scale)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    start = time.perf_counter()
    model.train()
    losses = [train_step(model, optimizer, *sample(step)) for step in range(steps)]
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - start
    model.eval()
    dtypes = {x.dtype.name for x in jax.tree.leaves(nnx.state(model, nnx.Param))}
    stats = {x.dtype.name for x in jax.tree.leaves(nnx.state(model, nnx.BatchStat))}
    return {
        "final_loss": float(np.mean(losses[-10:])),
        "losses": losses,
        "accuracy": float(accuracy(model, x_test, y_test)),
        "loss_scale": float(jnnx.get_loss_scale(optimizer).loss_scale),
        "skipped": int(optimizer.opt_state.total_notfinite[...]),
        "param_dtypes": "/".join(sorted(dtypes | stats)),
        "compute_dtype": np.dtype(model.module.head.dtype).name,
        "seconds": seconds,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 10:
        parser.error(f"--steps must be at least 10, got {args.steps}")

    print(f"Flax NNX MLP with BatchNorm and Dropout, Gaussian blobs, {args.steps} Adam steps")
    header = (
        f"{'policy':<16}{'train loss':>11}{'test acc':>10}{'loss scale':>12}"
        f"{'skipped':>9}{'compute':>10}{'params+stats':>14}{'time':>8}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name, spec, scale in CONFIGS:
        r = results[name] = train(spec, scale, args.steps, args.seed)
        scale_str = "none" if scale is None else f"{r['loss_scale']:g}"
        print(
            f"{name:<16}{r['final_loss']:>11.4f}{r['accuracy']:>10.3f}{scale_str:>12}"
            f"{r['skipped']:>9}{r['compute_dtype']:>10}{r['param_dtypes']:>14}"
            f"{r['seconds']:>7.1f}s"
        )
    print("train loss: mean of the last 10 steps; all runs see the same batches")
    return results


if __name__ == "__main__":
    main()
