"""The values between products: one rule in every front end.

A value the model computes from a product's half result stays in the compute
dtype, as the model's own half config keeps it; a float32-set operation
(an exponential, GELU's cube) computes in float32 and is rounded back once;
sums over many values (a norm's statistics) stay float32. Under `with_policy`
and `jmp_policy.nnx` this also holds where the policy's dtype fields do not
reach a layer (one written on raw parameters, an NNX layer behind linen's
`ToLinen`), as under `autocast`, which sets no fields.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy.core.diagnostics import saved_residuals

from helpers import hlo_ops

BF16, F16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32)
D = 32
X = jax.random.normal(jax.random.key(0), (4, 8, D))


def _model(params, x, dtype=F32):
    """Two pre-norm MLP blocks on raw parameters, in `dtype` (float32 as the
    front ends run it: no layer, so no dtype field a policy could set)."""
    w1, w2, scale = params
    x = x.astype(dtype)
    for _ in range(2):
        stats = jnp.mean(jnp.square(x.astype(F32)), axis=-1, keepdims=True)
        h = (x.astype(F32) * jax.lax.rsqrt(stats + 1e-6) * scale).astype(dtype)
        h = jax.nn.gelu(h @ w1.astype(dtype))
        x = x + h @ w2.astype(dtype)
    return x


PARAMS = (
    jax.random.normal(jax.random.key(1), (D, 4 * D)) / np.sqrt(D),
    jax.random.normal(jax.random.key(2), (4 * D, D)) / np.sqrt(4 * D),
    jnp.ones((D,)),
)


class RawLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        names = ("w1", "w2", "scale")
        return _model(tuple(self.param(n, lambda k, v=v: v) for n, v in zip(names, PARAMS)), x)


class RawNNX(nnx.Module):
    def __init__(self):
        self.params = nnx.List([nnx.Param(v) for v in PARAMS])

    def __call__(self, x):
        return _model(tuple(p[...] for p in self.params), x)


def _loss(f):
    return lambda *a: jnp.sum(jnp.square(f(*a).astype(F32)))


def _saved(loss, *args) -> dict[np.dtype, int]:
    """The bytes the backward pass saves (arguments left out), by dtype."""
    by_dtype: dict[np.dtype, int] = {}
    for aval, origin in saved_residuals(loss, *args):
        if not origin.startswith("from the argument"):
            dtype = np.dtype(aval.dtype)
            by_dtype[dtype] = by_dtype.get(dtype, 0) + int(aval.size) * dtype.itemsize
    return by_dtype


@pytest.fixture(scope="module")
def own_config() -> dict[np.dtype, int]:
    """The model's own half config: float32 parameters, computing in bfloat16."""
    return _saved(_loss(lambda p, x: _model(p, x, BF16)), PARAMS, X)


def _front_ends() -> dict[str, tuple[Any, tuple]]:
    linen = RawLinen()
    params = linen.init(jax.random.key(0), X)
    graph, state = nnx.split(jmp_policy.nnx.PolicyModule(RawNNX(), "mixed_bfloat16"))
    return {
        "with_policy": (jmp.with_policy(linen.apply, "mixed_bfloat16"), (params, X)),
        "PolicyModule": (lambda s, x: nnx.merge(graph, s)(x), (state, X)),
        "autocast": (jmp.autocast(_model, "mixed_bfloat16"), (PARAMS, X)),
    }


@pytest.mark.parametrize("front_end", ["with_policy", "PolicyModule", "autocast"])
def test_layers_no_field_reaches_save_what_the_own_config_saves(front_end, own_config):
    fn, args = _front_ends()[front_end]
    saved = _saved(_loss(fn), *args)
    # 0.81x in each front end. Before, with only the products rewritten,
    # `with_policy` and `PolicyModule` saved 1.41x: the products' results,
    # GELU and the residual stream in float32.
    assert sum(saved.values()) <= 1.02 * sum(own_config.values()), (saved, own_config)
    # Float32: only the norms' statistics (one per row).
    assert saved.get(F32, 0) <= own_config.get(F32, 0), (saved, own_config)


def _dense_exp(dtype):
    class DenseExp(nn.Module):
        dtype: Any = jnp.float32

        @nn.compact
        def __call__(self, x):
            return jnp.exp(nn.Dense(D, dtype=self.dtype)(x))

    return DenseExp(dtype=dtype)


def test_a_float32_set_operation_on_a_fields_half_value_computes_wide_and_rounds_back():
    # The Dense's field makes its result bfloat16; the exponential of it
    # computes in float32 and gives bfloat16, as the own config's does.
    model = _dense_exp(jnp.float32)
    params = model.init(jax.random.key(0), X)
    fn = jmp.with_policy(model.apply, "p=f32,c=bf16,o=bf16")
    out = jax.jit(fn)(params, X)
    assert out.dtype == BF16
    exps = hlo_ops(jax.jit(fn).lower(params, X).as_text(), ("exponential",))
    assert [op.result_types for op in exps] == [("f32",)]
    hand = jax.jit(_dense_exp(jnp.bfloat16).apply)(params, X)
    ref = jax.jit(model.apply)(params, X)
    assert jnp.abs(out.astype(F32) - ref).max() <= jnp.abs(hand.astype(F32) - ref).max()


def test_under_float16_the_fields_half_values_run_as_the_own_config_runs_them():
    # float16 has not float32's range: a float32 result rounded back to it
    # may overflow, and kept float32 it would save more than the own config;
    # the front ends leave what the fields make float16 as the own config runs it.
    model = _dense_exp(jnp.float32)
    params = model.init(jax.random.key(0), X)
    fn = jmp.with_policy(model.apply, "p=f32,c=f16,o=f16")
    exps = hlo_ops(jax.jit(fn).lower(params, X).as_text(), ("exponential",))
    assert [op.result_types for op in exps] == [("f16",)]
