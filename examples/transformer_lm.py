"""A character-level Transformer LM trained under three precisions (five with --half-params).

The model is plain Flax linen, written without any thought for precision
(every layer's `dtype` is left at its default). `jmp_policy.with_policy` runs
it under a policy, and `jmp_policy.loss_scaled` wraps the optimizer:

  float32          the reference
  mixed_bfloat16   float32 parameters, bfloat16 compute, no loss scaling
  mixed_float16    float32 parameters, float16 compute, DynamicLossScale(2**15)

and, with ``--half-params kahan`` (or ``stochastic``), two more with bfloat16
parameters (half the memory of the weights, no float32 master copy):

  bf16             bfloat16 everything, plain optax: small updates round away
  bf16+kahan       the same wrapped in `jmp_policy.half_param_updates`

The corpus is the source code of Python's own `argparse` module (read with
`inspect.getsource`: shipped with every Python, no download). Every
configuration sees the same initial parameters and the same batches, so the
losses can be compared step for step.

Usage::

    .venv/bin/python examples/transformer_lm.py            # 300 steps each, ~1 min
    .venv/bin/python examples/transformer_lm.py --steps 50
    .venv/bin/python examples/transformer_lm.py --half-params kahan --learning-rate 1e-4
"""

from __future__ import annotations

import argparse
import functools
import inspect
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy

# (name, policy spec, initial loss scale or None for no scaling)
CONFIGS = (
    ("float32", "float32", None),
    ("mixed_bfloat16", "mixed_bfloat16", None),
    ("mixed_float16", "mixed_float16", 2.0**15),
)

SEQ_LEN = 32
BATCH = 16
LEARNING_RATE = 3e-3


class Block(nn.Module):
    """A pre-LN Transformer block: causal self-attention then an MLP, each residual."""

    num_heads: int
    mlp_ratio: int = 4

    @nn.compact
    def __call__(self, x, mask):
        width = x.shape[-1]
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads)(h, mask=mask)
        x = x + h
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(self.mlp_ratio * width)(h))
        return x + nn.Dense(width)(h)


class TransformerLM(nn.Module):
    """Token and position embeddings, `depth` pre-LN blocks, final LayerNorm, logits."""

    vocab_size: int
    width: int = 64
    depth: int = 2
    num_heads: int = 4
    max_len: int = SEQ_LEN

    @nn.compact
    def __call__(self, tokens):
        positions = jnp.arange(tokens.shape[-1])
        x = nn.Embed(self.vocab_size, self.width, name="tok_embed")(tokens)
        x = x + nn.Embed(self.max_len, self.width, name="pos_embed")(positions)
        mask = nn.make_causal_mask(tokens)
        for _ in range(self.depth):
            x = Block(self.num_heads)(x, mask)
        x = nn.LayerNorm()(x)
        return nn.Dense(self.vocab_size, name="head")(x)


# ---------------------------------------------------------------------------- data


def corpus() -> str:
    """The training text: the source of the stdlib `argparse` module (~100 kB)."""
    return inspect.getsource(argparse)


def make_data(
    steps: int, batch: int = BATCH, seq_len: int = SEQ_LEN, seed: int = 0
) -> tuple[np.ndarray, np.ndarray, int]:
    """Returns `(train_batches, eval_batch, vocab_size)`.

    `train_batches` is int32 `[steps, batch, seq_len + 1]`: random windows of the
    first 90% of the corpus (inputs are `[..., :-1]`, targets `[..., 1:]`);
    `eval_batch` is `[4 * batch, seq_len + 1]`, windows of the last 10%.
    """
    text = corpus()
    vocab = sorted(set(text))
    lookup = {c: i for i, c in enumerate(vocab)}
    data = np.fromiter((lookup[c] for c in text), np.int32, len(text))
    split = int(0.9 * len(data))
    train, held_out = data[:split], data[split:]
    rng = np.random.default_rng(seed)
    window = np.arange(seq_len + 1)
    starts = rng.integers(0, len(train) - seq_len - 1, size=(steps, batch))
    eval_starts = rng.integers(0, len(held_out) - seq_len - 1, size=4 * batch)
    return train[starts[..., None] + window], held_out[eval_starts[:, None] + window], len(vocab)


# --------------------------------------------------------------------------- train


def loss_fn(apply, params, batch):
    """Mean next-character cross-entropy in nats (computed in float32)."""
    logits = apply({"params": params}, batch[:, :-1])
    # The policy's output dtype is float32; the astype is a no-op then, and
    # keeps the loss in float32 for apply functions that return half logits.
    logits = logits.astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()


def make_train_step(model: nn.Module, policy, tx: optax.GradientTransformation):
    """The train step of the jmp_policy README, jitted: `(params, opt_state, batch)`
    -> `(params, opt_state, loss)`."""
    apply = jmp_policy.with_policy(model.apply, policy)

    @jax.jit
    def train_step(params, opt_state, batch):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def scaled_loss(p):
            loss = loss_fn(apply, p, batch)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(scaled_loss, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def make_model(vocab_size: int) -> TransformerLM:
    return TransformerLM(vocab_size=vocab_size)


def init_params(model: TransformerLM, policy, seed: int = 0):
    """The initial parameters, in the policy's param dtype.

    They depend only on the model, the seed and the param dtype, so they are
    cached on those: the configurations with float32 parameters start from
    the very same values, and the initialisation compiles once. Half
    parameters are the float32 ones rounded, so they start from the same
    point too.
    """
    param_dtype = jmp_policy.get_policy(policy).param_dtype
    params = _init_params(model, jnp.dtype(jnp.float32), seed)
    return jax.tree.map(lambda p: p.astype(param_dtype), params)


@functools.cache
def _init_params(model: TransformerLM, param_dtype, seed: int):
    tokens = jnp.zeros((1, model.max_len), jnp.int32)
    init = jmp_policy.with_policy(
        model.init, jmp_policy.Policy(param_dtype, param_dtype, param_dtype)
    )
    return jax.jit(init)(jax.random.key(seed), tokens)["params"]


def train(
    policy_spec: str = "float32",
    loss_scale: float | None = None,
    steps: int = 300,
    seed: int = 0,
    evaluate: bool = True,
    learning_rate: float = LEARNING_RATE,
    half_params: str | None = None,
) -> dict:
    """Trains the model for `steps` steps under a policy; returns the results.

    Args:
      policy_spec: a `jmp_policy.get_policy` spec, e.g. "mixed_bfloat16".
      loss_scale: the initial `DynamicLossScale`, or None for `NoOpLossScale`.
      steps: the number of optimizer steps.
      seed: seeds the parameters and the batches (the same for every policy).
      evaluate: whether to compute `eval_loss` (one more compilation).
      learning_rate: Adam's learning rate.
      half_params: None for plain optax, or the `method` of
        `jmp_policy.half_param_updates` ("kahan", "stochastic") wrapping Adam;
        it changes the updates of half-precision parameters only.

    Returns:
      A dict: `final_loss` (mean training loss of the last 10 steps, nats),
      `losses` (every step's training loss), `eval_loss` (held-out loss at the
      end, under the same policy; None if not `evaluate`), `loss_scale` (the final scale),
      `skipped` (steps skipped for non-finite gradients), `params`, `seconds`.
    """
    policy = jmp_policy.get_policy(policy_spec)
    batches, eval_batch, vocab_size = make_data(steps, seed=seed)
    model = make_model(vocab_size)
    scale = (
        jmp_policy.NoOpLossScale()
        if loss_scale is None
        else jmp_policy.DynamicLossScale(loss_scale)
    )
    tx = optax.adam(learning_rate)
    if half_params is not None:
        tx = jmp_policy.half_param_updates(tx, half_params, seed=seed)
    tx = jmp_policy.loss_scaled(tx, scale)
    params = init_params(model, policy, seed)
    opt_state = tx.init(params)
    train_step = make_train_step(model, policy, tx)

    start = time.perf_counter()
    losses = []
    for batch in batches:
        params, opt_state, loss = train_step(params, opt_state, batch)
        losses.append(loss)
    losses = [float(x) for x in jax.device_get(losses)]
    seconds = time.perf_counter() - start

    eval_loss = None
    if evaluate:
        apply = jmp_policy.with_policy(model.apply, policy)
        eval_loss = float(jax.jit(functools.partial(loss_fn, apply))(params, eval_batch))
    return {
        "final_loss": float(np.mean(losses[-10:])),
        "losses": losses,
        "eval_loss": eval_loss,
        "loss_scale": float(jmp_policy.get_loss_scale(opt_state).loss_scale),
        "skipped": int(opt_state.total_notfinite),
        "params": params,
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
    if args.steps < 10:
        parser.error(f"--steps must be at least 10, got {args.steps}")

    _, _, vocab_size = make_data(1, seed=args.seed)
    n_params = sum(p.size for p in jax.tree.leaves(init_params(make_model(vocab_size), "f32")))
    print(
        f"Character Transformer LM on the argparse source: vocab {vocab_size}, "
        f"{n_params:,} params, batch {BATCH} x {SEQ_LEN}, {args.steps} Adam steps "
        f"at learning rate {args.learning_rate:g}"
    )
    header = (
        f"{'policy':<16}{'train loss':>11}{'eval loss':>11}{'loss scale':>12}"
        f"{'skipped':>9}{'time':>8}"
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
        r = train(
            spec,
            scale,
            args.steps,
            args.seed,
            learning_rate=args.learning_rate,
            half_params=method,
        )
        results[name] = r
        scale_str = "none" if scale is None else f"{r['loss_scale']:g}"
        print(
            f"{name:<16}{r['final_loss']:>11.4f}{r['eval_loss']:>11.4f}"
            f"{scale_str:>12}{r['skipped']:>9}{r['seconds']:>7.1f}s"
        )
    print("losses in nats per character; train loss: mean of the last 10 steps; eval: held-out")
    print("text; all start from the same parameters (rounded, for bf16) and see the same batches")
    return results


if __name__ == "__main__":
    main()
