"""Models and helpers the linen `with_policy` tests share (`test_linen*.py`)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy import with_policy

from helpers import HloOp, contractions

BF16 = np.dtype(jnp.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)

VOCAB = 24  # No other dimension of the models below is 24: it marks the head.
FEATURES = 16
SEQ = 8
BATCH = 2
SEEN: dict[str, Any] = {}  # What modules saw while traced.


# --------------------------------------------------------------------------
# Reading contractions out of lowered StableHLO (`helpers.contractions`).


def compute_dtypes(found: list[HloOp]) -> list[np.dtype]:
    """The operand dtype of each contraction; both operands must agree."""
    dtypes = []
    for c in found:
        lhs, rhs = c.operand_dtypes
        assert lhs == rhs, f"mixed operands in {c}"
        dtypes.append(lhs)
    return dtypes


# --------------------------------------------------------------------------
# Models.


class Block(nn.Module):
    """A pre-norm Transformer block: LayerNorm, attention, LayerNorm, MLP, residuals."""

    features: int = FEATURES
    num_heads: int = 2
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, x, train: bool = False):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2], jnp.int32), dtype=bool)
        h = nn.LayerNorm()(x)
        h = nn.MultiHeadDotProductAttention(
            num_heads=self.num_heads, dropout_rate=self.dropout_rate, deterministic=not train
        )(h, mask=mask)
        x = x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)
        h = nn.LayerNorm()(x)
        h = nn.gelu(nn.Dense(4 * self.features)(h))
        h = nn.Dense(self.features)(h)
        return x + nn.Dropout(self.dropout_rate, deterministic=not train)(h)


class Head(nn.Dense):
    """The logits layer; its own class so that a class rule can single it out."""


class LM(nn.Module):
    """Token and position embeddings, one `Block`, a final LayerNorm and a `Head`."""

    vocab_size: int = VOCAB
    features: int = FEATURES
    dropout_rate: float = 0.1

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        positions = jnp.arange(tokens.shape[-1])
        x = nn.Embed(self.vocab_size, self.features)(tokens)
        x = x + nn.Embed(SEQ, self.features)(positions)
        x = Block(self.features, dropout_rate=self.dropout_rate)(x, train)
        x = nn.LayerNorm()(x)
        return Head(self.vocab_size, name="head")(x)


def _tokens(seed=0, shape=(BATCH, SEQ)):
    return np.random.default_rng(seed).integers(0, VOCAB, shape, dtype=np.int32)


def _dtypes(tree) -> set[np.dtype]:
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree)}


def materialize(shapes, seed: int = 0):
    """Concrete variables shaped and typed like `shapes` (from `jax.eval_shape`).

    Compiling Flax's random initialisers costs seconds on CPU; these tests need
    plausible values (fan-in scaled kernels, unit scales and variances), not
    Flax's. The dtypes are those `with_policy(model.init, ...)` chose.
    """
    rng = np.random.default_rng(seed)

    def value(path, leaf):
        name = path[-1].key
        if name in ("kernel", "embedding"):
            fan_in = leaf.shape[-1] if name == "embedding" else np.prod(leaf.shape[:-1])
            x = rng.standard_normal(leaf.shape) / np.sqrt(fan_in)
        elif name in ("scale", "var"):
            x = np.ones(leaf.shape)
        else:
            x = np.zeros(leaf.shape)
        return x.astype(leaf.dtype)

    return jax.tree_util.tree_map_with_path(value, shapes)


def make_train_step(apply, tx):
    """A whole train step: value_and_grad through `apply`, then an optax update."""

    def train_step(params, opt_state, tokens, targets, key):
        def loss_fn(p):
            logits = apply({"params": p}, tokens, train=True, rngs={"dropout": key})
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss, grads

    return train_step


# optax.adam's bias correction (`decay ** count`, float ** int32) fails under
# strict promotion; SGD with momentum does not, and is enough here.
TX = optax.sgd(0.1, momentum=0.9)


def lowered_train_step(model, policy, rules=None) -> list[HloOp]:
    """The contractions of `model`'s whole jitted train step under `policy`."""
    tokens = _tokens()
    init = with_policy(model.init, policy, rules=rules)
    params = jax.eval_shape(init, jax.random.key(0), tokens)["params"]
    opt_state = jax.eval_shape(TX.init, params)
    step = make_train_step(with_policy(model.apply, policy, rules=rules), TX)
    lowered = jax.jit(step).lower(params, opt_state, tokens, tokens, jax.random.key(1))
    return contractions(lowered.as_text())


# Per Dense-like layer, one forward dot and two backward ones (input and weight
# gradients); the LM has q, k, v, out, two MLP Dense and the head (7 x 3 = 21)
# and two attention einsums, logits and weighted values (2 x 3 = 6).
LM_DOTS = 27
HEAD_DOTS = 3


class AutoEncoder(nn.Module):
    def setup(self):
        self.encoder = nn.Dense(4)
        self.decoder = nn.Dense(8)

    def encode(self, x):
        return self.encoder(x)

    def __call__(self, x):
        return self.decoder(self.encode(x))


class ScanBody(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return Block()(x, True), None


class ScanLM(nn.Module):
    """Two Blocks through `nn.scan`, parameters stacked on a leading axis."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        blocks = nn.scan(
            ScanBody,
            variable_axes={"params": 0},
            split_rngs={"params": True, "dropout": True},
            length=2,
        )
        x, _ = blocks(name="blocks")(x, None)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))


class RematLM(nn.Module):
    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        x = nn.remat(Block, static_argnums=(2,))()(x, train)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))


class VmapLM(nn.Module):
    """An ensemble of three Dense through `nn.vmap`, averaged."""

    @nn.compact
    def __call__(self, tokens, train: bool = False):
        x = nn.Embed(VOCAB, FEATURES)(tokens)
        ensemble = nn.vmap(
            nn.Dense,
            variable_axes={"params": 0},
            split_rngs={"params": True},
            in_axes=None,
            out_axes=0,
            axis_size=3,
        )
        x = ensemble(FEATURES)(x).mean(0)
        return Head(VOCAB, name="head")(nn.LayerNorm()(x))
