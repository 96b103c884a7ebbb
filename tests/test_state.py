"""What every front end returns as state (in the dtype it came in) and as results.

The rule (`jmp_policy.engine.data_flow`) reads the traced program: a returned array
built from an argument by buffer operations (written, grown, selected, cast,
passed through, a loop's carry) keeps that argument's dtype; a function
traced as a loop's body keeps its carry's dtypes; every other floating
result takes the output dtype. Never structure, shapes or packing. Most
checks run `jax.eval_shape` (nothing compiles); the Equinox cases are in
test_equinox.py.
"""

import functools
import re
from typing import NamedTuple

import equinox as eqx
import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax import lax

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy import autocast
from jmp_policy.engine.data_flow import Flow, buffer_sources, cast_results

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)
HALF_OUT = "c=bf16"  # float32 parameters, bfloat16 compute and output


def dtypes(tree):
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


def shapes(fn, *args, policy=HALF_OUT, **kwargs):
    return jax.eval_shape(autocast(fn, policy), *args, **kwargs)


X = jnp.ones((2, 3), F32)


def test_arithmetic_on_an_argument_makes_a_result():
    # A residual block, a value the same shape as an argument: results.
    assert dtypes(shapes(lambda x: x + jnp.tanh(x), X)) == [BF16]
    assert dtypes(shapes(lambda x, y: (x * 2.0, y * 2.0), X, X)) == [BF16, BF16]
    # A container the result shares with an argument changes nothing.
    carry = (jnp.zeros(3, F32), jnp.zeros(3, F32))
    assert dtypes(shapes(lambda c: (c[0] + 1.0, c[1] * 2.0), carry)) == [BF16, BF16]


def test_packing_does_not_change_the_answer():
    # Finding 4: the same maths, the arguments packed or not.
    x, y = jnp.ones(3, F32), jnp.ones(3, F32)
    for fn in (lambda a, b: (a, b * 2.0), lambda a, b: (a[:2], jnp.tanh(b))):
        unpacked = dtypes(shapes(fn, x, y))
        assert dtypes(shapes(lambda xy, fn=fn: fn(*xy), (x, y))) == unpacked
        assert dtypes(shapes(lambda d, fn=fn: fn(d["a"], d["b"]), {"a": x, "b": y})) == unpacked
    assert dtypes(shapes(lambda xy: xy, (x, y))) == [F32, F32]  # Passed through.


K = jnp.full((1, 4), 0.5, F32)
BUFFER = jnp.zeros((3, 4), BF16)

# Each way a program builds a returned value from the argument `b`, with `k`
# a float32 value computed from elsewhere: all of them keep `b`'s dtype.
BUFFER_OPS = {
    "dynamic_update_slice": lambda b, k: lax.dynamic_update_slice(b, k.astype(b.dtype), (1, 0)),
    "at_set": lambda b, k: b.at[1].set(k[0].astype(b.dtype)),
    "at_add": lambda b, k: b.at[1:2].add(k.astype(b.dtype)),
    "concatenate": lambda b, k: jnp.concatenate([b, k.astype(b.dtype)]),
    "pad": lambda b, k: jnp.pad(b, ((0, 1), (0, 0))),
    "where": lambda b, k: jnp.where(k[0] > 0, b, 0),
    "slice_and_grow": lambda b, k: jnp.concatenate([b[1:], k.astype(b.dtype)]),
    "reshape": lambda b, k: b.reshape(4, 3),
    "pass_through": lambda b, k: b,
    "astype": lambda b, k: b.astype(F32),
    "cond": lambda b, k: lax.cond(k[0, 0] > 0, lambda: b.at[0].set(1), lambda: b),
    "scan_carry": lambda b, k: lax.scan(lambda c, _: (c * 0.5 + 1, None), b, None, length=2)[0],
    "fori_carry": lambda b, k: lax.fori_loop(0, 2, lambda i, c: jnp.tanh(c), b),
    "jit": lambda b, k: jax.jit(lambda b: b.at[0].set(2))(b),
    "checkpoint": lambda b, k: jax.checkpoint(lambda b: jnp.concatenate([b, b]))(b),
    # JAX 0.12 has a primitive for each of these (0.10 builds them from the above).
    "stack": lambda b, k: jnp.stack([b, b]),
    "tile": lambda b, k: jnp.tile(b, (2, 1)),
    "unstack": lambda b, k: jnp.unstack(b)[1],
    "stop_gradient": lambda b, k: lax.stop_gradient(b),
    # Copied into a fresh, larger buffer, at a slice or at an index.
    "copied_into_new": lambda b, k: jnp.zeros((4, 4), b.dtype).at[:3].set(b).at[3].set(b[0]),
    "written_into_new": lambda b, k: lax.dynamic_update_slice(
        jnp.zeros((5, 4), b.dtype), b, (1, 0)
    ),
    "shifted": lambda b, k: jnp.zeros_like(b).at[1:].set(b[:-1]),
    "sort": lambda b, k: jnp.sort(b, axis=0),
    "top_k": lambda b, k: lax.top_k(b, 2)[0],
}


@pytest.mark.parametrize("op", BUFFER_OPS)
def test_buffer_operations_keep_the_arguments_dtype(op):
    fn = BUFFER_OPS[op]
    for policy in ("mixed_bfloat16", HALF_OUT, "p=f16,c=f16,o=f16"):
        got = shapes(lambda b, k: (k @ jnp.ones((4, 2)), fn(b, k)), BUFFER, K, policy=policy)
        assert dtypes(got) == [np.dtype(jmp.get_policy(policy).output_dtype), BF16], policy
        for buffer in (BUFFER.astype(F32), BUFFER.astype(F16)):
            assert dtypes(shapes(fn, buffer, K, policy=policy)) == [buffer.dtype], policy


def test_buffer_sources_reads_nested_programs():
    def f(a, b, c):
        written = lax.dynamic_update_slice(a, c, (0,))
        loop = lax.while_loop(lambda s: s[0] < 3, lambda s: (s[0] + 1, s[1] * 2.0), (0, b))[1]
        return written, loop, a + b, jax.jit(lambda x: x)(c)

    v = jnp.zeros(3)
    closed = jax.make_jaxpr(f)(v, v, jnp.ones(1))
    # A write's result is the buffer and what is written into it, each in part.
    assert buffer_sources(closed.jaxpr) == [(0, 2), (1,), (), (2,)]


def test_a_loop_body_keeps_its_carrys_dtypes():
    # Finding 3 on plain JAX: a float32 carry through an autocast body whose
    # arithmetic would otherwise come back in the output dtype.
    def gru(h, x):
        z = jax.nn.sigmoid(h @ jnp.ones((4, 4)) + x)
        h = (1 - z) * h + z * jnp.tanh(x @ jnp.ones((4, 4)))
        return h, h * 2.0

    h, ys = lax.scan(autocast(gru, HALF_OUT), jnp.zeros(4, F32), jnp.ones((3, 4), F32))
    assert (h.dtype, ys.dtype) == (F32, BF16)
    assert lax.fori_loop(0, 2, autocast(lambda i, h: jnp.tanh(h), HALF_OUT), X).dtype == F32
    body = autocast(lambda s: (s[0] + 1, s[1] * 2.0), HALF_OUT)
    assert lax.while_loop(lambda s: s[0] < 3, body, (0, X))[1].dtype == F32

    # Called inside a body, not as the body: arithmetic makes a result.
    def inside(h, x):
        return autocast(lambda h, x: h + x, HALF_OUT)(h, x), None

    with pytest.raises(TypeError, match="carry input and carry output must have equal types"):
        lax.scan(inside, jnp.zeros(4, F32), jnp.ones((3, 4), F32))

    # Called inside a body with the body's own arguments, returning a pair: its
    # first result is a result, not the loop's carry.
    pair = autocast(lambda h, x: ((h + x) @ jnp.ones((4, 4)), jnp.sum(h)), HALF_OUT)
    seen = []

    def calls_pair(h, x):
        y, s = pair(h, x)
        seen.append((y.dtype, s.dtype))
        return h, y

    lax.scan(calls_pair, jnp.zeros(4, F32), jnp.ones((3, 4), F32))
    assert seen == [(BF16, BF16)]  # The output dtype, not the carry's.


def test_a_half_carry_given_to_a_loop_a_float32_body_updates_stays_half():
    # The program as written is float32: a bf16 carry from the caller, updated
    # by a product (`c + x @ w`), would change type, so JAX refuses it as
    # written. The model's half config runs it, and so does the policy: the
    # carry comes back in the dtype it came in.
    w = jnp.full((4, 4), 0.1, F32)
    c0, xs = jnp.full((2, 4), 0.5, BF16), jnp.ones((3, 2, 4), F32)

    def scan(w, c0, xs):
        return lax.scan(lambda c, x: (c + x @ w, None), c0, xs)[0]

    def fori(w, c0, xs):
        return lax.fori_loop(0, 3, lambda i, c: c + xs[i] @ w, c0)

    def while_(w, c0, xs):
        body = lambda s: (s[0] + 1, s[1] + xs[s[0]] @ w)  # noqa: E731
        return lax.while_loop(lambda s: s[0] < 3, body, (0, c0))[1]

    by_hand = c0 + 3 * (jnp.ones((2, 4), BF16) @ w.astype(BF16))
    for loop in (scan, fori, while_):
        with jax.numpy_dtype_promotion("standard"):  # bf16 + float32, as users write it
            with pytest.raises(TypeError, match="carry input and carry output must have equal"):
                loop(w, c0, xs)
            c = autocast(loop, "mixed_bfloat16")(w, c0, xs)
        assert c.dtype == BF16, loop
        np.testing.assert_allclose(c.astype(F32), by_hand.astype(F32), rtol=1e-2)


def test_a_linen_scan_behind_to_nnx_keeps_a_half_carry_under_policy_module():
    class Cell(nn.Module):
        @nn.compact
        def __call__(self, c, x):
            c = c + nn.Dense(4)(x)
            return c, c

    scan = nn.scan(Cell, variable_broadcast="params", split_rngs={"params": False}, in_axes=1)
    c0, xs = jnp.zeros((2, 4), BF16), jnp.ones((2, 3, 4), F32)
    model = nnx.bridge.ToNNX(scan(), rngs=nnx.Rngs(0))
    nnx.bridge.lazy_init(model, c0.astype(F32), xs)
    with jax.numpy_dtype_promotion("standard"):  # bf16 + float32 in the cell
        c, ys = jmp.nnx.PolicyModule(model, "mixed_bfloat16")(c0, xs)
    assert (c.dtype, ys.dtype) == (BF16, F32)  # the carry as given; the result as output


@pytest.mark.parametrize("front_end", ["with_policy", "autocast"])
def test_a_body_with_arguments_bound_beforehand_is_the_loops_body(front_end):
    # `lax.scan(functools.partial(apply, variables), ...)`: the loop calls it,
    # its trailing arguments are the loop's; the bound ones are constants.
    transform = jmp.with_policy if front_end == "with_policy" else autocast
    cell = nn.LSTMCell(4)
    c0 = cell.initialize_carry(jax.random.key(0), (2, 3))
    variables = cell.init(jax.random.key(1), c0, jnp.ones((2, 3)))
    xs = jnp.ones((5, 2, 3), F32)
    (c, h), ys = lax.scan(functools.partial(transform(cell.apply, HALF_OUT), variables), c0, xs)
    assert (c.dtype, h.dtype, ys.dtype) == (F32, F32, BF16)
    # A plain function too, with a bound Python number.
    body = transform(lambda scale, h, x: (jnp.tanh(h) * scale + x, h), HALF_OUT)
    h, _ = lax.scan(functools.partial(body, 2.0), jnp.zeros((2, 3), F32), xs)
    assert h.dtype == F32


def test_statistics_passed_apart_from_the_parameters_are_state():
    # `lambda params, stats, x: apply({"params": params, "batch_stats": stats}, ...)`:
    # the program gives `stats` to the model as its variables, so they are
    # neither cast to compute on the way in nor made bf16 on the way out.
    model = nn.BatchNorm(use_running_average=False)
    x = jax.random.normal(jax.random.key(0), (8, 4), F32) * 3
    variables = model.init(jax.random.key(1), x)

    def step(params, stats, x):
        return model.apply({"params": params, "batch_stats": stats}, x, mutable=["batch_stats"])

    _, updates = jax.jit(jmp.with_policy(step, HALF_OUT))(
        variables["params"], variables["batch_stats"], x
    )
    _, exact = step(variables["params"], variables["batch_stats"], x)
    assert dtypes(updates) == [F32, F32]
    # Computed in bf16 but from float32 statistics: as close as autocast's.
    np.testing.assert_allclose(
        updates["batch_stats"]["var"], exact["batch_stats"]["var"], rtol=2e-3
    )


def test_an_equinox_gru_scan_body_keeps_its_float32_carry():
    cell = eqx.nn.GRUCell(3, 4, key=jax.random.key(0))

    def body(h, x):
        h = cell(x, h)
        return h, h

    xs = jnp.ones((5, 3), F32)
    h, hs = lax.scan(autocast(body, HALF_OUT), jnp.zeros(4, F32), xs)
    ref, _ = lax.scan(body, jnp.zeros(4, F32), xs)
    assert h.dtype == F32 and hs.dtype == BF16  # The carry kept; the per-step results not.
    np.testing.assert_allclose(h, ref, atol=3e-2)


def test_gradients_computed_inside_are_results():
    # A gradient is arithmetic: differentiate outside the wrapped function to
    # have it in the parameters' dtypes, as `jax.grad` gives it.
    params = {"w": jnp.ones((3, 2), F32), "b": jnp.zeros(2, F32)}

    def loss(p, x):
        return jnp.sum(x @ p["w"] + p["b"])

    assert dtypes(shapes(jax.grad(loss), params, X)) == [BF16, BF16]
    outside = jax.eval_shape(jax.grad(autocast(loss, HALF_OUT)), params, X)
    assert dtypes(outside) == [F32, F32]


def test_non_array_results_pass_through():
    out = autocast(lambda x: (x * 2.0, jnp.tanh, "name", 3.0, None), HALF_OUT)(X)
    assert out[0].dtype == BF16 and out[1:] == (jnp.tanh, "name", 3.0, None)
    jitted = jax.jit(lambda x: autocast(lambda x: (x * 2.0, 3.0), HALF_OUT)(x)[0])
    assert jitted(X).dtype == BF16


@pytest.mark.parametrize("half", [BF16, F16])
def test_cast_results_follows_the_flow(half):
    cache, y = jnp.zeros(2, half), jnp.ones(2, F32)
    written = jnp.ones(2, F32)  # A float32 program wrote into the half cache.
    to_output = jmp.get_policy("bf16").cast_to_output
    out = cast_results((y, written), Flow({id(written): cache}), to_output)
    assert dtypes(out) == [BF16, half]
    assert dtypes(cast_results((y, written), Flow(), to_output)) == [BF16, BF16]


def test_linen_mutable_collections_and_init_are_state():
    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))

    x = jnp.ones((3, 2), F32)
    variables = jax.eval_shape(Net().init, jax.random.key(0), x)
    apply = autocast(Net().apply, HALF_OUT)
    y, updates = jax.eval_shape(lambda v, x: apply(v, x, mutable=["batch_stats"]), variables, x)
    assert dtypes(y) == [BF16] and dtypes(updates) == [F32, F32]
    made = jax.eval_shape(autocast(Net().init, HALF_OUT), jax.random.key(0), x)
    assert dtypes(made) == [F32] * 6  # Linen's init returns variables: as made.


class _Accumulates(nn.Module):
    """BatchNorm statistics (float32) and a bfloat16 sum, both made by arithmetic."""

    @nn.compact
    def __call__(self, x):
        y = nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))
        total = self.variable("cache", "total", jnp.zeros, (4,), BF16)
        total.value = total.value + jnp.sum(y, 0).astype(BF16)
        return nn.Dense(2)(y)


def _around_apply(model, how):
    """The usual shapes of a function that calls `apply` and returns its collections."""
    mutable = ["batch_stats", "cache"]
    if how == "returned":
        return lambda v, x: model.apply(v, x, mutable=mutable)

    def step(v, x):  # A train step: the collections come back through `has_aux`.
        def loss(p):
            y, updates = model.apply({**v, "params": p}, x, mutable=mutable)
            return jnp.sum(y.astype(F32)), (y, updates)

        (_, (y, updates)), _ = jax.value_and_grad(loss, has_aux=True)(v["params"])
        return y, updates

    return step


@pytest.mark.parametrize("how", ["returned", "from_a_train_step"])
@pytest.mark.parametrize("front_end", ["with_policy", "autocast"])
def test_collections_an_apply_inside_returns_are_state(front_end, how):
    # Made by arithmetic, yet `apply` returns them as collections: each keeps
    # its dtype, as in the model's own half config (float32 statistics).
    model = _Accumulates()
    x = jnp.ones((3, 2), F32)
    variables = model.init(jax.random.key(0), x)
    transform = jmp.with_policy if front_end == "with_policy" else autocast
    fn = _around_apply(model, how)
    y, updates = jax.jit(transform(fn, HALF_OUT))(variables, x)
    assert dtypes(y) == [BF16]
    assert dtypes(updates) == [F32, F32, BF16]  # mean, var, total
    # A value computed from them is a result.
    doubled = transform(lambda v, x: jax.tree.map(lambda a: a * 2, fn(v, x)[1]), HALF_OUT)
    assert dtypes(jax.jit(doubled)(variables, x)) == [BF16] * 3


class _KeepsItsResult(nn.Module):
    """Returns a value it also sows and caches: a result there, state here."""

    @nn.compact
    def __call__(self, x):
        y = nn.Dense(3)(x)
        self.sow("intermediates", "y", y)
        self.variable("cache", "last", jnp.zeros, y.shape, BF16).value = y
        return y


@pytest.mark.parametrize("front_end", ["with_policy", "autocast"])
def test_a_result_also_kept_in_a_collection_is_still_a_result(front_end):
    transform = jmp.with_policy if front_end == "with_policy" else autocast
    x = jnp.ones((2, 4), F32)
    model = _KeepsItsResult()
    variables = model.init(jax.random.key(0), x)
    mutable = ["intermediates", "cache"]
    apply = jax.jit(transform(functools.partial(model.apply, mutable=mutable), "mixed_bfloat16"))
    y, updates = apply(variables, x)
    assert y.dtype == F32  # The output dtype, as without `mutable`.
    assert updates["cache"]["last"].dtype == F32  # As it came in (init wrote f32).
    # An outer model's result that Flax captures from an inner layer.
    outer = nn.Sequential([nn.Dense(8), nn.Dense(3)])
    variables = outer.init(jax.random.key(0), x)
    captured = functools.partial(
        outer.apply, capture_intermediates=True, mutable=["intermediates"]
    )  # fmt: skip
    y, _ = jax.jit(transform(captured, "mixed_bfloat16"))(variables, x)
    assert y.dtype == F32


# One rule for every front end: linen's `with_policy`, `jmp_policy.nnx` and
# `autocast` split the same result the same way, wherever its parts sit.

POLICY = "mixed_bfloat16"


class _Step(nn.Module):
    """`(logits, hidden)`, or swapped, with `hidden` shaped like the (bf16) input."""

    order: str = "logits_first"

    @nn.compact
    def __call__(self, x):
        hidden = jnp.tanh(nn.Dense(x.shape[-1])(x))
        logits = nn.Dense(5)(hidden)
        return (logits, hidden) if self.order == "logits_first" else (hidden, logits)


class _NnxStep(nnx.Module):
    def __init__(self, order):
        self.order = order
        self.a, self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 5, rngs=nnx.Rngs(1))

    def __call__(self, x):
        hidden = jnp.tanh(self.a(x))
        logits = self.b(hidden)
        return (logits, hidden) if self.order == "logits_first" else (hidden, logits)


def _front_ends(linen_model, nnx_model, *args, **kwargs):
    """The dtypes of each front end's result, on one model written for linen and NNX."""
    variables = jax.eval_shape(linen_model.init, jax.random.key(0), *args)
    return {
        "linen": dtypes(
            jax.eval_shape(jmp.with_policy(linen_model.apply, POLICY, **kwargs), variables, *args)
        ),
        "autocast": dtypes(
            jax.eval_shape(autocast(linen_model.apply, POLICY, **kwargs), variables, *args)
        ),
        "nnx": dtypes(jmp_policy.nnx.PolicyModule(nnx_model, POLICY, **kwargs)(*args)),
    }


@pytest.mark.parametrize("order", ["logits_first", "hidden_first"])
def test_every_front_end_gives_results_the_output_dtype_in_any_order(order):
    x = jnp.ones((2, 4), BF16)  # `hidden` has its shape and dtype: still a result.
    with jax.numpy_dtype_promotion("standard"):  # The plain model mixes bf16 and f32.
        got = _front_ends(_Step(order), _NnxStep(order), x)
    assert got == {k: [F32, F32] for k in got}


# The conformance matrix: every front end x container x value x policy gives
# the dtype the model's own half config gives (a fresh result: the output dtype).


class Pair(NamedTuple):
    y: jax.Array
    v: jax.Array


@flax.struct.dataclass
class Struct:
    y: jax.Array
    v: jax.Array


class EqxOut(eqx.Module):
    y: jax.Array
    v: jax.Array


def _hf_output():
    """Hugging Face's `FlaxBaseModelOutput` (a `ModelOutput`), where ./run installed it."""
    import pathlib
    import sys

    hf = pathlib.Path(__file__).resolve().parent.parent / ".venv" / "hf"
    if not (hf / "transformers").is_dir():
        return None
    if str(hf) not in sys.path:
        sys.path.append(str(hf))
    from transformers.modeling_flax_outputs import FlaxBaseModelOutput

    return lambda y, v: FlaxBaseModelOutput(last_hidden_state=y, hidden_states=(v,))


# Each container: how the model packs `(logits, value)`, and how to read them back.
CONTAINERS = {
    "bare": (lambda y, v: v, lambda out: (None, out)),
    "tuple": (lambda y, v: (y, v), lambda out: out),
    "list": (lambda y, v: [v, y], lambda out: (out[1], out[0])),
    "dict": (lambda y, v: {"y": y, "v": v}, lambda out: (out["y"], out["v"])),
    "namedtuple": (Pair, lambda out: (out.y, out.v)),
    "struct_dataclass": (Struct, lambda out: (out.y, out.v)),
    "equinox_module": (EqxOut, lambda out: (out.y, out.v)),
    "hf_model_output": (None, lambda out: (out.last_hidden_state, out.hidden_states[0])),
}

# What the model returns beside its logits, from `h` (computed) and `buf` (an argument).
VALUES = {
    "written": lambda buf, h: lax.dynamic_update_slice(buf, h.astype(buf.dtype), (1, 0)),
    "grown": lambda buf, h: jnp.concatenate([buf, h.astype(buf.dtype)]),
    "loop_carry": lambda buf, h: lax.fori_loop(0, 2, lambda i, c: c * 0.5 + h.astype(c.dtype), buf),
    "pass_through": lambda buf, h: buf,
    "fresh": lambda buf, h: jnp.tanh(h),
    "other_dtype": lambda buf, h: lax.dynamic_update_slice(buf, h.astype(buf.dtype), (1, 0)),
}


class _LinenModel(nn.Module):
    value: str
    wrap: object

    @nn.compact
    def __call__(self, x, buf):
        h = nn.Dense(4)(x)
        return self.wrap(nn.Dense(3)(h), VALUES[self.value](buf, h))


class _NnxModel(nnx.Module):
    def __init__(self, value, wrap):
        self.value, self.wrap = value, wrap
        self.a, self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x, buf):
        h = self.a(x)
        return self.wrap(self.b(h), VALUES[self.value](buf, h))


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "p=f32,c=bf16,o=bf16", "mixed_float16"])
@pytest.mark.parametrize("value", VALUES)
@pytest.mark.parametrize("container", CONTAINERS)
def test_conformance_every_front_end_container_value_and_policy(container, value, policy):
    wrap, unwrap = CONTAINERS[container]
    wrap = wrap or _hf_output()
    if wrap is None:
        pytest.skip("./run installs transformers in .venv/hf")
    compute = np.dtype(jmp.get_policy(policy).compute_dtype)
    buf = jnp.zeros((2, 4), F32 if value == "other_dtype" else compute)
    x = jnp.ones((1, 4), F32)
    linen = _LinenModel(value, wrap)
    variables = jax.eval_shape(linen.init, jax.random.key(0), x, buf)
    got = {
        "with_policy": jax.eval_shape(jmp.with_policy(linen.apply, policy), variables, x, buf),
        "autocast": jax.eval_shape(autocast(linen.apply, policy), variables, x, buf),
        "nnx": jmp_policy.nnx.PolicyModule(_NnxModel(value, wrap), policy)(x, buf),
    }
    output = np.dtype(jmp.get_policy(policy).output_dtype)
    want = output if value == "fresh" else buf.dtype  # The half config's, for the others.
    for front_end, out in got.items():
        logits, v = unwrap(out)
        assert np.dtype(v.dtype) == want, front_end
        assert logits is None or np.dtype(logits.dtype) == output, front_end


def test_a_write_into_a_buffer_takes_the_buffers_dtype():
    # A float32 program given a bfloat16 cache: as written, its float32 keys
    # cannot be written into it (lax refuses); under autocast and NNX's
    # op-level rewrite they are, rounded to the cache's dtype. Also the
    # `scatter` a vmapped write becomes (penzai's named axes).
    k = jnp.arange(6, dtype=F32).reshape(2, 3) / 7
    cache = jnp.zeros((2, 4, 3), BF16)

    def write(cache, k, at):
        return jax.lax.dynamic_update_slice(cache, k[:, None] * 1.0, (0, at, 0))

    def batched(cache, k, at):  # one position per batch row: a scatter
        return jax.vmap(lambda c, r, i: jax.lax.dynamic_update_slice(c, r[None], (i, 0)))(
            cache, k, at
        )

    expected = np.zeros((2, 4, 3), BF16)
    expected[:, 1] = np.asarray(k).astype(BF16)
    for fn, at in ((write, 1), (batched, jnp.array([1, 1]))):
        with pytest.raises(TypeError, match="requires arguments to have the same dtypes"):
            jax.jit(fn)(cache, k, at)  # The program as written.
        for policy in ("mixed_bfloat16", "p=f32,c=bf16,o=f32,m=bf16"):
            # Traced again in float32, once, and said (`engine.rerun`).
            with pytest.warns(RuntimeWarning, match="refuses the half values it is given"):
                out = jax.jit(autocast(fn, policy, returns_state=True))(cache, k, at)
            assert out.dtype == BF16
            np.testing.assert_array_equal(np.asarray(out), expected)
        with pytest.raises(TypeError, match="requires arguments to have the same dtypes"):
            jax.jit(fn)(cache, k, jnp.int32(2) if fn is write else at + 1)  # Still refused.


def _prefill(cache, k, whole):
    """MaxText's prefill, as written for a cache of its own dtype: the prompt's
    keys into the prompt cache, laid out (transposed) as the cache keeps them;
    a prompt of the cache's full length overwrites it whole (`lax` then
    returns the keys themselves)."""
    if whole:
        return lax.dynamic_update_slice(cache, k.T, (0, 0))
    laid_out = jnp.transpose(jnp.transpose(cache))
    return lax.dynamic_update_slice(laid_out, k[:1].T, (0, 0))


class _LinenPrefill(nn.Module):
    whole: bool

    @nn.compact
    def __call__(self, x):
        cache = self.variable("cache", "k", jnp.zeros, (4, 2), F32)  # its float32 config
        # A third party's layer (MaxText's): float32 keys, as written.
        k = x @ self.param("w", nn.initializers.normal(1.0), (3, 4))
        cache.value = _prefill(cache.value, k, self.whole)
        return k


class _NnxPrefill(nnx.Module):
    def __init__(self, whole):
        self.whole = whole
        self.w = nnx.Param(jax.random.normal(jax.random.key(0), (3, 4)))
        self.k = nnx.Cache(jnp.zeros((4, 2), BF16))  # a half cache, as decoding gives it

    def __call__(self, x):
        k = x @ self.w[...]
        self.k[...] = _prefill(self.k[...], k, self.whole)
        return k


@pytest.mark.parametrize("whole", [False, True])
def test_a_frameworks_variable_written_by_a_float32_program_keeps_its_dtype(whole):
    # A float32 program given a bf16 cache: a write takes the cache's dtype
    # (also through the layout ops between: no float32 copy of the cache).
    # Overwritten whole, no data flow ties the new keys to the cache: a
    # framework's variable is state by its API, and comes back in the dtype
    # it was given (was: float32, and the next decode step's write crashed).
    x = jnp.ones((2, 3), F32)
    linen = _LinenPrefill(whole)
    variables = {**linen.init(jax.random.key(0), x), "cache": {"k": jnp.zeros((4, 2), BF16)}}
    for wrap in (jmp.with_policy, autocast):
        apply = jax.jit(lambda v, x, wrap=wrap: wrap(linen.apply, POLICY)(v, x, mutable=["cache"]))
        out, updated = apply(variables, x)
        assert (out.dtype, updated["cache"]["k"].dtype) == (F32, BF16), wrap
        if not whole:  # Written in the cache's own dtype.
            text = apply.lower(variables, x).as_text()
            assert re.search(r"dynamic_update_slice [^:]*: \(tensor<4x2xbf16>", text), wrap
    mixed = jmp_policy.nnx.PolicyModule(_NnxPrefill(whole), POLICY)
    own = _NnxPrefill(whole)
    for call, model in ((mixed, mixed.module), (autocast(own, POLICY), own)):
        out = call(x)
        assert (out.dtype, model.k[...].dtype) == (F32, BF16)
        written = out.T.astype(BF16) if whole else out[:1].T.astype(BF16)
        np.testing.assert_array_equal(np.asarray(model.k[...])[:, : written.shape[1]], written)


# Findings 1 and 2: decoding, the cache written, grown or in a struct, several
# steps in every front end: the cache stays in the compute dtype and no
# product runs float32 x float32 (the model's own bf16 config has none).


@flax.struct.dataclass
class DecodeOut:
    logits: jax.Array
    kv: jax.Array


def _attend(q, k, v, kind, kv):
    """The new keys and values into the cache (`kind`), then attention over it."""
    if kind == "grown":
        ks, vs = (jnp.concatenate([c, n.astype(c.dtype)]) for c, n in zip(kv, (k, v)))
        new = (ks, vs)
    else:
        new = lax.dynamic_update_slice(kv, jnp.stack([k, v]).astype(kv.dtype), (0, 0, 0))
        ks, vs = new[0], new[1]
    return jax.nn.softmax(q @ ks.T.astype(q.dtype)) @ vs.astype(q.dtype), new


def _pack(logits, new, kind):
    return DecodeOut(logits, new) if kind == "struct" else (logits, new)


class _LinenDecoder(nn.Module):
    kind: str
    dtype: object = None  # The model's own config: bfloat16 layers.

    @nn.compact
    def __call__(self, x, kv):
        q, k, v = (nn.Dense(4, dtype=self.dtype, name=n)(x) for n in "qkv")
        att, new = _attend(q, k, v, self.kind, kv)
        return _pack(nn.Dense(5, dtype=self.dtype)(att), new, self.kind)


class _NnxDecoder(nnx.Module):
    def __init__(self, kind):
        self.kind = kind
        self.q, self.k, self.v, self.o = (
            nnx.Linear(4, n, rngs=nnx.Rngs(i)) for i, n in enumerate((4, 4, 4, 5))
        )

    def __call__(self, x, kv):
        att, new = _attend(self.q(x), self.k(x), self.v(x), self.kind, kv)
        return _pack(self.o(att), new, self.kind)


def _float32_products(step, *args):
    from helpers import contractions

    text = jax.jit(step).lower(*args).as_text()
    return sum(op.operand_dtypes == (F32, F32) for op in contractions(text))


@pytest.mark.parametrize("kind", ["written", "grown", "struct"])
def test_decoding_keeps_the_cache_in_the_compute_dtype_in_every_front_end(kind):
    x = jnp.ones((1, 4), F32)
    start = (jnp.zeros((1, 4), BF16),) * 2 if kind == "grown" else jnp.zeros((2, 3, 4), BF16)
    linen = _LinenDecoder(kind)
    variables = linen.init(jax.random.key(0), x, start)
    own = _LinenDecoder(kind, dtype=jnp.bfloat16)
    nnx_model = jmp_policy.nnx.PolicyModule(_NnxDecoder(kind), POLICY)
    steps = {
        "own_config": lambda kv: own.apply(variables, x, kv),
        "with_policy": lambda kv: jmp.with_policy(linen.apply, POLICY)(variables, x, kv),
        "autocast": lambda kv: autocast(linen.apply, POLICY)(variables, x, kv),
        "nnx": lambda kv: nnx_model(x, kv),
    }
    for name, step in steps.items():
        kv = start
        for _ in range(3):
            out = step(kv)
            kv = out.kv if kind == "struct" else out[1]
            assert dtypes(kv) == dtypes(start), name
        assert _float32_products(step, kv) == 0, name


def test_a_loop_body_keeps_its_carry_under_returns_state_too():
    def body(h, x):
        return jnp.tanh(h + x), h * 2.0

    said = autocast(body, HALF_OUT, returns_state=(None, True))  # ys: as made (float32)
    h, ys = lax.scan(said, jnp.zeros(4, F32), jnp.ones((3, 4), F32))
    assert (h.dtype, ys.dtype) == (F32, F32)


def test_a_write_of_another_dtype_patches_nothing_global():
    # The engine's write rule is an operation's rule: while autocast traces
    # the program again, JAX's write primitives are JAX's own.
    seen = []

    def write(cache, k):
        seen.append("bind" in vars(lax.dynamic_update_slice_p))
        return lax.dynamic_update_slice(cache, k, (0, 0))

    out = autocast(write, "mixed_bfloat16")(jnp.zeros((2, 3), BF16), jnp.ones((1, 3), F32))
    assert out.dtype == BF16 and seen and not any(seen)
