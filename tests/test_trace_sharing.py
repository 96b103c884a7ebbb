"""Trace time: what a deep model repeats is traced once, and the program stays the same.

A deep model makes the same half products and the same norms in every layer.
jmp_policy shares their traces: a product with float32 accumulation is one
function per signature (`matmul.accumulating_dot`), the rematerialised norms
of one program one checkpointed trace (`tests/test_linen_norms.py`), NNX
attention one rewrite under a matmul dtype, and the `m=bf16` rewrite leaves
nested programs without a product as traced. The
lowering-time figures are `benchmarks/lowering.py`'s; here, that sharing
happens, that it changes nothing in the program or its values, and that
what differs (a shape, a dtype, the CPU form's setting) is not shared.
"""

from __future__ import annotations

import gc
import types
from unittest import mock

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jmp
from jmp_policy.engine import interpreter
from jmp_policy.engine.products import cpu_form
from jmp_policy.engine.products import half as matmul

from helpers import assert_bitwise_equal, lowered_ops

DENSE = (((1,), (0,)), ((), ()))
WIDTH = 16


def stack(dot, depth):
    """A loss of `depth` same-shaped layers, each product through `dot(x, w, dims)`."""

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(dot(x, w, DENSE))
        return jnp.sum(x)

    return loss


def operands(depth):
    keys = jax.random.split(jax.random.key(0), depth + 1)
    ws = [jax.random.normal(k, (WIDTH, WIDTH)) / 4 for k in keys[1:]]
    return ws, jax.random.normal(keys[0], (8, WIDTH))


def unshared(x, w, dims):
    """`half_dot_general`'s product traced anew at each call."""
    product = matmul.dot_product(dims)
    return matmul.accumulating_product(product, x, w, np.dtype(jnp.bfloat16), x.dtype)


def backward_traces(depth):
    """How many equations the backward products' rewrite runs, tracing `depth` layers."""
    matmul.clear_shared_products()
    with mock.patch.object(
        matmul, "_accumulate_in_float32", wraps=matmul._accumulate_in_float32
    ) as seen:
        jax.make_jaxpr(jax.grad(stack(jmp.half_dot_general, depth)))(*operands(depth))
    return seen.call_count


def test_identical_products_trace_their_backward_once():
    one = backward_traces(1)
    assert one > 0
    assert backward_traces(6) == one


def test_shared_products_give_the_program_and_values_of_unshared_ones():
    depth = 4
    ws, x = operands(depth)
    grad = lambda dot: jax.jit(jax.value_and_grad(stack(dot, depth)))  # noqa: E731
    matmul.clear_shared_products()
    shared_ops = lowered_ops(grad(jmp.half_dot_general), ws, x)
    plain_ops = lowered_ops(grad(unshared), ws, x)
    assert [(op.name, op.operands, op.results) for op in shared_ops] == [
        (op.name, op.operands, op.results) for op in plain_ops
    ]
    dots = [op for op in shared_ops if op.name == "dot_general"]
    # Forward and two backward products per layer, less the input's gradient.
    assert len(dots) == 3 * depth - 1
    assert {(op.operand_types, op.result_types) for op in dots} == {(("bf16", "bf16"), ("f32",))}
    assert_bitwise_equal(grad(jmp.half_dot_general)(ws, x), grad(unshared)(ws, x))


@pytest.mark.parametrize(
    ("other", "why"),
    [
        (lambda x, w: jmp.half_dot_general(x, w[:, :8], DENSE), "shape"),
        (lambda x, w: jmp.half_dot_general(x, w, DENSE, compute_dtype=jnp.float16), "dtype"),
        (lambda x, w: jmp.half_dot_general(x, w, (((1,), (1,)), ((), ()))), "dimensions"),
    ],
)
def test_what_differs_is_traced_on_its_own(other, why):
    (w,), x = operands(1)
    f = lambda x, w: jmp.half_dot_general(x, w, DENSE)  # noqa: E731
    matmul.clear_shared_products()
    first = jax.jit(jax.grad(lambda x, w: f(x, w).sum() + other(x, w).sum(), (0, 1)))(x, w)
    alone = jax.jit(jax.grad(lambda x, w: other(x, w).sum(), (0, 1)))(x, w)
    plain = jax.jit(jax.grad(lambda x, w: f(x, w).sum(), (0, 1)))(x, w)
    for a, b, c in zip(first, alone, plain):
        np.testing.assert_allclose(a, b + c, rtol=1e-5, atol=1e-5, err_msg=why)


def test_the_cpu_form_setting_is_not_reused_across(monkeypatch):
    (w,), x = operands(1)
    grad = lambda: jax.jit(jax.grad(lambda w: jmp.half_dot_general(x, w, DENSE).sum()))  # noqa: E731
    matmul.clear_shared_products()

    def scopes():
        text = grad().lower(w).as_text(debug_info=True)
        return text.count(cpu_form.SCOPE)

    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", True)
    assert scopes() > 0  # The CPU form, traced first ...
    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", False)
    assert scopes() == 0  # ... is not what a trace with it off gets ...
    monkeypatch.setattr(cpu_form, "_CPU_BF16_DOT_WORKAROUND", True)
    assert scopes() > 0  # ... nor the reverse.


def test_matmul_rewrite_leaves_product_free_nested_programs_as_traced():
    # A silu (jit) and a checkpointed elementwise block hold no product: the
    # rewrite binds them as traced instead of running them through its
    # interpreter, which would change nothing in them. A relu (custom_jvp)
    # is rewritten all the same: its JVP rule, a Python function, may hold
    # products its primal program does not show.
    def f(x, w):
        y = jax.nn.relu(x @ w) + jax.nn.silu(x)
        return jax.checkpoint(lambda y: jnp.tanh(y) * 2)(y) @ w

    x, w = jnp.ones((4, WIDTH)), jnp.ones((WIDTH, WIDTH))
    m_bf16 = jmp.with_policy(f, "p=f32,c=f32,o=f32,m=bf16")
    interpreted = []

    def record(jaxpr, *args, **kwargs):
        interpreted.append(str(jaxpr))
        return run(jaxpr, *args, **kwargs)

    run = interpreter._eval
    with mock.patch.object(interpreter, "_eval", side_effect=record):
        rewritten = jax.make_jaxpr(m_bf16)(x, w)

    def nested(closed):
        """The programs held by the equations, as text, by primitive name."""
        return {
            e.primitive.name: str(getattr(body, "jaxpr", body))
            for e in closed.jaxpr.eqns
            for body in e.params.values()
            if isinstance(body, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr))
        }

    before, after = nested(jax.make_jaxpr(f)(x, w)), nested(rewritten)
    assert {"custom_jvp_call", "jit", "remat2"} <= set(before)
    assert before["jit"] not in interpreted and before["remat2"] not in interpreted
    assert before["custom_jvp_call"] in interpreted
    assert all(after[name] == before[name] for name in before)
    dots = [op for op in lowered_ops(jax.jit(m_bf16), x, w) if op.name == "dot_general"]
    assert [op.operand_types for op in dots] == [("bf16", "bf16")] * 2


def test_matmul_rewrite_reaches_the_products_of_a_custom_jvp_rule():
    # The primal has no product, its JVP rule has one: under jax.jvp it
    # takes the matmul dtype.
    @jax.custom_jvp
    def prefix_sum(x):
        return jnp.cumsum(x, axis=-1)

    @prefix_sum.defjvp
    def _(primals, tangents):
        (x,), (t,) = primals, tangents
        return prefix_sum(x), t @ jnp.triu(jnp.ones((x.shape[-1],) * 2, x.dtype))

    f = interpreter.matmuls_in(lambda x: jnp.sum(jnp.sin(prefix_sum(x))), jnp.bfloat16)
    x = jnp.linspace(0, 1, 8).reshape(2, 4)
    dots = [
        op
        for op in lowered_ops(jax.jit(lambda x: jax.jvp(f, (x,), (x,))), x)
        if op.name == "dot_general"
    ]
    assert dots and all(op.operand_types == ("bf16", "bf16") for op in dots)


def test_a_forward_mode_derivative_still_names_the_way_out():
    (w,), x = operands(1)
    matmul.clear_shared_products()
    with pytest.raises(TypeError, match="Forward-mode differentiation"):
        jax.jvp(lambda w: jmp.half_dot_general(x, w, DENSE), (w,), (w,))


def nnx_attention_stack(depth, policy):
    from flax import nnx

    class Stack(nnx.Module):
        def __init__(self, rngs):
            self.layers = nnx.List(
                [nnx.MultiHeadAttention(2, WIDTH, decode=False, rngs=rngs) for _ in range(depth)]
            )

        def __call__(self, x):
            for layer in self.layers:
                x = x + layer(x)
            return x

    return jmp.nnx.with_policy(Stack(nnx.Rngs(0)), policy)


@jax.numpy_dtype_promotion("standard")  # jax.nn's attention mixes bf16 and f32.
def test_nnx_attention_of_every_layer_shares_one_rewrite():
    from flax import nnx

    import jmp_policy.nnx  # noqa: F401  (jmp.nnx)

    x = jax.random.normal(jax.random.key(1), (2, 8, WIDTH))
    model = nnx_attention_stack(3, "p=f32,c=bf16,o=f32,m=bf16")
    interpreter.clear_shared_traces()
    with mock.patch.object(
        interpreter, "trace_and_eval", wraps=interpreter.trace_and_eval
    ) as traced:
        jax.make_jaxpr(lambda x: model(x))(x)
    assert traced.call_count == 1  # Three layers' attention, one rewrite.

    def grads(m):
        graphdef, params = nnx.split(m, nnx.Param)
        loss = lambda p, x: jnp.sum(nnx.merge(graphdef, p)(x) ** 2)  # noqa: E731
        return jax.jit(jax.grad(loss, argnums=(0, 1))), params

    shared_fn, params = grads(model)
    with mock.patch.object(interpreter, "_shared_rewrite", return_value=NotImplemented):
        unshared_fn, _ = grads(model)
        unshared_ops = lowered_ops(unshared_fn, params, x)
        unshared = unshared_fn(params, x)
    shared_ops = lowered_ops(shared_fn, params, x)
    assert [(o.name, o.operands, o.results) for o in shared_ops] == [
        (o.name, o.operands, o.results) for o in unshared_ops
    ]
    dots = [o for o in shared_ops if o.name == "dot_general"]
    assert dots and all(o.operand_types == ("bf16", "bf16") for o in dots)
    assert_bitwise_equal(shared_fn(params, x), unshared)


@jax.numpy_dtype_promotion("standard")  # jax.nn's attention mixes bf16 and f32.
def test_an_attention_that_reads_a_variable_is_never_stale():
    # An attention_fn closing over another module's learned bias: a shared
    # trace would keep the bias it first saw, eagerly and across two jits.
    from flax import nnx

    import jmp_policy.nnx  # noqa: F401  (jmp.nnx)

    class Bias(nnx.Module):
        def __init__(self):
            self.value = nnx.Param(jnp.zeros(()))

    class Model(nnx.Module):
        def __init__(self, rngs):
            self.bias = bias = Bias()

            def attention_fn(q, k, v, **kwargs):
                return nnx.dot_product_attention(q, k, v, **kwargs) + bias.value[...]

            self.attention = nnx.MultiHeadAttention(
                2, WIDTH, decode=False, attention_fn=attention_fn, rngs=rngs
            )

        def __call__(self, x):
            return self.attention(x)

    x = jax.random.normal(jax.random.key(1), (2, 4, WIDTH))
    plain = Model(nnx.Rngs(0))
    model = jmp.nnx.PolicyModule(plain, "p=f32,c=bf16,o=f32,m=bf16")  # A copy of `plain`.
    interpreter.clear_shared_traces()
    # Two jitted functions, each traced once (NNX bakes a closure's value in).
    jitted = [nnx.jit(lambda m, x: m(x)), nnx.jit(lambda m, x: m(x) * 1.0)]
    before = plain(x)
    for bias, step in zip((0.0, 1.1), jitted):
        model.module.bias.value[...] = bias  # The copy's: its function reads it, not plain's.
        outs = [model(x), step(model, x)]
        plain.bias.value[...] = bias
        want = plain(x)
        plain.bias.value[...] = 0.0
        for out in outs:
            np.testing.assert_allclose(out, want, atol=0.05)
    assert float(jnp.max(jnp.abs(want - before))) > 0.5  # The bias moves the output.
    assert not any(interpreter._SHARED_REWRITES.values())  # Nothing of it was shared.


# What an attention function may read besides its arguments: a Python module's
# attribute and a class attribute (a temperature set by a config, a schedule).
TEMPERATURE = types.ModuleType("temperature")
TEMPERATURE.value = 1.0


class Sharpness:
    value = 1.0


def tempered_attention(q, k, v, **kwargs):
    from flax import nnx

    q = q * (Sharpness.value / TEMPERATURE.value)
    return nnx.dot_product_attention(q, k, v, **kwargs)


@pytest.mark.parametrize("setting", [TEMPERATURE, Sharpness], ids=["module", "class"])
@jax.numpy_dtype_promotion("standard")  # jax.nn's attention mixes bf16 and f32.
def test_an_attention_that_reads_a_global_setting_is_never_stale(setting):
    """A module or class attribute the attention reads is no argument: only Flax's
    own attention shares a trace, so a changed setting is seen at the next call."""
    from flax import nnx

    import jmp_policy.nnx  # noqa: F401  (jmp.nnx)

    x = jax.random.normal(jax.random.key(1), (2, 4, WIDTH))
    plain = nnx.MultiHeadAttention(
        2, WIDTH, decode=False, attention_fn=tempered_attention, rngs=nnx.Rngs(0)
    )
    model = jmp.nnx.PolicyModule(plain, "p=f32,c=bf16,o=f32,m=bf16")
    interpreter.clear_shared_traces()
    outs, wants = [], []
    try:
        for value in (1.0, 2.0):
            setting.value = value
            outs.append(model(x))
            wants.append(plain(x))
    finally:
        setting.value = 1.0
    for out, want, other in zip(outs, wants, wants[::-1]):
        np.testing.assert_allclose(out, want, atol=0.1)  # bf16 products
        assert jnp.mean(jnp.abs(out - want)) < jnp.mean(jnp.abs(out - other)) / 4
    assert not any(interpreter._SHARED_REWRITES.values())


def test_a_shared_rewrite_keeps_no_function_or_module_alive():
    # A call given something other than arrays and plain values (here an
    # activation function; NNX attention that sows its weights gets the
    # module) is rewritten on the spot, and nothing of it is cached.
    def f(x, w, activation, scale):
        return activation(x @ w) * scale

    g = interpreter.matmuls_in(f, jnp.bfloat16, shared=True)
    x, w = jnp.ones((4, WIDTH)), jnp.ones((WIDTH, WIDTH)) / WIDTH
    interpreter.clear_shared_traces()
    out = jax.jit(lambda x, w: g(x, w, jnp.tanh, 2.0))(x, w)
    np.testing.assert_allclose(out, 2 * np.tanh(np.ones((4, WIDTH))), rtol=1e-2)
    assert not interpreter._SHARED_REWRITES.get(f)
    # Plain values are part of the signature: two scales, two shared rewrites.
    h = interpreter.matmuls_in(lambda x, w, scale: (x @ w) * scale, jnp.bfloat16, shared=True)
    jax.make_jaxpr(lambda x, w: h(x, w, 2.0) + h(x, w, 2.0) + h(x, w, 3.0))(x, w)
    assert sum(map(len, interpreter._SHARED_REWRITES.values())) == 2  # Scales 2.0 and 3.0.
    del h  # The cache holds its function weakly: gone with it.
    gc.collect()
    assert sum(map(len, interpreter._SHARED_REWRITES.values())) == 0


def fp8_traces(depth):
    """How many times the per-tensor FP8 product is traced, tracing `depth` layers."""
    from jmp_policy.engine.products import fp8, shard_local

    matmul.clear_shared_products()
    with mock.patch.object(shard_local, "product", wraps=shard_local.product) as seen:
        jax.make_jaxpr(jax.grad(stack(fp8.fp8_dot_general, depth)))(*operands(depth))
    return seen.call_count


def test_identical_fp8_products_trace_once_and_stay_fp8():
    from jmp_policy.engine.products import fp8

    one = fp8_traces(1)
    assert one > 0 and fp8_traces(6) == one
    depth = 3
    ws, x = operands(depth)
    matmul.clear_shared_products()
    dots = [
        op
        for op in lowered_ops(jax.jit(jax.grad(stack(fp8.fp8_dot_general, depth))), ws, x)
        if op.name == "dot_general"
    ]
    assert len(dots) == 3 * depth - 1
    assert all(set(op.operand_types) <= {"f8E4M3FN", "f8E5M2"} for op in dots)


def test_checkpointed_layers_of_one_program_share_one_rewrite():
    # A deep model's checkpointed layers are one program many times over (here
    # with a nested jit and a sharding constraint in each): rewritten once,
    # traced and differentiated by JAX once; a layer a rule puts in another
    # dtype, or one whose program differs, gets its own.
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
    spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def layer(x, w):
        y = jax.jit(jnp.tanh)(x @ w)
        return jax.lax.with_sharding_constraint(y, spec)

    def model(x, ws):
        for w in ws:
            x = jax.checkpoint(layer)(x, w)
        return jax.checkpoint(lambda x, w: jnp.sin(x @ w))(x, ws[0]).sum()

    x = jnp.ones((4, WIDTH))
    ws = [jnp.full((WIDTH, WIDTH), 1.0 / WIDTH) for _ in range(4)]
    f = jmp.autocast(model, "p=f32,c=f32,o=f32,m=bf16")
    bodies = []

    def record(eqn, rules, marks):
        body = remat_body(eqn, rules, marks)
        bodies.append(body)
        return body

    remat_body = interpreter._remat_body
    with mock.patch.object(interpreter, "_remat_body", side_effect=record):
        grads = jax.grad(f, argnums=1)(x, ws)
    assert len(bodies) == 5 and len(set(map(id, bodies))) == 2  # 4 layers, then the sine.
    want = jax.grad(model, argnums=1)(x, ws)
    for g, w in zip(grads, want):
        np.testing.assert_allclose(g, w, rtol=2e-2, atol=1e-3)
    dots = [
        op for op in lowered_ops(jax.jit(jax.grad(f, argnums=1)), x, ws) if op.name == "dot_general"
    ]
    assert dots and all(op.operand_types == ("bf16", "bf16") for op in dots)


def test_checkpointed_layers_a_rule_puts_in_other_dtypes_are_rewritten_apart():
    import flax.linen as nn

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x):
            return jnp.tanh(nn.Dense(WIDTH, use_bias=False)(x))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            for i in range(3):
                x = nn.remat(Layer)(name=f"layer{i}")(x)
            return x

    model, x = Model(), jnp.ones((4, WIDTH))
    params = model.init(jax.random.key(0), x)
    f = jmp.with_policy(model.apply, "p=f32,c=f32,o=f32,m=bf16", rules={"layer2": "f32"})
    dots = [op for op in lowered_ops(jax.jit(f), params, x) if op.name == "dot_general"]
    assert [op.operand_types for op in dots] == [("bf16", "bf16")] * 2 + [("f32", "f32")]


def test_program_keys_tell_nested_programs_and_shardings_apart():
    from jmp_policy.core import jax_internals as ji

    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
    P = jax.sharding.PartitionSpec

    def program(activation, spec):
        def f(x):
            y = jax.jit(activation)(x)
            return jax.lax.with_sharding_constraint(y, jax.sharding.NamedSharding(mesh, spec))

        return jax.make_jaxpr(f)(jnp.ones((4, 4))).jaxpr

    key = ji.program_key(program(jnp.tanh, P()))
    assert key is not None and key == ji.program_key(program(jnp.tanh, P()))
    assert key != ji.program_key(program(jnp.sin, P()))
    assert key != ji.program_key(program(jnp.tanh, P("x")))

    # The key reads how the operations connect, and literals and parameters by type and value.
    def key(f, *args):
        return ji.program_key(jax.make_jaxpr(f)(*args).jaxpr)

    x = jnp.ones(3)
    assert key(lambda x, y: x - y, x, x) == key(lambda a, b: a - b, x, x)
    assert key(lambda x, y: x - y, x, x) != key(lambda x, y: y - x, x, x)
    assert key(lambda x: x * 0.0, x) != key(lambda x: x * -0.0, x)
    assert key(lambda x: jnp.sum(x, axis=0), x) != key(lambda x: jnp.sum(x[None], axis=1), x)
    # A custom_jvp's rule is a function the key cannot compare: no key.
    assert ji.program_key(jax.make_jaxpr(jax.nn.relu)(jnp.ones(3)).jaxpr) is None
