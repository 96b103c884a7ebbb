"""Tests of `autocast` (the op-level transform) and the float32-accumulating half matmuls.

Precision is checked where it matters, in the lowered StableHLO program: each
`stablehlo.dot_general` / `stablehlo.convolution` must take bf16 operands and
give an f32 result, in the forward and in the backward pass.

Tolerance: both operands of every product are rounded to bfloat16 (8 bits of
mantissa, relative error 2^-9 each); with float32 accumulation the products
then differ from float32 by a few 2^-8 relative. `BF16_TOL` (3e-2, about 8
bf16 ulps) relative to the largest reference magnitude covers that with room
for the extra cotangent rounding in the backward pass.

Compilation dominates the run time, so each test compiles one program that
computes the autocast and the reference results together.
"""

import functools

import flax.linen as nn
import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax
from jax.interpreters import mlir

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy import (
    FLOAT32_PRIMITIVES,
    HALF_PRIMITIVES,
    PROMOTE_PRIMITIVES,
    autocast,
    half_conv_general_dilated,
    half_dot_general,
)

from helpers import lowered_ops

BF16_TOL = 3e-2
MIXED = jmp.Policy(jnp.float32, jnp.bfloat16, jnp.float32)
# Products with float32 results, as `half_dot_general` gives them.
F32_RESULTS = MIXED.with_reduce_dtype(jnp.float32)
F32, BF16 = jnp.float32, jnp.bfloat16


def assert_close(actual, expected, tol=BF16_TOL):
    leaves, expected_leaves = jax.tree.leaves(actual), jax.tree.leaves(expected)
    assert len(leaves) == len(expected_leaves)
    for a, e in zip(leaves, expected_leaves):
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        assert a.shape == e.shape
        scale = max(1.0, float(np.max(np.abs(e))))
        err = float(np.max(np.abs(a - e)))
        assert err <= tol * scale, f"max error {err} > {tol} * {scale}"


def hlo_ops(fn, *args, platform=None):
    """(op, operand dtypes, result dtypes) of each StableHLO op of jit(fn).

    The program is lowered for this machine (CPU), or with `platform` for
    that platform, e.g. "cuda" (no GPU needed).
    """
    ops = lowered_ops(fn, *args, platform=platform)
    return [(op.name, list(op.operand_types), list(op.result_types)) for op in ops]


def products(fn, *args, op="dot_general", platform=None):
    return [(ins, outs) for name, ins, outs in hlo_ops(fn, *args, platform=platform) if name == op]


def assert_half_products(fn, *args, count, op="dot_general", half="bf16", out=None, platform=None):
    found = products(fn, *args, op=op, platform=platform)
    assert found == [([half, half], [out or half])] * count, found


def all_eqns(jaxpr):
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jex.core.jaxprs_in_params(eqn.params):
            yield from all_eqns(sub)


def eqns_named(fn, *args, name):
    return [e for e in all_eqns(jax.make_jaxpr(fn)(*args).jaxpr) if e.primitive.name == name]


def normal(seed, *shape, dtype=F32, scale=1.0):
    # numpy, not jax.random: no compilation for test data.
    x = np.random.default_rng(seed).standard_normal(shape) * scale
    return jnp.asarray(x.astype(dtype))


def half(x):
    return jnp.asarray(np.asarray(x).astype(BF16))


def run_together(fns, *args):
    """The results of `fns` on `args`, from one compiled program."""
    return jax.jit(lambda *a: [fn(*a) for fn in fns])(*args)


# The function of the issue: two matmuls, a LayerNorm-like normalisation, a softmax.
def block(x, w1, w2):
    h = x @ w1
    mean = h.mean(-1, keepdims=True)
    var = jnp.square(h - mean).mean(-1, keepdims=True)
    h = jax.nn.relu((h - mean) * lax.rsqrt(var + 1e-5))
    p = jax.nn.softmax(h @ w2, axis=-1)
    return jnp.sum(p * jnp.log(p + 1e-6))


X, W1, W2 = normal(0, 8, 16), normal(1, 16, 32, scale=0.25), normal(2, 32, 8, scale=0.25)
ALL = (0, 1, 2)


class TestBlock:
    def test_products_half_and_sensitive_ops_float32(self):
        ops = hlo_ops(autocast(block, MIXED), X, W1, W2)
        dots = [(i, o) for n, i, o in ops if n == "dot_general"]
        assert dots == [(["bf16", "bf16"], ["bf16"])] * 2
        for name in ("exponential", "log", "rsqrt"):
            found = [(i, o) for n, i, o in ops if n == name]
            assert found and all(set(i + o) <= {"f32"} for i, o in found), (name, found)
        # The sums (two means, softmax's, the total) in float32; softmax's
        # max, exact in any precision, in the products' bfloat16.
        found = sorted(o[0] for n, _, o in ops if n == "reduce")
        assert found == ["bf16"] + ["f32"] * 4, found

    def test_values_and_grads_match_float32(self):
        fns = [jax.value_and_grad(fn, ALL) for fn in (autocast(block, MIXED), block)]
        actual, expected = run_together(fns, X, W1, W2)
        assert_close(actual, expected)
        assert float(actual[0]) != float(expected[0])  # The products really are rounded.

    def test_every_backward_product_is_half(self):
        # Forward 2, backward 2 per matmul (input and weight cotangents).
        assert_half_products(jax.grad(autocast(block, MIXED), ALL), X, W1, W2, count=6)
        # Without the input's gradient, its product is dead code and dropped.
        assert_half_products(jax.grad(autocast(block, MIXED), (1, 2)), X, W1, W2, count=5)

    def test_gpu_program_products_are_half(self):
        # The program XLA:GPU gets (without the CPU work-around): the same products.
        fn = jax.grad(autocast(block, MIXED), ALL)
        assert_half_products(fn, X, W1, W2, count=6, platform="cuda")

    def test_grads_have_primal_dtypes(self):
        grads = jax.eval_shape(jax.grad(autocast(block, MIXED), ALL), half(X), half(W1), half(W2))
        assert [g.dtype for g in grads] == [BF16] * 3

    def test_the_trap_custom_vjp_avoids(self):
        # Plain preferred_element_type=f32 makes a backward product f32 x f32.
        # If this fails, JAX has fixed the trap upstream.
        def f(x, w):
            return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=F32).sum()

        assert (["f32", "f32"], ["f32"]) in products(jax.grad(f, (0, 1)), half(X), half(W1))

    def test_policy_spec_string_and_output_dtype(self):
        assert jax.eval_shape(autocast(block, "mixed_bfloat16"), X, W1, W2).dtype == F32
        policy = jmp.Policy(F32, BF16, BF16)
        assert jax.eval_shape(autocast(block, policy), X, W1, W2).dtype == BF16
        assert_half_products(autocast(block, "mixed_float16"), X, W1, W2, count=2, half="f16")


class TestDtypes:
    def test_already_half_function_is_a_no_op(self):
        def f(x, w1, w2):
            h = jax.nn.relu(jnp.tanh(x @ w1) * 2.0)
            return (h @ w2).reshape(-1)

        args = [half(a) for a in (X, W1, W2)]
        assert hlo_ops(autocast(f, "bf16"), *args) == hlo_ops(f, *args)
        # Under mixed_bfloat16 only the result's cast to float32 is added.
        mixed, cast = hlo_ops(autocast(f, MIXED), *args), ("convert", ["bf16"], ["f32"])
        assert [op for op in mixed if op != cast] == hlo_ops(f, *args) and cast in mixed
        assert_close(*run_together([autocast(f, "bf16"), f], *args), tol=0)

    def test_sensitive_ops_of_half_inputs_run_in_float32(self):
        x = normal(3, 4, 4096, dtype=BF16, scale=4)
        lse = functools.partial(jax.nn.logsumexp, axis=-1)
        exps = eqns_named(autocast(lse, MIXED), x, name="exp")
        assert exps and all(e.outvars[0].aval.dtype == F32 for e in exps)
        exact = lambda x: lse(x.astype(F32))  # noqa: E731
        auto, plain, ref = run_together([autocast(lse, MIXED), lse, exact], x)
        auto_err, half_err = (np.abs(np.asarray(a, np.float64) - ref).max() for a in (auto, plain))
        assert auto_err < half_err / 4, (auto_err, half_err)

    def test_softmax_jvp_rule_is_autocast_too(self):
        x, c = normal(4, 4, 8, dtype=BF16), normal(5, 4, 8, dtype=BF16)

        def f(x, c):
            return (jax.nn.softmax(x) * c).sum()

        grad = jax.grad(autocast(f, MIXED))
        exps = eqns_named(grad, x, c, name="exp")
        assert exps and all(e.outvars[0].aval.dtype == F32 for e in exps)
        assert jax.eval_shape(grad, x, c).dtype == BF16
        exact = jax.grad(lambda x, c: f(x.astype(F32), c.astype(F32)))
        assert_close(*run_together([grad, exact], x, c))

    def test_weak_scalars_do_not_promote(self):
        x = normal(6, 3, dtype=BF16)
        (mul,) = eqns_named(autocast(lambda x: x * 2.0, "bf16"), x, name="mul")
        assert mul.outvars[0].aval.dtype == BF16

    def test_ints_bools_and_keys_untouched(self):
        def f(key, n, mask, x):
            key, sub = jax.random.split(key)
            noise = jax.random.normal(sub, x.shape)
            count = jnp.sum(n * 3 // 2) + jnp.argmax(x @ x.T, axis=-1)
            return key, count, jnp.where(mask, x + noise, 0.0), mask & (n > 1)

        args = (jax.random.key(0), jnp.arange(8), jnp.arange(8) % 2 == 0, X[:, :8])
        actual, expected = run_together([autocast(f, MIXED), f], *args)
        assert jax.tree.map(lambda a: a.dtype, actual) == jax.tree.map(lambda a: a.dtype, expected)
        assert (jax.random.key_data(actual[0]) == jax.random.key_data(expected[0])).all()
        for a, e in zip(actual[1:], expected[1:]):
            if a.dtype != F32:
                np.testing.assert_array_equal(a, e)

    def test_static_arguments_and_kwargs(self):
        def f(x, w, *, n, mode):
            return (x @ w) * n if mode == "scale" else x @ w

        fns = [functools.partial(fn, n=3, mode="scale") for fn in (autocast(f, MIXED), f)]
        assert_close(*run_together(fns, X, W1))

    def test_unknown_primitives_get_the_original_dtypes(self):
        seen = []
        my_op = jex.core.Primitive("my_op")
        my_op.def_impl(lambda x: x)
        my_op.def_abstract_eval(lambda x: seen.append(x.dtype) or x)
        mlir.register_lowering(my_op, mlir.lower_fun(lambda x: x, multiple_results=False))

        def f(x):
            return my_op.bind(jnp.exp(x)), lax.bitcast_convert_type(jnp.exp(x), jnp.int16)

        out, bits = jax.jit(autocast(f, MIXED))(normal(7, 3, dtype=BF16))
        assert seen and seen == [BF16] * len(seen)
        assert out.dtype == F32 and bits.dtype == jnp.int16

    def test_primitive_lists(self):
        prims = jex.core.primitives
        known = {getattr(prims, n).name for n in dir(prims) if n.endswith("_p")}
        known |= {"split", "tile", "stack", "unstack"}  # Primitives in JAX 0.12, not 0.10.
        # Not in jax.extend's list: matched by name.
        known |= {"ragged_dot_general", "reduce_scatter"}
        for ops in (HALF_PRIMITIVES, FLOAT32_PRIMITIVES, PROMOTE_PRIMITIVES):
            assert ops <= known, ops - known
        assert not (FLOAT32_PRIMITIVES & PROMOTE_PRIMITIVES)
        assert {"exp", "log", "log1p", "expm1", "pow", "rsqrt", "reduce_sum"} <= FLOAT32_PRIMITIVES

    def test_lists_are_extendable(self):
        x = normal(8, 3, dtype=BF16)

        def tanh_dtype(fn):
            return eqns_named(fn, x, name="tanh")[0].outvars[0].aval.dtype

        assert tanh_dtype(autocast(jnp.tanh, MIXED)) == BF16
        wider = FLOAT32_PRIMITIVES | {lax.tanh_p}
        assert tanh_dtype(autocast(jnp.tanh, MIXED, float32_primitives=wider)) == F32
        f32_products = products(autocast(block, MIXED, half_primitives=()), X, W1, W2)
        assert f32_products == [(["f32", "f32"], ["f32"])] * 2

    def test_bad_arguments(self):
        with pytest.raises(TypeError, match="primitive names"):
            autocast(block, MIXED, float32_primitives=[3])
        with pytest.raises(ValueError, match="Unknown dtype"):
            autocast(block, "c=bf17")
        with pytest.raises(TypeError, match="autocast expects a function"):
            autocast(3, MIXED)


class TestComposition:
    def test_jit_inside_and_outside(self):
        def f(x, w1, w2):
            return jax.jit(block)(x, w1, w2)

        assert_half_products(autocast(f, MIXED), X, W1, W2, count=2)
        assert_close(*run_together([autocast(f, MIXED), block], X, W1, W2))

    def test_vmap_inside_and_outside(self):
        batched = jax.vmap(block, in_axes=(0, None, None))
        outside = jax.vmap(autocast(block, MIXED), in_axes=(0, None, None))
        inside = autocast(batched, MIXED)
        xs = normal(9, 3, 8, 16)
        for fn in (outside, inside):
            assert_half_products(fn, xs, W1, W2, count=2)
        actual = run_together([outside, inside, batched], xs, W1, W2)
        assert_close(actual[:2], actual[2:] * 2)

    def test_scan_inside_and_outside(self):
        def rnn(h, xs, w):
            def step(h, x):
                h = jnp.tanh(h @ w + x)
                return h, jnp.exp(h).sum()

            h, ys = lax.scan(step, h, xs)
            return h.sum() + ys.sum()

        def step(h, x, w):  # autocast inside a scan body
            return jnp.tanh(h @ w + x), None

        h, xs, w = normal(10, 4, 16), normal(11, 5, 4, 16), normal(12, 16, 16, scale=0.25)
        assert_half_products(autocast(rnn, MIXED), h, xs, w, count=1)
        grad = jax.grad(autocast(rnn, MIXED), (0, 2))
        assert_half_products(grad, h, xs, w, count=3)

        def scan(step):
            return lambda h, xs, w: lax.scan(functools.partial(step, w=w), h, xs)[0]

        fns = [grad, jax.grad(rnn, (0, 2)), scan(autocast(step, MIXED)), scan(step)]
        actual = run_together(fns, h, xs, w)
        assert_close(actual[::2], actual[1::2])

    def test_checkpoint_inside_and_outside(self):
        def f(x, w1, w2):
            return jax.checkpoint(block)(x, w1, w2)

        assert eqns_named(autocast(f, MIXED), X, W1, W2, name=jex.core.primitives.remat_p.name)
        fns = (autocast(f, MIXED), jax.checkpoint(autocast(block, MIXED)), block)
        grads = [jax.grad(fn, (1, 2)) for fn in fns]
        for grad in grads[:2]:
            assert_half_products(grad, X, W1, W2, count=5)
        actual = run_together(grads, X, W1, W2)
        assert_close(actual[:2], actual[2:] * 2)

    def test_cond_and_while(self):
        def f(x, w):
            x = lax.cond(x.sum() > 0, lambda x: x @ w, lambda x: -(x @ w), x)
            body = lambda c: (c[0] + 1, jnp.tanh(c[1] @ w))  # noqa: E731
            return lax.while_loop(lambda c: c[0] < 2, body, (0, x))[1]

        w = normal(13, 16, 16, scale=0.25)
        assert_half_products(autocast(f, MIXED), X, w, count=3)
        assert_close(*run_together([autocast(f, MIXED), f], X, w))

    def test_grad_inside(self):
        # autocast of an already differentiated program: its backward products too.
        fn = autocast(jax.grad(block, ALL), MIXED)
        assert_half_products(fn, X, W1, W2, count=6)
        assert_close(*run_together([fn, jax.grad(block, ALL)], X, W1, W2))

    def test_nested_autocast(self):
        twice = autocast(autocast(block, MIXED), MIXED)
        assert hlo_ops(twice, X, W1, W2) == hlo_ops(autocast(block, MIXED), X, W1, W2)
        assert_close(*run_together([jax.grad(fn, (1, 2)) for fn in (twice, block)], X, W1, W2))
        # The innermost policy decides for the operations inside it.
        inner_f16 = autocast(autocast(block, "mixed_float16"), MIXED)
        assert_half_products(inner_f16, X, W1, W2, count=2, half="f16")


class MLP(nn.Module):
    dot_general: object = None

    @nn.compact
    def __call__(self, x):
        kw = {} if self.dot_general is None else {"dot_general": self.dot_general}
        return nn.Dense(4, **kw)(jax.nn.gelu(nn.Dense(32, **kw)(x)))


def mlp_loss(model, params, x):
    return jnp.mean(jnp.square(model.apply(params, x)))


class TestHalfDotGeneral:
    @pytest.mark.parametrize(
        "lhs_shape, rhs_shape, dims",
        [
            ((2, 3), (3, 4), (((1,), (0,)), ((), ()))),
            ((5, 2, 3), (5, 3, 4), (((2,), (1,)), ((0,), (0,)))),
            ((3, 2, 4), (4, 5, 3), (((0, 2), (2, 0)), ((), ()))),
            ((2, 5, 3), (3, 5, 4), (((2,), (0,)), ((1,), (1,)))),
            ((3,), (3, 4), (((0,), (0,)), ((), ()))),
        ],
    )
    def test_values_grads_and_dtypes(self, lhs_shape, rhs_shape, dims):
        lhs, rhs = normal(14, *lhs_shape, dtype=BF16), normal(15, *rhs_shape)

        def loss(dot, lhs, rhs):
            return jnp.sum(jnp.sin(dot(lhs, rhs, dims)))

        exact = functools.partial(loss, lambda a, b, d: lax.dot_general(a.astype(F32), b, d))
        approx = functools.partial(loss, half_dot_general)
        assert jax.eval_shape(lambda a, b: half_dot_general(a, b, dims), lhs, rhs).dtype == F32
        fns = [jax.value_and_grad(fn, (0, 1)) for fn in (approx, exact)]
        actual, expected = run_together(fns, lhs, rhs)
        assert [g.dtype for g in actual[1]] == [BF16, F32]
        assert_close(actual, expected)
        assert_half_products(jax.grad(approx, (0, 1)), lhs, rhs, count=3, out="f32")

    def test_result_dtype_like_lax(self):
        x, w, dims = half(X), half(W1), (((1,), (0,)), ((), ()))
        dot = functools.partial(half_dot_general, dimension_numbers=dims)
        assert jax.eval_shape(dot, x, w).dtype == BF16
        assert jax.eval_shape(functools.partial(dot, preferred_element_type=F32), x, w).dtype == F32
        ints = jnp.arange(6).reshape(2, 3)
        fns = [lambda a: half_dot_general(a, a.T, dims), lambda a: a @ a.T]
        actual, expected = run_together(fns, ints)
        np.testing.assert_array_equal(actual, expected)
        f16 = functools.partial(half_dot_general, compute_dtype=jnp.float16)
        assert_half_products(lambda a, b: f16(a, b, dims), X, W1, count=1, out="f32", half="f16")

    def test_compute_dtype_defaults_to_the_operands_half_dtype(self):
        dims = (((1,), (0,)), ((), ()))
        dot = lambda a, b: half_dot_general(a, b, dims)
        # float16 operands (a float16 policy) multiply in float16, not bfloat16.
        f16x, f16w = X.astype(jnp.float16), W1.astype(jnp.float16)
        assert_half_products(jax.grad(lambda a, b: jnp.sin(dot(a, b)).sum(), (0, 1)), f16x, f16w,
                             count=3, half="f16", out="f32")  # fmt: skip
        x = jnp.asarray(np.full((1, 2), 1 + 2.0**-9, np.float16))  # exact in f16, not bf16
        assert float(dot(x, jnp.ones((2, 1), jnp.float16))[0, 0]) == 2 + 2.0**-8
        # One half operand decides; float32 operands multiply in bfloat16.
        assert_half_products(dot, f16x, W1, count=1, out="f32", half="f16")
        assert_half_products(dot, X, W1, count=1, out="f32", half="bf16")

    @pytest.mark.parametrize("bad", [jnp.float32, "bf16", jnp.int8, 3])
    def test_bad_compute_dtype(self, bad):
        with pytest.raises(TypeError, match="compute_dtype must be jnp.bfloat16, jnp.float16"):
            half_dot_general(X, W1, (((1,), (0,)), ((), ())), compute_dtype=bad)
        with pytest.raises(TypeError, match="compute_dtype"):
            half_conv_general_dilated(
                jnp.ones((1, 2, 5)), jnp.ones((3, 2, 2)), (1,), "VALID", compute_dtype=bad
            )

    def test_flax_linen_dense(self):
        x = normal(16, 8, 16)
        model, half_model = MLP(), MLP(dot_general=half_dot_general)
        params = jax.jit(model.init)(jax.random.key(0), x)
        half_params = jax.eval_shape(half_model.init, jax.random.key(0), x)
        assert jax.tree.structure(half_params) == jax.tree.structure(params)
        grad, expected, auto = (
            jax.grad(fn, (0, 1))
            for fn in (
                functools.partial(mlp_loss, half_model),
                functools.partial(mlp_loss, model),
                autocast(functools.partial(mlp_loss, model), F32_RESULTS),
            )
        )
        for fn in (grad, auto):  # autocast of the plain model gives the same products.
            assert_half_products(fn, params, x, count=6, out="f32")
        actual = run_together([grad, auto, expected], params, x)
        assert_close(actual[:2], actual[2:] * 2)

    def test_flax_nnx_linear(self):
        layer = nnx.Linear(16, 4, dot_general=half_dot_general, rngs=nnx.Rngs(0))
        x = normal(17, 8, 16)
        grads = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(layer)
        kernel, bias = layer.kernel[...], layer.bias[...]
        assert_close(grads.kernel[...], jax.jit(lambda k, b: 2 * x.T @ (x @ k + b))(kernel, bias))
        assert jax.eval_shape(layer, x).dtype == F32
        dims = (((1,), (0,)), ((), ()))
        assert_half_products(lambda k: half_dot_general(x, k, dims), kernel, count=1, out="f32")


class Noisy(nn.Module):
    @nn.compact
    def __call__(self, x, train):
        x = nn.BatchNorm(use_running_average=not train)(nn.Dense(8)(x))
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=not train)(x))


class TestFlaxModels:
    def test_linen_apply_with_batch_stats_and_rngs(self):
        model, x = Noisy(), normal(20, 4, 3)
        variables = jax.jit(model.init, static_argnames="train")(jax.random.key(0), x, train=False)
        kwargs = dict(train=True, rngs={"dropout": jax.random.key(1)}, mutable=("batch_stats",))
        auto = functools.partial(autocast(model.apply, MIXED), **kwargs)
        assert_half_products(auto, variables, x, count=2)
        plain = functools.partial(model.apply, **kwargs)
        (y, updates), (y_ref, updates_ref) = run_together([auto, plain], variables, x)
        assert y.dtype == F32 and jax.tree.structure(updates) == jax.tree.structure(updates_ref)
        assert_close((y, updates), (y_ref, updates_ref))

    def test_nnx_split_merge(self):
        graphdef, state = nnx.split(nnx.Linear(16, 4, rngs=nnx.Rngs(0)))
        x = normal(21, 8, 16)

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x) ** 2)

        grad = jax.grad(autocast(loss, MIXED))
        assert_half_products(grad, state, x, count=2)
        assert_close(*run_together([grad, jax.grad(loss)], state, x))


class TestConvolution:
    @pytest.mark.parametrize("groups", [1, 2])
    def test_flax_conv(self, groups):
        x = normal(18, 2, 8, 8, 4)
        conv = nn.Conv(4, (3, 3), feature_group_count=groups)
        half_conv = nn.Conv(4, (3, 3), feature_group_count=groups,
                            conv_general_dilated=half_conv_general_dilated)  # fmt: skip
        params = jax.jit(conv.init)(jax.random.key(1), x)

        def loss(model, params, x):
            return jnp.sum(jnp.sin(model.apply(params, x)))

        grad, auto, expected = (
            jax.grad(fn, (0, 1))
            for fn in (
                functools.partial(loss, half_conv),
                autocast(functools.partial(loss, conv), F32_RESULTS),
                functools.partial(loss, conv),
            )
        )
        for fn in (grad, auto):
            assert_half_products(fn, params, x, count=3, op="convolution", out="f32")
        actual = run_together([grad, auto, expected], params, x)
        assert_close(actual[:2], actual[2:] * 2)


class Attention(nn.Module):
    """A pre-norm multi-head self-attention block with a gelu MLP."""

    @nn.compact
    def __call__(self, x):
        q, k, v = jnp.split(nn.DenseGeneral((3 * 2, 8))(nn.LayerNorm()(x)), 3, axis=-2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(8.0)
        mixed = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(scores, axis=-1), v)
        x = x + nn.DenseGeneral(16, axis=(-2, -1))(mixed)
        return x + nn.Dense(16)(jax.nn.gelu(nn.Dense(32)(nn.LayerNorm()(x))))


def test_transformer_block_train_step_all_products_half():
    x = normal(19, 2, 6, 16)
    model = Attention()
    params = jax.jit(model.init)(jax.random.key(2), x)

    def loss(params, x):
        return jnp.mean(jnp.square(model.apply(params, x)))

    grad = jax.grad(autocast(loss, MIXED), (0, 1))
    # 6 products forward (qkv, scores, mix, out, 2 MLP), 2 cotangents each backward.
    assert_half_products(grad, params, x, count=18)
    assert_close(*run_together([grad, jax.grad(loss, (0, 1))], params, x))


# --------------------------------------------------------------------------
# Issue 10: NNX modules that update their state, and `jax.pmap` / `shard_map` bodies.


class NoisyNNX(nnx.Module):
    """Linear, BatchNorm in training mode (running statistics) and Dropout (an `Rngs`)."""

    def __init__(self, rngs):
        self.linear = nnx.Linear(3, 4, rngs=rngs)
        self.norm = nnx.BatchNorm(4, momentum=0.5, rngs=rngs)
        self.dropout = nnx.Dropout(0.5, rngs=rngs)

    def __call__(self, x):
        return self.dropout(self.norm(self.linear(x)))


def _nnx_state_leaves(model):
    return jax.tree.leaves(nnx.state(model, nnx.BatchStat)) + [
        jax.random.key_data(k) if jnp.issubdtype(k.dtype, jax.dtypes.prng_key) else k
        for k in jax.tree.leaves(nnx.state(model, nnx.RngState))
    ]


@pytest.mark.parametrize("form", ["module", "argument", "method", "nnx.jit"])
def test_autocast_of_nnx_module_updates_its_state_as_the_module_does(form):
    # The reproduction: `TraceContextError: Cannot mutate BatchStat from
    # a different trace level`, eagerly and under nnx.jit; as an argument, the
    # updates were silently dropped. The statistics and the RNG counters must
    # move exactly as the plain module's do.
    x = normal(30, 6, 3)
    auto_model, plain_model = NoisyNNX(nnx.Rngs(0)), NoisyNNX(nnx.Rngs(0))
    if form == "module":
        out = autocast(auto_model, MIXED)(x)
    elif form == "argument":
        out = autocast(lambda m, x: m(x), MIXED)(auto_model, x)
    elif form == "method":
        out = autocast(auto_model.__call__, MIXED)(x)
    else:
        out = nnx.jit(lambda m, x: autocast(m, MIXED)(x))(auto_model, x)
    expected = plain_model(x)
    assert out.dtype == F32
    assert_close(out, expected)
    stats, plain_stats = _nnx_state_leaves(auto_model), _nnx_state_leaves(plain_model)
    assert [s.dtype for s in stats] == [s.dtype for s in plain_stats]
    assert not np.allclose(np.asarray(plain_model.norm.mean[...]), 0)  # They did move.
    assert_close(stats, plain_stats)
    np.testing.assert_array_equal(
        np.asarray(auto_model.dropout.rngs.count[...]),
        np.asarray(plain_model.dropout.rngs.count[...]),
    )


class _HalvesItsWeight(nnx.Module):
    """Writes its own parameter in its call (a projection step), and counts calls."""

    def __init__(self):
        self.w = nnx.Param(jnp.ones((3, 2)))
        self.calls = nnx.Variable(jnp.array(0))

    def __call__(self, x):
        self.w[...] = self.w[...] * 0.5
        self.calls[...] += 1
        return x @ self.w[...]


@pytest.mark.parametrize("form", ["autocast", "PolicyModule", "nnx.jit"])
def test_a_parameter_an_nnx_module_writes_is_written_back(form):
    # As plain NNX does; parameters the call only reads are left alone.
    model, x = _HalvesItsWeight(), normal(32, 4, 3)
    if form == "autocast":
        out = autocast(model, MIXED)(x)
    elif form == "PolicyModule":
        wrapped = jmp.nnx.PolicyModule(model, MIXED)
        out, model = wrapped(x), wrapped.module  # The wrapper holds the module it runs.
    else:
        out = nnx.jit(lambda m, x: autocast(m, MIXED)(x))(model, x)
    assert out.dtype == F32 and model.w[...].dtype == F32
    np.testing.assert_array_equal(np.asarray(model.w[...]), np.full((3, 2), 0.5, np.float32))
    assert int(model.calls[...]) == 1


def test_autocast_of_a_closure_over_an_nnx_module_says_to_pass_it():
    model = NoisyNNX(nnx.Rngs(0))
    with pytest.raises(TypeError, match=r"pass the module as an argument"):
        autocast(lambda x: model(x), MIXED)(normal(31, 6, 3))


def test_autocast_rewrites_pmap_and_shard_map_bodies():
    # The reproduction: `autocast(jax.pmap(f), policy)` left the body float32.
    from jax.sharding import NamedSharding, PartitionSpec as P

    x, w = normal(32, 8, 2, 16), normal(33, 8, 16, 4)
    f = jax.pmap(lambda x, w: jnp.tanh(x @ w))
    assert_half_products(autocast(f, MIXED), x, w, count=1)
    assert_close(autocast(f, MIXED)(x, w), f(x, w))
    grad = jax.grad(lambda x, w: autocast(f, MIXED)(x, w).sum(), (0, 1))
    assert_half_products(grad, x, w, count=3)

    mesh = jax.make_mesh((8,), ("d",))
    g = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(P("d"), P()), out_specs=P("d"))
    xs = jax.device_put(normal(34, 16, 16), NamedSharding(mesh, P("d")))
    w2 = normal(35, 16, 4)
    assert_half_products(autocast(g, MIXED), xs, w2, count=1)
    assert_close(autocast(g, MIXED)(xs, w2), g(xs, w2))


# ------------------------------------------------------------ a user's custom_vjp


@jax.custom_vjp
def _clipped_layer(x, w):
    """tanh(x @ w), whose backward clips the cotangent of `w` to [-0.1, 0.1]."""
    return jnp.tanh(x @ w)


def _clipped_fwd(x, w):
    y = _clipped_layer(x, w)
    return y, (x, w, y)


def _clipped_bwd(res, g):
    x, w, y = res
    d = g * (1 - y**2)
    return d @ w.T, jnp.clip(x.T @ d, -0.1, 0.1)


_clipped_layer.defvjp(_clipped_fwd, _clipped_bwd)


@pytest.mark.parametrize(
    "policy, half",
    [
        ("mixed_bfloat16", "bf16"),
        ("p=f32,c=f32,o=f32,m=bf16", "bf16"),
        ("mixed_float8", "f8E4M3FN"),
    ],
)
def test_products_inside_a_users_custom_vjp_take_the_policy(policy, half):
    x = jax.random.normal(jax.random.key(0), (8, 16))
    w = jax.random.normal(jax.random.key(1), (16, 4)) / 4

    def loss(x, w):
        return jnp.sum(_clipped_layer(x, w) ** 2)

    grad = jax.grad(autocast(loss, policy), argnums=(0, 1))
    dots = [op for op in lowered_ops(grad, x, w) if op.name == "dot_general"]
    # The forward product, its recomputation for the backward (the residuals
    # are the inputs) and the user's two backward ones: none float32.
    assert len(dots) == 4 and all(op.operand_types == (half, half) for op in dots), dots
    got, want = grad(x, w), jax.grad(loss, argnums=(0, 1))(x, w)
    # The user's rule, not JAX's: the weight's cotangent is clipped (in the
    # dtype its products leave their results in: 0.1 rounded to bfloat16).
    clip = float(np.float32(0.1))
    assert float(jnp.max(jnp.abs(want[1]))) == clip
    assert abs(float(jnp.max(jnp.abs(got[1]))) - clip) <= clip * 2**-8
    assert got[1].dtype == w.dtype

    # As close as the same layer's gradient outside a custom_vjp.
    def plain(x, w):
        y = jnp.tanh(x @ w)
        return jnp.sum(y**2)

    def error(a, b):
        return float(jnp.max(jnp.abs(a[0] - b[0])))  # The input's (unclipped) gradient.

    plain_grad = jax.grad(autocast(plain, policy), argnums=(0, 1))(x, w)
    assert error(got, want) <= 1.5 * error(plain_grad, jax.grad(plain, argnums=(0, 1))(x, w))


@pytest.mark.parametrize(
    "inner_policy", ["p=f32,c=f32,o=f32,m=bf16", "mixed_float8", "mixed_mxfp8"]
)
def test_jmp_policys_own_products_in_an_autocast_are_not_rewritten_again(inner_policy):
    # Half, FP8 and block-scaled products, each a `custom_vjp` the engine made:
    # an outer autocast leaves them as decided.
    x, w = jnp.ones((4, 32)), jnp.ones((32, 32)) / 32
    inner = autocast(lambda x, w: x @ w, inner_policy)
    once = [op for op in lowered_ops(jax.grad(lambda x, w: inner(x, w).sum(), (0, 1)), x, w)]
    twice = lowered_ops(jax.grad(lambda x, w: autocast(inner, MIXED)(x, w).sum(), (0, 1)), x, w)
    assert [(op.name, op.operand_types) for op in twice if op.name == "dot_general"] == [
        (op.name, op.operand_types) for op in once if op.name == "dot_general"
    ]


def test_what_no_result_needs_is_not_run_again_and_effects_are_kept():
    # A model built inside its apply draws parameters it then replaces: the
    # engine does not run such dead equations again; effects always run.
    seen = []

    def f(x, w):
        jax.random.normal(jax.random.key(0), (64, 64))  # Drawn, never used.
        jax.debug.callback(lambda v: seen.append(float(v)), x.sum())
        return x @ w

    x, w = jnp.ones((2, 4)), jnp.ones((4, 3))
    program = jax.make_jaxpr(autocast(f, MIXED))(x, w)
    names = {e.primitive.name for e in program.jaxpr.eqns}
    assert "debug_callback" in names and "random_bits" not in str(program)
    np.testing.assert_allclose(jax.jit(autocast(f, MIXED))(x, w), np.full((2, 3), 4.0))
    assert seen == [8.0]
