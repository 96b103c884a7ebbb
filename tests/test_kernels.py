"""Kernels and `custom_vjp` functions the engine cannot rewrite inside.

A Pallas kernel is typed as it was traced: the engine runs it so, given its
inputs in the dtypes it was traced with. Its result, computed from values the
engine made half, is rounded back once to the compute dtype (as a float32-set
operation's is), so what the model computes from it stays half, as in the
model's own half config, which traces the kernel in half (MaxText's megablox
grouped matmul). A result the kernel writes into one of its inputs' buffers
(`input_output_aliases`) is that buffer: it keeps its dtype. A collective
that moves data between devices sends a half activation in half; one that
sums over devices sums a product's partial results in the reduce dtype.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.experimental import pallas as pl

import jmp_policy as jmp
import jmp_policy.nnx

from helpers import hlo_ops, saved_bytes_by_dtype
from jmp_policy.core import jax_internals as ji

BF16, F32 = np.dtype(jnp.bfloat16), np.dtype(np.float32)
N, D = 16, 32
X = jax.random.normal(jax.random.key(0), (N, D))
PARAMS = (
    jax.random.normal(jax.random.key(1), (D, D)) / np.sqrt(D),
    jax.random.normal(jax.random.key(2), (D, D)) / np.sqrt(D),
)
ORDER = jax.random.permutation(jax.random.key(3), N)
VALID = jnp.int32(12)  # Rows past it are padding, as in a grouped matmul.


def _matmul_kernel(x_ref, w_ref, o_ref):
    o_ref[...] = jnp.dot(x_ref[...], w_ref[...], preferred_element_type=o_ref.dtype)


def _kernel_matmul(x, w):
    shape = jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), x.dtype)
    return pl.pallas_call(_matmul_kernel, out_shape=shape, interpret=True)(x, w)


@jax.custom_vjp
def masked_matmul(x, w, valid):
    """A kernel's product of the first `valid` rows (an integer input)."""
    rows = jnp.arange(x.shape[0])[:, None] < valid
    return jnp.where(rows, _kernel_matmul(x, w), 0)


def _masked_matmul_fwd(x, w, valid):
    return masked_matmul(x, w, valid), (x, w, valid)


def _masked_matmul_bwd(res, g):
    x, w, valid = res
    g = jnp.where(jnp.arange(x.shape[0])[:, None] < valid, g, 0)
    return _kernel_matmul(g, w.T), _kernel_matmul(x.T, g), None


masked_matmul.defvjp(_masked_matmul_fwd, _masked_matmul_bwd)


@jax.custom_vjp
def permute(x, order):
    """Rows reordered by integer indices (a router's sort): no product."""
    return x[order]


permute.defvjp(
    lambda x, order: (x[order], order),
    lambda order, g: (jnp.zeros_like(g).at[order].set(g), None),
)


def _model(params, x, dtype=F32):
    """Float32 as written; with `dtype`, the model's own half config, which
    hands the kernel half operands (MaxText's `.astype(cfg.dtype)`)."""
    w1, w2 = params
    h = jnp.tanh(x.astype(dtype) @ w1.astype(dtype))
    h = permute(h, ORDER)
    return jnp.tanh(masked_matmul(h, w2.astype(dtype), VALID))


AUTOCAST = jmp.autocast(_model, "mixed_bfloat16")
HALF_OUT = "p=f32,c=bf16,o=bf16"  # Results as the engine makes them.


def _loss(f):
    return lambda p, x: jnp.sum(jnp.square(f(p, x).astype(F32)))


class KernelLinen(nn.Module):
    @nn.compact
    def __call__(self, x):
        return _model(tuple(self.param(f"w{i}", lambda k, v=v: v) for i, v in enumerate(PARAMS)), x)


class KernelNNX(nnx.Module):
    def __init__(self):
        self.params = nnx.List([nnx.Param(v) for v in PARAMS])

    def __call__(self, x):
        return _model(tuple(p[...] for p in self.params), x)


def _front_end(name: str):
    """The model under `name`, with the arguments it takes."""
    if name == "with_policy":
        linen = KernelLinen()
        return jmp.with_policy(linen.apply, "mixed_bfloat16"), linen.init(jax.random.key(0), X)
    if name == "PolicyModule":
        graph, state = nnx.split(jmp_policy.nnx.PolicyModule(KernelNNX(), "mixed_bfloat16"))
        return (lambda s, x: nnx.merge(graph, s)(x)), state
    return AUTOCAST, PARAMS


def _eqns(jaxpr):
    """Every equation of `jaxpr` and of the programs nested in it."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in ji.sub_jaxprs(eqn):
            yield from _eqns(sub)


def _kernel_types(fn) -> list[tuple[str, ...]]:
    program = jax.make_jaxpr(fn)(PARAMS, X)
    return [
        tuple(str(ji.shaped(v).dtype) for v in e.outvars)
        for e in _eqns(program.jaxpr)
        if e.primitive.name == "pallas_call"
    ]


@pytest.mark.parametrize("front_end", ["autocast", "with_policy", "PolicyModule"])
def test_a_kernels_result_from_half_values_is_given_in_the_compute_dtype(front_end):
    # The kernel runs as traced, in float32.
    assert _kernel_types(AUTOCAST) == [("float32",)]
    fn, params = _front_end(front_end)
    own = saved_bytes_by_dtype(_loss(lambda p, x: _model(p, x, BF16)), PARAMS, X)
    saved = saved_bytes_by_dtype(_loss(fn), params, X)
    # Before, the kernel's float32 result and what the model computed from
    # it were saved in float32: 3x the own config's float32 bytes.
    assert sum(saved.values()) <= 1.02 * sum(own.values()), (saved, own)
    assert saved.get(F32, 0) <= own.get(F32, 0), (saved, own)


def test_gradients_through_a_kernel_are_the_users_rule_in_the_inputs_dtypes():
    ref = jax.grad(_loss(_model))(PARAMS, X)
    hand = jax.grad(_loss(lambda p, x: _model(p, x, BF16)))(PARAMS, X)
    grads = jax.jit(jax.grad(_loss(AUTOCAST)))(PARAMS, X)
    for g, h, r in zip(grads, hand, ref):
        assert g.dtype == F32
        error, hand_error = (float(jnp.abs(a - r).max() / jnp.abs(r).max()) for a in (g, h))
        assert error <= 1.5 * hand_error, (error, hand_error)
    # The padding rows the user's rule masks get no gradient.
    dx = jax.jit(jax.grad(lambda x: _loss(AUTOCAST)(PARAMS, x)))(X)
    assert not jnp.any(dx[ORDER[VALID:]])


def _add_kernel(buf_ref, x_ref, o_ref):
    o_ref[...] = buf_ref[...] + x_ref[...].astype(o_ref.dtype)


def _accumulate(buf, x):
    """`buf + x`, written into `buf`'s own buffer."""
    return pl.pallas_call(
        _add_kernel,
        out_shape=jax.ShapeDtypeStruct(buf.shape, buf.dtype),
        input_output_aliases={0: 0},
        interpret=True,
    )(buf, x)


def _accumulates(params, buf):
    return _accumulate(buf, X @ params[0])


def _after_the_kernel(fn, *args) -> set[np.dtype]:
    """The floating dtypes of the values the program computes after its kernel."""
    eqns = jax.make_jaxpr(fn)(*args).jaxpr.eqns
    at = [e.primitive.name for e in eqns].index("pallas_call")
    return {
        np.dtype(v.aval.dtype)
        for e in eqns[at + 1 :]
        for v in e.outvars
        if jnp.issubdtype(v.aval.dtype, jnp.floating)
    }


def test_a_kernel_writing_into_its_inputs_buffer_keeps_the_buffers_dtype():
    buf = jnp.ones((N, D))
    program = jax.make_jaxpr(_accumulates)(PARAMS, buf)
    (kernel,) = [e for e in program.jaxpr.eqns if e.primitive.name == "pallas_call"]
    assert ji.aliased_outputs(kernel) == {0: 0}  # The seam reading JAX's parameter.
    mixed = jmp.autocast(_accumulates, "p=f32,c=bf16,o=f32")
    assert BF16 not in _after_the_kernel(mixed, PARAMS, buf)
    # Returned, it is state by data flow: its dtype, whatever the output dtype.
    assert jax.jit(jmp.autocast(_accumulates, HALF_OUT))(PARAMS, buf).dtype == F32
    # A kernel writing no input's buffer gives the compute dtype.
    fresh = jmp.autocast(lambda p, x: _kernel_matmul(x @ p[0], p[1]), "p=f32,c=bf16,o=f32")
    assert BF16 in _after_the_kernel(fresh, PARAMS, X)


def test_a_kernels_float32_result_stays_where_half_is_float16():
    # float16 lacks float32's range: the kernel's result is not rounded to it.
    fresh = lambda p, x: _kernel_matmul(x @ p[0], p[1])  # noqa: E731
    assert np.dtype(np.float16) not in _after_the_kernel(
        jmp.autocast(fresh, "p=f32,c=f16,o=f32"), PARAMS, X
    )


def test_a_collective_sends_a_half_activation_in_half():
    # Moved between devices, not computed on: the own half config sends bf16.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",))
    ring = [(i, (i + 1) % 8) for i in range(8)]

    def shifted(x, w):
        return jax.lax.ppermute(jnp.tanh(x @ w), "d", perm=ring)

    fn = jax.shard_map(shifted, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    mixed = jmp.autocast(fn, "p=f32,c=bf16,o=f32")
    x = jax.device_put(jax.random.normal(jax.random.key(4), (16, D)), NamedSharding(mesh, P("d")))
    sent = hlo_ops(jax.jit(mixed).lower(x, PARAMS[0]).as_text(), ("collective_permute",))
    assert [op.result_types for op in sent] == [("bf16",)], sent
    assert jnp.allclose(jax.jit(mixed)(x, PARAMS[0]), fn(x, PARAMS[0]), atol=0.02)


def _collective_dtypes(jaxpr, names=("psum", "reduce_scatter", "all_gather")):
    """The result dtypes of the collectives in `jaxpr` and the programs nested in it."""
    return [
        (e.primitive.name, np.dtype(e.outvars[0].aval.dtype))
        for e in _eqns(jaxpr)
        if e.primitive.name in names
    ]


def test_a_row_parallel_layers_partial_products_are_summed_in_the_reduce_dtype():
    # Megatron's tensor-parallel MLP: the second product's partial results
    # are summed over devices (psum, or psum_scatter then all_gather). The own
    # bf16 config sums them in bf16; so does mixed_bfloat16 (reduce dtype bf16),
    # and r=f32 sums in float32, as it does the sums XLA inserts for a sharded product.
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("d",))

    def mlp(x, w1, w2):
        y = jnp.tanh(x @ w1) @ w2
        z = jax.lax.psum_scatter(y, "d", scatter_dimension=1, tiled=True)
        return jax.lax.psum(y, "d") + jax.lax.all_gather(z, "d", axis=1, tiled=True)

    specs = (P(), P(None, "d"), P("d", None))
    fn = jax.shard_map(mlp, mesh=mesh, in_specs=specs, out_specs=P(), check_vma=False)
    args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip((X, *PARAMS), specs)]
    own = fn(*[a.astype(jnp.bfloat16) for a in args]).astype(F32)
    exact = fn(*args)
    for policy, summed in (("mixed_bfloat16", BF16), ("p=f32,c=bf16,o=f32,r=f32", F32)):
        mixed = jmp.autocast(fn, policy)
        found = _collective_dtypes(jax.make_jaxpr(mixed)(*args).jaxpr)
        assert sorted(found) == [("all_gather", summed), ("psum", summed),
                                 ("reduce_scatter", summed)], (policy, found)  # fmt: skip
        error = jnp.linalg.norm(jax.jit(mixed)(*args) - exact)
        assert error <= 1.5 * jnp.linalg.norm(own - exact), policy
    # Backward, the same collectives carry the cotangents in bf16.
    loss = lambda *a: jmp.autocast(fn, "mixed_bfloat16")(*a).sum()  # noqa: E731
    found = _collective_dtypes(jax.make_jaxpr(jax.grad(loss, argnums=(1, 2)))(*args).jaxpr)
    assert found and all(dtype == BF16 for _, dtype in found), found
