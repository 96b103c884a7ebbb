"""What `autocast` takes for state (kept in its dtypes) and for results (the output dtype).

The rule (`jmp_policy.core.state`): a part of the result with the pytree
structure and array shapes of a container among the arguments, seen through
plain tuples, lists and dicts, is state. Checked on plain JAX with
`jax.eval_shape` (nothing compiles); the Equinox cases are in test_equinox.py.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jmp_policy as jmp
from jmp_policy import autocast
from jmp_policy.core.state import cast_results

F32, BF16 = np.dtype(np.float32), np.dtype(jnp.bfloat16)
HALF_OUT = "c=bf16"  # float32 parameters, bfloat16 compute and output


class Carry(NamedTuple):
    h: jax.Array
    step: jax.Array


def dtypes(tree):
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree)]


def shapes(fn, *args, **kwargs):
    return jax.eval_shape(autocast(fn, HALF_OUT), *args, **kwargs)


X = jnp.ones((2, 3), F32)


def test_a_bare_array_of_an_arguments_shape_is_a_result():
    assert dtypes(shapes(lambda x: x + jnp.tanh(x), X)) == [BF16]
    assert dtypes(shapes(lambda x, y: (x * 2.0, y * 2.0), X, X)) == [BF16, BF16]


def test_a_returned_container_keeps_the_arguments_dtypes():
    carry = (jnp.zeros(3, F32), jnp.zeros(3, F32))

    def body(carry, x):
        h = jnp.tanh(carry[0] + x)
        return (h, carry[1] + h), h

    new_carry, y = shapes(body, carry, jnp.ones(3, F32))
    assert dtypes(new_carry) == [F32, F32] and dtypes(y) == [BF16]
    # A NamedTuple, inside a dict of the result, an integer leaf among the floats.
    named = Carry(jnp.zeros(3, F32), jnp.int32(0))
    out = shapes(lambda c: {"carry": Carry(c.h + 1.0, c.step + 1), "y": c.h * 2.0}, named)
    assert dtypes(out["carry"]) == [F32, np.dtype(np.int32)] and dtypes(out["y"]) == [BF16]


def test_state_inside_an_argument_and_keyword_arguments():
    cache = {"k": jnp.zeros((4, 2), BF16), "v": jnp.zeros((4, 2), BF16)}

    def decode(x, *, inputs):
        cache = inputs["cache"]
        new = {k: v + x[:1].T.astype(v.dtype) for k, v in cache.items()}
        return x.sum(), new

    # The bfloat16 cache comes back bfloat16 under a float32-output policy too.
    y, new = jax.eval_shape(
        autocast(decode, "mixed_bfloat16"), jnp.ones((2, 4), F32), inputs={"cache": cache}
    )
    assert dtypes(y) == [F32] and dtypes(new) == [BF16, BF16]


def test_gradients_keep_their_parameters_dtypes_as_jax_grad_gives_them():
    params = {"w": jnp.ones((3, 2), F32), "b": jnp.zeros(2, F32)}

    def loss(p, x):
        return jnp.sum(x @ p["w"] + p["b"])

    grads = shapes(jax.grad(loss), params, X)
    assert dtypes(grads) == [F32, F32]
    value, grads = shapes(jax.value_and_grad(loss), params, X)
    assert dtypes(value) == [BF16] and dtypes(grads) == [F32, F32]


def test_another_structure_or_shape_is_a_result():
    carry = (jnp.zeros(3, F32), jnp.zeros(3, F32))
    assert dtypes(shapes(lambda c: (c[0], c[1], c[0]), carry)) == [BF16] * 3
    assert dtypes(shapes(lambda c: (c[0][:2], c[1][:2]), carry)) == [BF16] * 2
    assert dtypes(shapes(lambda c: [c[0], c[1]], carry)) == [BF16] * 2  # a list, not a tuple


def test_non_array_results_pass_through():
    out = autocast(lambda x: (x * 2.0, jnp.tanh, "name", 3.0, None), HALF_OUT)(X)
    assert out[0].dtype == BF16 and out[1:] == (jnp.tanh, "name", 3.0, None)
    jitted = jax.jit(lambda x: autocast(lambda x: (x * 2.0, 3.0), HALF_OUT)(x)[0])
    assert jitted(X).dtype == BF16


@pytest.mark.parametrize("half", [BF16, np.dtype(np.float16)])
def test_cast_results_casts_state_back_to_the_arguments_dtypes(half):
    # A half state that a float32 computation made float32 goes back to half.
    state = (jnp.zeros(2, half), jnp.zeros(2, half))
    out = (jnp.ones(2, F32), (jnp.ones(2, F32), jnp.ones(2, F32)))
    y, new_state = cast_results(out, [state], jmp.get_policy("bf16").cast_to_output)
    assert dtypes(y) == [BF16] and dtypes(new_state) == [half, half]
    # No container among the arguments: all of it is result.
    assert (
        dtypes(cast_results(out, [jnp.zeros(2, half)], jmp.get_policy("bf16").cast_to_output))
        == [BF16] * 3
    )


def test_linen_mutable_collections_keep_their_dtypes():
    import flax.linen as nn

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.BatchNorm(use_running_average=False)(nn.Dense(4)(x))

    x = jnp.ones((3, 2), F32)
    variables = jax.eval_shape(Net().init, jax.random.key(0), x)
    apply = autocast(Net().apply, HALF_OUT)
    y, updates = jax.eval_shape(lambda v, x: apply(v, x, mutable=["batch_stats"]), variables, x)
    assert dtypes(y) == [BF16] and dtypes(updates) == [F32, F32]


# One rule for every front end: linen's `with_policy`, `jmp_policy.nnx` and
# `autocast` split the same result the same way, wherever its parts sit.

import flax.linen as nn  # noqa: E402
import flax.struct  # noqa: E402
from flax import nnx  # noqa: E402

import jmp_policy.nnx  # noqa: E402

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


class _Cached(nn.Module):
    """Decodes into a dict cache and returns it with a new entry, `pos`."""

    @nn.compact
    def __call__(self, x, cache):
        h = nn.Dense(4)(x)
        k = h.astype(cache["k"].dtype)
        cache = {
            "k": jax.lax.dynamic_update_slice(cache["k"], k, (0, 0)),
            "v": cache["v"] + 1,
            "pos": jnp.int32(1),
        }
        return nn.Dense(3)(h), cache


class _NnxCached(nnx.Module):
    def __init__(self):
        self.a, self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x, cache):
        h = self.a(x)
        k = h.astype(cache["k"].dtype)
        cache = {
            "k": jax.lax.dynamic_update_slice(cache["k"], k, (0, 0)),
            "v": cache["v"] + 1,
            "pos": jnp.int32(1),
        }
        return self.b(h), cache


def test_a_cache_returned_with_a_new_entry_keeps_its_dtype_in_every_front_end():
    cache = {"k": jnp.zeros((2, 4), BF16), "v": jnp.zeros((2, 4), BF16)}
    got = _front_ends(_Cached(), _NnxCached(), jnp.ones((2, 4), F32), cache)
    # logits, then the cache's k, pos, v (sorted keys): bf16 as given, pos as made.
    assert got == {k: [F32, BF16, np.dtype(np.int32), BF16] for k in got}


@flax.struct.dataclass
class Output:
    logits: jax.Array
    cache: dict


def test_a_cache_inside_a_struct_dataclass_output_keeps_its_dtype():
    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, cache):
            k = nn.Dense(4)(x)
            new = {"k": cache["k"] + k.astype(cache["k"].dtype)}
            return Output(logits=nn.Dense(3)(k), cache=new)

    cache = {"k": jnp.zeros((2, 4), BF16)}
    x = jnp.ones((2, 4), F32)
    variables = jax.eval_shape(Model().init, jax.random.key(0), x, cache)
    for wrap in (jmp.with_policy, autocast):
        out = jax.eval_shape(wrap(Model().apply, POLICY), variables, x, cache)
        assert isinstance(out, Output)
        assert dtypes(out.logits) == [F32] and dtypes(out.cache) == [BF16], wrap


def test_logits_shaped_like_integer_ids_are_results():
    # Hugging Face's question answering heads: (start_logits, end_logits),
    # each shaped like the int32 input_ids.
    class QA(nn.Module):
        @nn.compact
        def __call__(self, ids):
            h = nn.Embed(10, 8)(ids)
            start, end = jnp.split(nn.Dense(2)(h), 2, axis=-1)
            return start[..., 0], end[..., 0]

    ids = jnp.zeros((2, 6), jnp.int32)
    variables = jax.eval_shape(QA().init, jax.random.key(0), ids)
    out = jax.eval_shape(jmp.with_policy(QA().apply, POLICY), variables, ids)
    assert dtypes(out) == [F32, F32]


class _BareCache(nn.Module):
    @nn.compact
    def __call__(self, x, cache):
        h = nn.Dense(4)(x)
        return nn.Dense(3)(h), jax.lax.dynamic_update_slice(cache, h.astype(cache.dtype), (0, 0))


class _NnxBareCache(nnx.Module):
    def __init__(self):
        self.a, self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(0)), nnx.Linear(4, 3, rngs=nnx.Rngs(1))

    def __call__(self, x, cache):
        h = self.a(x)
        return self.b(h), jax.lax.dynamic_update_slice(cache, h.astype(cache.dtype), (0, 0))


def test_returns_state_says_a_bare_array_is_state_in_every_front_end():
    x, cache = jnp.ones((2, 4), F32), jnp.zeros((2, 4), BF16)
    # By the rule, a bare array is a result; said to be state, it keeps its dtype.
    assert _front_ends(_BareCache(), _NnxBareCache(), x, cache)["linen"] == [F32, F32]
    got = _front_ends(_BareCache(), _NnxBareCache(), x, cache, returns_state=(False, True))
    assert got == {k: [F32, BF16] for k in got}
    # False says a container is a result.
    carry = (jnp.zeros(3, F32), jnp.zeros(3, F32))
    out = autocast(lambda c: (c[0] * 2.0, c), HALF_OUT, returns_state=False)(carry)
    assert dtypes(out) == [BF16] * 3


def test_a_state_said_to_be_state_that_matches_no_argument_comes_back_as_made():
    out = (jnp.ones(2, F32), {"k": jnp.ones(2, BF16)})
    y, made = cast_results(
        out, [], jmp.get_policy("bf16").cast_to_output, returns_state=(False, True)
    )
    assert dtypes(y) == [BF16] and dtypes(made) == [BF16]
    made = cast_results(out, [], jmp.get_policy("f32").cast_to_output, returns_state=(None, True))
    assert dtypes(made) == [F32, BF16]


def test_bad_returns_state():
    out, to_output = (X, X), jmp.get_policy("bf16").cast_to_output
    with pytest.raises(ValueError, match=r"returns_state=\(True, False, True\) is not a prefix"):
        cast_results(out, [X], to_output, returns_state=(True, False, True))
    with pytest.raises(TypeError, match="returns_state takes True.*got 'yes'"):
        cast_results(out, [X], to_output, returns_state=(True, "yes"))


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
            out = jax.jit(autocast(fn, policy, returns_state=True))(cache, k, at)
            assert out.dtype == BF16
            np.testing.assert_array_equal(np.asarray(out), expected)
        with pytest.raises(TypeError, match="requires arguments to have the same dtypes"):
            jax.jit(fn)(cache, k, jnp.int32(2) if fn is write else at + 1)  # Still refused.
