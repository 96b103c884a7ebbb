"""The author's precision survives a policy (`jmp_policy.engine.intent`), in every front end.

Products the program shows to be float32 on purpose run as written: those
with a table operand (made from positions, `iota`, integers and literals:
rotary angles, sinusoidal timestep embeddings, however the product is
written), those whose operand the program widens from a narrower float (a
router the model's own half config multiplies in float32), and regions the
user marks (`as_written`, autocast's `rules=`). Everything else follows the
policy, every word of it: grouped products (`ragged_dot`) too.

Positions near 8000 are where it shows: bfloat16 holds integers exactly only
up to 256, so a rotary angle there is off by up to 32 radians.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jmp_policy as jmp
import jmp_policy.nnx  # noqa: F401

from helpers import lowered_ops
from jmp_policy.engine.products.fp8_format import fp8_quantize, fp8_scale

F32, BF16 = jnp.float32, jnp.bfloat16
POLICIES = ["mixed_bfloat16", "mixed_bfloat16,m=bf16", "mixed_float8"]
FRONT_ENDS = ["with_policy", "autocast", "nnx"]


def _angles(form, pos, inv):
    """Rotary angles `positions x frequencies`, written as people write them."""
    if form == "einsum":
        return jnp.einsum("bi,j->bij", pos, inv)
    if form == "matmul":
        return pos[..., None] @ inv[None, :]
    if form == "dot":
        return jnp.dot(pos[..., None], inv[None, :])
    return jnp.einsum("bi,j->bij", pos, inv, preferred_element_type=F32)


def _rotate(h, pos, form):
    inv = 1.0 / (10000.0 ** (jnp.arange(0, 8, dtype=F32) / 8))
    angles = _angles(form, pos.astype(F32), inv)
    cos, sin = jnp.cos(angles).astype(h.dtype), jnp.sin(angles).astype(h.dtype)
    h1, h2 = jnp.split(h, 2, axis=-1)
    return jnp.concatenate([h1 * cos - h2 * sin, h1 * sin + h2 * cos], -1), angles


class LinenRope(nn.Module):
    form: str
    dtype: object = None

    @nn.compact
    def __call__(self, x, pos):
        return _rotate(nn.Dense(16, dtype=self.dtype)(x), pos, self.form)


class NnxRope(nnx.Module):
    def __init__(self, form, rngs, dtype=None):
        self.form, self.dense = form, nnx.Linear(16, 16, dtype=dtype, rngs=rngs)

    def __call__(self, x, pos):
        return _rotate(self.dense(x), pos, self.form)


X = jax.random.normal(jax.random.key(0), (2, 32, 16))
LONG = jnp.broadcast_to(jnp.arange(8000, 8032), (2, 32))
SHORT = jnp.broadcast_to(jnp.arange(32), (2, 32))


def _rope_errors(form, front_end, policy):
    """Errors against float32 at long and short positions: the policy's output,
    its angles, and the model's own bf16 config's output."""
    if front_end == "nnx":
        model = NnxRope(form, nnx.Rngs(0))
        hand = NnxRope(form, nnx.Rngs(0), dtype=BF16)
        run = jax.jit(lambda x, p: jmp.nnx.PolicyModule(model, policy)(x, p))
        reference, by_hand = jax.jit(model), jax.jit(hand)
    else:
        model = LinenRope(form)
        variables = model.init(jax.random.key(0), X, SHORT)
        transform = jmp.with_policy if front_end == "with_policy" else jmp.autocast
        run = jax.jit(lambda x, p: transform(model.apply, policy)(variables, x, p))
        reference = jax.jit(lambda x, p: model.apply(variables, x, p))
        by_hand = jax.jit(lambda x, p: LinenRope(form, BF16).apply(variables, x, p))
    errors = {}
    for name, pos in (("long", LONG), ("short", SHORT)):
        (out, angles), (ref, ref_angles) = run(X, pos), reference(X, pos)
        hand_out = by_hand(X, pos)[0]
        errors[name] = [float(jnp.max(jnp.abs(a.astype(F32) - ref))) for a in (out, hand_out)]
        np.testing.assert_allclose(angles, ref_angles, rtol=1e-6)  # As written: float32.
    return errors


@pytest.mark.parametrize("form", ["einsum", "matmul", "dot", "preferred_float32"])
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_rotary_angles_keep_float32_at_long_positions(form, front_end):
    # At 8000 bf16 angles were off by up to 32 rad: an error of 6 on this model.
    for policy in POLICIES:
        errors = _rope_errors(form, front_end, policy)
        (long, hand), (short, _) = errors["long"], errors["short"]
        if policy == "mixed_float8":
            # The Dense's own FP8 error; long positions add nothing to it.
            assert long <= 1.5 * short + 1e-3, (policy, errors)
        else:
            assert long <= 1.5 * hand, (policy, errors)


class TimestepEmbedder(nn.Module):
    """A DiT-style embedder, its frequencies a table, its timesteps float32 inputs."""

    dtype: object = None
    product: bool = True

    @nn.compact
    def __call__(self, t):
        freqs = jnp.exp(-jnp.log(10000.0) * jnp.arange(16, dtype=F32) / 16)
        e = jnp.einsum("b,d->bd", t, freqs) if self.product else t[:, None] * freqs
        e = jnp.concatenate([jnp.cos(e), jnp.sin(e)], -1).astype(self.dtype or F32)
        return nn.Dense(32, dtype=self.dtype)(nn.silu(nn.Dense(32, dtype=self.dtype)(e)))


def test_a_float32_timestep_embedding_keeps_float32_in_every_front_end():
    t = jnp.array([999.0, 998.0, 997.0, 513.0, 3.0])
    model = TimestepEmbedder()
    variables = model.init(jax.random.key(0), t)
    ref = model.apply(variables, t)

    def error(fn):
        return float(jnp.max(jnp.abs(jax.jit(fn)(variables, t).astype(F32) - ref)))

    hand = error(TimestepEmbedder(dtype=BF16).apply)
    for policy in POLICIES:
        for transform in (jmp.with_policy, jmp.autocast):
            written = error(transform(model.apply, policy))
            # The same model with the product written elementwise (exact before too).
            elementwise = error(transform(TimestepEmbedder(product=False).apply, policy))
            assert written <= 1.5 * elementwise + 1e-4, (policy, transform, written, elementwise)
            if policy != "mixed_float8":
                assert written <= 1.5 * hand, (policy, transform, written, hand)  # Was 0.48.


class Router(nn.Module):
    """DeepSeek-V3's router: float32 by the author's `.astype`, in a bf16 model."""

    dtype: object = F32

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(16, dtype=self.dtype)(x)
        w = self.param("router", nn.initializers.normal(1.0), (16, 4))
        return jnp.dot(h.astype(F32), w.astype(F32))


class NnxRouter(nnx.Module):
    def __init__(self, rngs, dtype=F32):
        self.dense = nnx.Linear(8, 16, dtype=dtype, rngs=rngs)
        self.router = nnx.Param(jax.random.normal(rngs.params(), (16, 4)))

    def __call__(self, x):
        return jnp.dot(self.dense(x).astype(F32), self.router[...].astype(F32))


def _product_types(fn, *args):
    return [(op.operand_types, op.result_types) for op in lowered_ops(fn, *args)
            if op.name == "dot_general"]  # fmt: skip


def test_a_product_the_models_own_half_config_widens_stays_float32():
    x = jnp.ones((2, 8))
    linen = Router()
    variables = linen.init(jax.random.key(0), x)
    nnx_model = NnxRouter(nnx.Rngs(0))
    expected = [(("bf16", "bf16"), ("bf16",)), (("f32", "f32"), ("f32",))]
    assert _product_types(Router(dtype=BF16).apply, variables, x) == expected  # By hand.
    for policy in ("mixed_bfloat16", "mixed_float8"):
        wrapped = jmp.with_policy(linen.apply, policy)
        assert _product_types(wrapped, variables, x)[-1] == expected[-1], policy
        module = jmp.nnx.PolicyModule(nnx_model, policy)
        assert _product_types(lambda x: module(x), x)[-1] == expected[-1], policy
        # autocast of the hand config: the widening is in its program.
        hand = jmp.autocast(Router(dtype=BF16).apply, policy)
        assert _product_types(hand, variables, x)[-1] == expected[-1], policy
    # In a float32 model the `.astype` is a no-op, invisible: `as_written` says it.
    assert _product_types(jmp.autocast(linen.apply, "mixed_bfloat16"), variables, x)[-1] == (
        ("bf16", "bf16"),
        ("bf16",),
    )


def test_as_written_keeps_a_region_as_the_program_wrote_it_in_every_front_end():
    class Head(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Dense(8)(x)
            with jmp.as_written():
                return h.astype(F32) @ jnp.ones((8, 4), F32)

    x = jnp.ones((2, 8))
    variables = Head().init(jax.random.key(0), x)
    for transform in (jmp.with_policy, jmp.autocast):
        types = _product_types(transform(Head().apply, "mixed_float8"), variables, x)
        assert types[-1] == (("f32", "f32"), ("f32",)), (transform, types)
        assert types[0][0] == ("f8E4M3FN", "f8E4M3FN"), types  # The rest: the policy.

    class NnxHead(nnx.Module):
        def __init__(self):
            self.dense = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

        def __call__(self, x):
            h = self.dense(x)
            with jmp.as_written():
                return h.astype(F32) @ jnp.ones((8, 4), F32)

    module = jmp.nnx.PolicyModule(NnxHead(), "mixed_float8")
    types = _product_types(lambda x: module(x), x)
    assert types[-1] == (("f32", "f32"), ("f32",)), types
    assert types[0][0] == ("f8E4M3FN", "f8E4M3FN"), types

    @jmp.as_written()  # A decorator too.
    def table(x):
        return x @ x.T

    assert _product_types(jmp.autocast(table, "mixed_bfloat16"), x) == [(("f32", "f32"), ("f32",))]


def test_autocasts_rules_choose_a_policy_by_named_scope():
    def f(x, w):
        with jax.named_scope("rotary"):
            a = x @ w
        with jax.named_scope("block_0/mlp"):
            b = x @ w
        return a, b, x @ w

    x, w = jnp.ones((2, 8)), jnp.ones((8, 8))
    plain = _product_types(jmp.autocast(f, "mixed_bfloat16"), x, w)
    assert [ins for ins, _ in plain] == [("bf16", "bf16")] * 3
    ruled = jmp.autocast(f, "mixed_bfloat16", rules={"rotary": None, r"mlp$": "mixed_float8"})
    assert [ins for ins, _ in _product_types(ruled, x, w)] == [
        ("f32", "f32"),  # As written.
        ("f8E4M3FN", "f8E4M3FN"),
        ("bf16", "bf16"),  # No rule: the policy.
    ]
    # Keeping float32 also lifts what the program made half.
    full = jmp.autocast(lambda x, w: x.astype(BF16) @ w.astype(BF16), "mixed_bfloat16",
                        rules={"": "float32"})  # fmt: skip
    assert _product_types(full, x, w) == [(("f32", "f32"), ("f32",))]


@pytest.mark.parametrize(
    "rules, error, match",
    [
        ({1: None}, TypeError, "keys are regexes"),
        ({"(": None}, ValueError, "no regex"),
        ({"x": "bf17"}, ValueError, "Unknown dtype"),
        ({"x": 3}, TypeError, r"rules\['x'\]"),
        (["x"], TypeError, "mapping of named-scope regexes"),
    ],
)
def test_autocasts_bad_rules_are_refused_by_name(rules, error, match):
    with pytest.raises(error, match=match):
        jmp.autocast(lambda x: x, "mixed_bfloat16", rules=rules)


GROUPS = jnp.array([2, 1, 3], jnp.int32)
TOKENS = jax.random.normal(jax.random.key(1), (6, 8))
EXPERTS = jax.random.normal(jax.random.key(2), (3, 8, 4))


def _experts(x, w):
    return jnp.tanh(lax.ragged_dot(x, w, GROUPS))


class Moe(nn.Module):
    @nn.compact
    def __call__(self, x):
        w = self.param("experts", lambda key: EXPERTS)
        return _experts(x, w)


class NnxMoe(nnx.Module):
    def __init__(self):
        self.w = nnx.Param(EXPERTS)

    def __call__(self, x):
        return _experts(x, self.w[...])


_SHORT_NAMES = {"bfloat16": "bf16", "float32": "f32", "float8_e4m3fn": "f8E4M3FN",
                "float8_e5m2": "f8E5M2"}  # fmt: skip


def _grouped(fn, *args):
    """The operand dtypes of each `ragged_dot_general` in `fn`'s program, nested ones
    too (XLA:CPU lowers it to a masked `dot_general`: the program says it first)."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name == "ragged_dot_general":
                yield tuple(_SHORT_NAMES[str(v.aval.dtype)] for v in eqn.invars[:2])
            for value in eqn.params.values():
                for v in value if isinstance(value, (tuple, list)) else (value,):
                    inner = getattr(v, "jaxpr", v)
                    if hasattr(inner, "eqns"):
                        yield from walk(inner)

    return list(walk(jax.make_jaxpr(fn)(*args).jaxpr))


@pytest.mark.parametrize(
    "policy, operands",
    [
        ("mixed_bfloat16", ("bf16", "bf16")),
        ("mixed_bfloat16,m=bf16", ("bf16", "bf16")),
        ("mixed_float8", ("f8E4M3FN", "f8E4M3FN")),
    ],
)
@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_grouped_products_take_the_policy_in_both_passes(front_end, policy, operands):
    if front_end == "nnx":
        graph, state = nnx.split(jmp.nnx.PolicyModule(NnxMoe(), policy))
        params, apply = state, lambda p, x: nnx.merge(graph, p)(x)
    else:
        params = Moe().init(jax.random.key(0), TOKENS)
        transform = jmp.with_policy if front_end == "with_policy" else jmp.autocast
        apply = transform(Moe().apply, policy)
    found = _grouped(apply, params, TOKENS)
    assert found == [operands], found
    grad = jax.grad(lambda p, x: jnp.sum(apply(p, x).astype(F32)), argnums=(0, 1))
    backward = _grouped(grad, params, TOKENS)
    assert len(backward) == 3, backward  # Forward, then one per operand.
    if operands[0] == "f8E4M3FN":  # e5m2 output gradients.
        assert sorted(backward[1:]) == [("f8E4M3FN", "f8E5M2"), ("f8E5M2", "f8E4M3FN")]
    else:
        assert all(ins == operands for ins in backward), backward
    # Against float32, within the format's rounding.
    expect = jax.grad(lambda w, x: jnp.sum(_experts(x, w)), argnums=(0, 1))(EXPERTS, TOKENS)
    d_params, d_x = jax.jit(grad)(params, TOKENS)
    d_w = jax.tree.leaves(d_params)[0]
    # e5m2 output gradients round by up to 2^-3 (`test_grouped_fp8_...` checks them exactly).
    tol = 0.25 if operands[0] == "f8E4M3FN" else 0.03
    for got, want in ((d_w, expect[0]), (d_x, expect[1])):
        assert float(jnp.max(jnp.abs(got - want))) <= tol * float(jnp.max(jnp.abs(want)))


def test_grouped_fp8_products_are_the_fp8_rounded_products():
    # Per tensor: e4m3 operands, an e5m2 output gradient, float32 accumulation.
    def fp8(x, dtype):
        scale = fp8_scale(x, float(jnp.finfo(dtype).max))
        return fp8_quantize(x, scale, dtype, float(jnp.finfo(dtype).max)).astype(F32) * scale

    e4m3, e5m2 = jnp.float8_e4m3fn, jnp.float8_e5m2
    x, w = fp8(TOKENS, e4m3), fp8(EXPERTS, e4m3)
    y, vjp = jax.vjp(lambda a, b: lax.ragged_dot(a, b, GROUPS), x, w)
    # The product's result leaves it in bfloat16, the compute dtype, and
    # tanh's derivative is computed there.
    t = jnp.tanh(y.astype(jnp.bfloat16))
    expect = vjp(fp8((1 - t * t).astype(F32), e5m2))
    grad = jax.grad(lambda x, w: jnp.sum(jmp.autocast(_experts, "mixed_float8")(x, w)), (0, 1))
    for got, want in zip(jax.jit(grad)(TOKENS, EXPERTS), expect):
        # The forward result, rounded in float32 in another order, can move
        # one e5m2 gradient by a step: a few thousandths of the largest.
        assert float(jnp.max(jnp.abs(got - want))) <= 5e-3 * float(jnp.max(jnp.abs(want)))


def test_autocast_of_a_gradient_through_a_scan():
    # JAX 0.12 keeps a transposed scan's parts as a nested flat tree.
    def f(x, w):
        return lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=3)[0].sum()

    x, w = jnp.ones((2, 4)) / 4, jnp.eye(4)
    grad = jmp.autocast(jax.grad(f, argnums=1), "mixed_bfloat16")
    np.testing.assert_allclose(jax.jit(grad)(x, w), jax.grad(f, argnums=1)(x, w), atol=0.02)
