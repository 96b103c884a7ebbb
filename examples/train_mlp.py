"""A Flax linen MLP with BatchNorm trained under three precision policies.

The model is written without any thought for precision; `jmp_policy` adds it:

  float32          the reference
  mixed_bfloat16   float32 parameters, bfloat16 compute, no loss scaling
  mixed_float16    float32 parameters, float16 compute, DynamicLossScale(2**15)

(and, with ``--half-params kahan`` or ``stochastic``, bfloat16 parameters
without float32 master weights: "bf16" with plain Adam, and "bf16+kahan" with
Adam wrapped in `jmp_policy.half_param_updates`)
using `with_policy(model.init, policy)`, `with_policy(model.apply, policy)`
(BatchNorm statistics are a mutable `batch_stats` collection, kept in
float32) and `loss_scaled(optax.adam(...), loss_scale)`, in the train step of
the jmp_policy README. The task: 10 overlapping Gaussian blobs in 32
dimensions, generated with NumPy (no download).

Usage::

    .venv/bin/python examples/train_mlp.py             # 300 steps each, a few seconds
    .venv/bin/python examples/train_mlp.py --steps 1000
    .venv/bin/python examples/train_mlp.py --half-params kahan --learning-rate 1e-4
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import numpy as np
import optax

import jmp_policy

# (name, policy spec, initial loss scale or None for no scaling)
CONFIGS = (
    ("float32", "float32", None),
    ("mixed_bfloat16", "mixed_bfloat16", None),
    ("mixed_float16", "mixed_float16", 2.0**15),
)
NUM_CLASSES = 10
DIM = 32
BATCH = 128
LEARNING_RATE = 1e-3
CENTRE_SCALE = 0.5  # blobs overlap: the Bayes accuracy is well below 100%


class MLP(nn.Module):
    """Dense -> BatchNorm -> ReLU, twice, then a Dense classifier."""

    width: int = 256
    num_classes: int = NUM_CLASSES

    @nn.compact
    def __call__(self, x, train: bool):
        for _ in range(2):
            x = nn.Dense(self.width)(x)
            x = nn.BatchNorm(use_running_average=not train, momentum=0.9)(x)
            x = nn.relu(x)
        return nn.Dense(self.num_classes)(x)


def make_data(seed: int = 0):
    """Gaussian blobs: class centres ~ N(0, CENTRE_SCALE**2) in `DIM` dimensions, unit noise.

    Returns `(sample, (x_test, y_test))`: `sample(step)` draws a fresh training
    batch (an endless stream, so the model cannot overfit), the same for every
    policy; the test set is 2048 examples.
    """
    centres = CENTRE_SCALE * np.random.default_rng(seed).standard_normal((NUM_CLASSES, DIM))

    def draw(rng, n):
        y = rng.integers(0, NUM_CLASSES, n).astype(np.int32)
        x = centres[y] + rng.standard_normal((n, DIM))
        return x.astype(np.float32), y

    def sample(step):
        return draw(np.random.default_rng((seed, 0, step)), BATCH)

    return sample, draw(np.random.default_rng((seed, 1)), 2048)


def cross_entropy(logits, labels):
    # The policy's output dtype is float32, so the loss is computed in float32.
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_train_step(model: MLP, policy, tx: optax.GradientTransformation):
    apply = jmp_policy.with_policy(model.apply, policy)

    @jax.jit
    def train_step(params, batch_stats, opt_state, x, y):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def loss_fn(p):
            logits, updates = apply(
                {"params": p, "batch_stats": batch_stats}, x, train=True, mutable=["batch_stats"]
            )
            loss = cross_entropy(logits, y)
            return loss_scale.scale(loss), (loss, updates["batch_stats"])

        grads, (loss, batch_stats) = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), batch_stats, opt_state, loss

    return train_step


def make_evaluate(model: MLP, policy):
    apply = jmp_policy.with_policy(model.apply, policy)

    @jax.jit
    def evaluate(variables, x, y):
        logits = apply(variables, x, train=False)
        return cross_entropy(logits, y), (logits.argmax(-1) == y).mean()

    return evaluate


def train(
    policy_spec: str,
    loss_scale: float | None,
    steps: int,
    seed: int = 0,
    learning_rate: float = LEARNING_RATE,
    half_params: str | None = None,
) -> dict:
    """Trains under one policy; returns losses, accuracy and loss-scale state.

    `half_params`, if not None, is the `method` of `jmp_policy.half_param_updates`
    wrapping Adam (it changes the updates of half-precision parameters only).
    """
    policy = jmp_policy.get_policy(policy_spec)
    sample, (x_test, y_test) = make_data(seed)
    model = MLP()
    variables = jmp_policy.with_policy(model.init, policy)(
        jax.random.key(seed), x_test[:1], train=False
    )
    params, batch_stats = variables["params"], variables["batch_stats"]
    scale = (
        jmp_policy.NoOpLossScale()
        if loss_scale is None
        else jmp_policy.DynamicLossScale(loss_scale)
    )
    tx = optax.adam(learning_rate)
    if half_params is not None:
        tx = jmp_policy.half_param_updates(tx, half_params, seed=seed)
    tx = jmp_policy.loss_scaled(tx, scale)
    opt_state = tx.init(params)
    train_step = make_train_step(model, policy, tx)

    start = time.perf_counter()
    losses = []
    for step in range(steps):
        x, y = sample(step)
        params, batch_stats, opt_state, loss = train_step(params, batch_stats, opt_state, x, y)
        losses.append(loss)
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - start

    evaluate = make_evaluate(model, policy)
    test_loss, accuracy = evaluate({"params": params, "batch_stats": batch_stats}, x_test, y_test)
    dtypes = {str(a.dtype) for a in jax.tree.leaves((params, batch_stats))}
    return {
        "final_loss": float(np.mean(losses[-10:])),
        "losses": losses,
        "test_loss": float(test_loss),
        "accuracy": float(accuracy),
        "loss_scale": float(jmp_policy.get_loss_scale(opt_state).loss_scale),
        "skipped": int(opt_state.total_notfinite),
        "state_dtypes": sorted(dtypes),
        "seconds": seconds,
    }


def main(argv: Sequence[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300, help="Adam steps per policy")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--learning-rate", type=float, default=LEARNING_RATE)
    parser.add_argument(
        "--half-params",
        choices=("kahan", "stochastic"),
        help="also train bfloat16 parameters, plain and with half_param_updates(method=...)",
    )
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")

    print(
        f"MLP with BatchNorm, {NUM_CLASSES} Gaussian blobs in {DIM} dimensions, "
        f"{args.steps} Adam steps of batch {BATCH} per policy, learning rate {args.learning_rate:g}"
    )
    header = (
        f"{'policy':<16}{'train loss':>11}{'test acc':>10}{'loss scale':>12}"
        f"{'skipped':>9}  {'state dtype':<17}{'time':>6}"
    )
    print(header)
    print("-" * len(header))
    results = {}
    configs = [(name, spec, scale, None) for name, spec, scale in CONFIGS]
    if args.half_params is not None:
        configs += [
            ("bf16", "bf16", None, None),
            (f"bf16+{args.half_params}", "bf16", None, args.half_params),
        ]
    for name, spec, scale, method in configs:
        r = train(spec, scale, args.steps, args.seed, args.learning_rate, method)
        results[name] = r
        scale_str = "none" if scale is None else f"{r['loss_scale']:g}"
        print(
            f"{name:<16}{r['final_loss']:>11.4f}{r['accuracy']:>10.1%}{scale_str:>12}"
            f"{r['skipped']:>9}  {','.join(r['state_dtypes']):<17}{r['seconds']:>5.1f}s"
        )
    print(
        "train loss: mean of the last 10 steps; state: params and batch_stats; time: with compilation"
    )
    return results


if __name__ == "__main__":
    main()
