"""What every model of the corpus is held to, against its own half-precision config.

A policy must be at least as good as the model's own half config (its
parameters or `dtype` in bfloat16 or float16, written by its authors): forward
error against float32 at most 1.5x the own config's, no more float32 products,
and under a matmul dtype every product in it but those the author keeps in
float32 (`precision=HIGHEST`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jmp_policy as jmp

from helpers import HloOp, compiler_options, contractions

POLICIES = (
    "mixed_bfloat16",
    "mixed_float16",
    "p=f32,c=bf16,o=f32,m=bf16",
    "mixed_float8",
    "mixed_float8_rowwise",
    "mixed_mxfp8",
    "mixed_nvfp4",
)
# jax.jit compiling fast (the suite's models are tiny).
jit = functools.partial(jax.jit, compiler_options=compiler_options())
BF16, F16 = np.dtype(jnp.bfloat16), np.dtype(np.float16)
E4M3, E2M1 = np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float4_e2m1fn)
# A model has no FP8 or FP4 config of its own: such a policy is held to its
# bf16 config's error times the ratio of the formats' unit roundoffs (e4m3
# 2^-4, e2m1 2^-2, bfloat16 2^-8), so a wrong scale (an overflow, a flushed
# operand) still fails.
OVER_BF16 = {E4M3: 16.0, E2M1: 64.0}
# The element types a matmul dtype's forward products take (FP8: e4m3). The
# block formats' products are emulated on CPU at HIGHEST precision (see
# `kept_by_author`): the types in the program are tested in test_block_scaling.
MATMUL_TYPES = {BF16: {"bf16"}, F16: {"f16"}, E4M3: {"f8E4M3FN"}, E2M1: {"f4E2M1FN"}}


def compute_dtype(policy: str) -> np.dtype:
    return np.dtype(jmp.get_policy(policy).compute_dtype)


def loss_scale(policy: str) -> jmp.LossScale:
    """A `DynamicLossScale` for float16 compute, as a float16 user trains; else none."""
    if compute_dtype(policy) == F16:
        return jmp.DynamicLossScale(jnp.float32(2.0**15))
    return jmp.NoOpLossScale()


def cast_floats(tree: Any, dtype: Any) -> Any:
    """The floating leaves of `tree` in `dtype` (the same weights, rounded)."""
    return jax.tree.map(
        lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree
    )


def relative_error(out: Any, ref: Any) -> float:
    """The largest absolute difference over the largest absolute reference value."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    return float(np.max(np.abs(out - ref)) / np.max(np.abs(ref)))


def error_bound(policy: str, own_errors: dict[np.dtype, float]) -> float:
    """1.5x the own config's error in the policy's compute dtype.

    A model without a float16 config of its own (one that fails in float16)
    is held to its bfloat16 config's error, which float16's 3 more mantissa
    bits only lower.
    """
    dtype = compute_dtype(policy)
    own = own_errors[dtype] if dtype in own_errors else own_errors[BF16]
    if is_fp8(policy):
        own *= OVER_BF16[np.dtype(jmp.get_policy(policy).matmul_dtype)]
    return 1.5 * own


def kept_by_author(op: HloOp) -> bool:
    return "HIGHEST" in op.line


def float32_products(text: str) -> list[HloOp]:
    """The products of a lowered program with both operands float32, but those
    the author asked float32 precision of."""
    return [
        op
        for op in contractions(text)
        if op.operand_types == ("f32", "f32") and not kept_by_author(op)
    ]


def assert_products(policy: str, text: str, own_text: str | None) -> None:
    """No more float32 products than the own config (where it has one in the
    policy's compute dtype); under a matmul dtype, every matmul in it and
    every convolution in it or, under FP8, in the compute dtype (as the
    matmul-dtype guide says)."""
    if own_text is not None:
        ours, own = float32_products(text), float32_products(own_text)
        assert len(ours) <= len(own), (policy, [op.line for op in ours])
    matmul = jmp.get_policy(policy).matmul_dtype
    if matmul is not None:
        wanted = {
            "dot_general": MATMUL_TYPES[np.dtype(matmul)],
            "convolution": MATMUL_TYPES[np.dtype(matmul)] | MATMUL_TYPES[compute_dtype(policy)],
        }
        other = [
            op.line
            for op in contractions(text)
            if not kept_by_author(op) and not set(op.operand_types) <= wanted[op.name]
        ]
        assert not other, (policy, other)


def train(
    loss_fn: Callable[[Any], jax.Array], params: Any, policy: str, steps: int = 3
) -> tuple[list[float], Any]:
    """`steps` Adam steps under `loss_scaled` (a dynamic loss scale in float16,
    with 5 more steps: each overflow skips a step and halves the scale, 2^15
    to 2^10 at most): the losses, and the final parameters."""
    tx = jmp.loss_scaled(optax.adam(1e-2), loss_scale(policy))
    steps += 5 if compute_dtype(policy) == F16 else 0

    @jit
    def step(params, opt_state):
        scale = jmp.get_loss_scale(opt_state)
        loss, grads = jax.value_and_grad(lambda p: scale.scale(loss_fn(p)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, scale.unscale(loss)

    opt_state, losses = tx.init(params), []
    for _ in range(steps):
        params, opt_state, loss = step(params, opt_state)
        losses.append(float(loss))
    return losses, params


def finite_gradients(loss_fn: Callable[[Any], jax.Array], params: Any) -> bool:
    grads = jax.grad(loss_fn)(params)
    return all(bool(jnp.isfinite(g).all()) for g in jax.tree.leaves(grads))


def is_fp8(policy: str) -> bool:
    """An FP8 or FP4 policy (current or block scaling)."""
    matmul = jmp.get_policy(policy).matmul_dtype
    return matmul is not None and np.dtype(matmul) in OVER_BF16


def assert_decodes_as_uncached(
    policy: str, cached: Any, uncached: Any, own_errors: dict[np.dtype, float]
) -> None:
    """Logits of a cached decode (a prefill, then a token a step) against the
    full sequence's: within the policy's forward error bound. FP8's current
    scaling takes a one-token step's scales from that token alone, so only
    half policies must also agree on the greedy token (`argmax`) wherever the
    model's own half config could tell the two candidates apart: where the
    full sequence's logits of the two differ by more than twice its own
    forward error (of the largest logit). A nearer tie may go either way in
    the own config too (MaxText's linen model's own bf16 decode picks another
    token at 1 of 32 positions)."""
    bound = error_bound(policy, own_errors)
    assert relative_error(cached, uncached) <= bound
    if is_fp8(policy):
        return
    cached, uncached = np.asarray(cached, np.float32), np.asarray(uncached, np.float32)
    picked, wanted = np.argmax(cached, -1), np.argmax(uncached, -1)
    gap = np.take_along_axis(uncached, wanted[..., None], -1) - np.take_along_axis(
        uncached, picked[..., None], -1
    )
    own = own_errors.get(compute_dtype(policy), own_errors[BF16])
    resolvable = gap[..., 0] > 2 * own * np.max(np.abs(uncached))
    assert not (resolvable & (picked != wanted)).any(), (picked, wanted, gap[..., 0])


def assert_trains(losses: list[float], params: Any, learns: bool = True) -> None:
    """Finite losses and float32 parameters, and (where the own config learns)
    a lower loss at the end; where it does not (its gradients are not finite),
    a lower loss or every step skipped, the loss as it was."""
    assert np.isfinite(losses).all(), losses
    assert losses[-1] < losses[0] or (not learns and losses[-1] == losses[0]), losses
    assert all(np.isfinite(np.asarray(x, np.float32)).all() for x in jax.tree.leaves(params))
    assert set(np.dtype(x.dtype) for x in jax.tree.leaves(params)) == {np.dtype(np.float32)}


def max_error(a: Any, b: Any) -> float:
    """The largest absolute difference, in float32."""
    return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def all_finite(tree: Any) -> bool:
    return bool(all(jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)))


def step_figures(loss: Any, grads: Any, updates: Any, opt_state: Any) -> dict:
    """What a `loss_scaled` train step of a corpus script reports."""
    return {
        "loss": float(loss),
        "loss_finite": all_finite(loss),
        "grads_finite": all_finite(grads),
        "update_finite": all_finite(updates),
        "update_nonzero": bool(any(jnp.any(u != 0) for u in jax.tree.leaves(updates))),
        "loss_scale_after": float(jmp.get_loss_scale(opt_state).loss_scale),
    }


ROOT = Path(__file__).resolve().parents[2]


def run_apart(script: str, packages: Path, **env: str) -> dict:
    """The JSON a corpus script prints last, run in a process of its own with
    `packages` (what `./run` installed apart) first on its path."""
    path = os.pathsep.join([str(packages), str(ROOT / "tests"), str(ROOT)])
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "corpus" / script)],
            env={**os.environ, "PYTHONPATH": path, "TMPDIR": tmp, **env},
            capture_output=True,
            text=True,
            timeout=900,
        )
    assert done.returncode == 0, done.stdout + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
