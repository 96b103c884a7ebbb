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
