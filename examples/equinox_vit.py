"""A small Equinox Vision Transformer trained under three precision policies.

The data ship inside scikit-learn (`sklearn.datasets.load_digits`: 1797
handwritten digits, 8x8 pixels, no download); 1437 train, 360 test. The model:
2x2 patches (16 tokens), width 32, two pre-norm blocks of 4-head attention
and an MLP (dropout 0.1 after it), a linear classifier on the mean token.

  float32          the reference
  mixed_bfloat16   float32 parameters, bfloat16 products, no loss scaling
  mixed_float16    float32 parameters, float16 products, DynamicLossScale(2**15)

The model is plain Equinox, written without any thought for precision.
`jmp_policy.autocast(loss_fn, policy)` runs its matmuls on half operands with
float32 accumulation and the softmax, LayerNorm and loss in float32;
`eqx.filter_value_and_grad` differentiates it; `jmp_policy.loss_scaled` over
the `eqx.filter`ed parameters unscales the gradients, skips non-finite steps
and adjusts the scale; `eqx.apply_updates` applies the update. The parameters
stay float32 throughout. Needs equinox and scikit-learn (`pip install '.[equinox]'`).

Usage::

    .venv/bin/python examples/equinox_vit.py             # 400 steps each
    .venv/bin/python examples/equinox_vit.py --steps 50
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import jmp_policy

CONFIGS = (  # (name, policy spec or None for no autocast, initial loss scale or None)
    ("float32", None, None),
    ("mixed_bfloat16", "mixed_bfloat16", None),
    ("mixed_float16", "mixed_float16", 2.0**15),
)
PATCH, DIM, DEPTH, HEADS, DROPOUT = 2, 32, 2, 4, 0.1
BATCH, LEARNING_RATE = 64, 3e-3


class Block(eqx.Module):
    """Pre-norm Transformer block: attention, then an MLP, each with a residual."""

    norm1: eqx.nn.LayerNorm
    attn: eqx.nn.MultiheadAttention
    norm2: eqx.nn.LayerNorm
    mlp: eqx.nn.MLP
    dropout: eqx.nn.Dropout

    def __init__(self, key):
        k1, k2 = jax.random.split(key)
        self.norm1, self.norm2 = eqx.nn.LayerNorm(DIM), eqx.nn.LayerNorm(DIM)
        self.attn = eqx.nn.MultiheadAttention(HEADS, DIM, key=k1)  # no attention dropout, as ViT
        self.mlp = eqx.nn.MLP(DIM, DIM, 2 * DIM, depth=1, activation=jax.nn.gelu, key=k2)
        self.dropout = eqx.nn.Dropout(DROPOUT)

    def __call__(self, x, key):
        h = jax.vmap(self.norm1)(x)
        x = x + self.attn(h, h, h)
        h = jax.vmap(self.mlp)(jax.vmap(self.norm2)(x))
        return x + self.dropout(h, key=key)


class ViT(eqx.Module):
    embed: eqx.nn.Linear
    pos: jax.Array
    blocks: list[Block]
    norm: eqx.nn.LayerNorm
    head: eqx.nn.Linear

    def __init__(self, key):
        keys = jax.random.split(key, DEPTH + 3)
        tokens = (8 // PATCH) ** 2
        self.embed = eqx.nn.Linear(PATCH * PATCH, DIM, key=keys[0])
        self.pos = 0.2 * jax.random.normal(keys[1], (tokens, DIM))
        self.blocks = [Block(k) for k in keys[2:-1]]
        self.norm = eqx.nn.LayerNorm(DIM)
        self.head = eqx.nn.Linear(DIM, 10, key=keys[-1])

    def __call__(self, image, key):  # image: (8, 8), one example
        n = 8 // PATCH
        patches = image.reshape(n, PATCH, n, PATCH).transpose(0, 2, 1, 3).reshape(n * n, -1)
        x = jax.vmap(self.embed)(patches) + self.pos
        for block, k in zip(self.blocks, jax.random.split(key, len(self.blocks))):
            x = block(x, k)
        return self.head(self.norm(x.mean(0)))


def load_data():
    """`((x_train, y_train), (x_test, y_test))`, pixels scaled to [0, 1]."""
    digits = load_digits()
    x = (digits.images / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(0).permutation(len(y))
    train, test = order[:1437], order[1437:]
    return (x[train], y[train]), (x[test], y[test])


def loss_fn(model, x, y, key):
    logits = jax.vmap(model)(x, jax.random.split(key, x.shape[0]))
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def make_train_step(policy: str | None, tx: optax.GradientTransformation):
    """The jitted step for `policy` (None: float32, as written)."""
    loss_of = loss_fn if policy is None else jmp_policy.autocast(loss_fn, policy)

    @eqx.filter_jit
    def train_step(model, opt_state, x, y, key):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def scaled_loss(model):
            loss = loss_of(model, x, y, key)  # float32: the policy's output dtype
            return loss_scale.scale(loss), loss

        (_, loss), grads = eqx.filter_value_and_grad(scaled_loss, has_aux=True)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        # Unscales, skips a non-finite step (zero update), adjusts the scale.
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), opt_state, loss

    return train_step


@eqx.filter_jit
def accuracy(model, x, y):
    model = eqx.nn.inference_mode(model)  # no dropout
    logits = jax.vmap(model)(x, jax.random.split(jax.random.key(0), x.shape[0]))
    return (logits.argmax(-1) == y).mean()


def train(policy: str | None, loss_scale: float | None, steps: int, seed: int = 0) -> dict:
    """Trains under one policy; returns losses, test accuracy and loss-scale state."""
    (x_train, y_train), (x_test, y_test) = load_data()
    model = ViT(jax.random.key(seed))  # the same initial parameters for every policy
    scale = (
        jmp_policy.NoOpLossScale()
        if loss_scale is None
        else jmp_policy.DynamicLossScale(jnp.float32(loss_scale))
    )
    tx = jmp_policy.loss_scaled(optax.adam(LEARNING_RATE), scale)
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    train_step = make_train_step(policy, tx)

    rng, key = np.random.default_rng(seed), jax.random.key(seed + 1)
    losses = []
    for step in range(steps):
        batch = rng.choice(len(y_train), BATCH, replace=False)  # the same batches every run
        model, opt_state, loss = train_step(
            model, opt_state, x_train[batch], y_train[batch], jax.random.fold_in(key, step)
        )
        losses.append(loss)
    losses = [float(x) for x in jax.device_get(losses)]
    dtypes = {x.dtype.name for x in jax.tree.leaves(eqx.filter(model, eqx.is_array))}
    return {
        "final_loss": float(np.mean(losses[-20:])),
        "losses": losses,
        "accuracy": float(accuracy(model, x_test, y_test)),
        "loss_scale": float(jmp_policy.get_loss_scale(opt_state).loss_scale),
        "skipped": int(opt_state.total_notfinite),
        "param_dtypes": "/".join(sorted(dtypes)),
        "model": model,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="Adam steps per policy")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.steps < 20:
        parser.error(f"--steps must be at least 20, got {args.steps}")

    print(f"Equinox ViT on scikit-learn's 8x8 digits, {args.steps} Adam steps, batch {BATCH}")
    header = (
        f"{'policy':<16}{'train loss':>11}{'test acc':>10}{'loss scale':>12}"
        f"{'skipped':>9}{'params':>9}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    for name, policy, scale in CONFIGS:
        r = results[name] = train(policy, scale, args.steps, args.seed)
        scale_str = "none" if scale is None else f"{r['loss_scale']:g}"
        print(
            f"{name:<16}{r['final_loss']:>11.4f}{r['accuracy']:>10.3f}{scale_str:>12}"
            f"{r['skipped']:>9}{r['param_dtypes']:>9}"
        )
    print("train loss: mean of the last 20 steps; all runs see the same batches and dropout")
    return results


if __name__ == "__main__":
    main()
