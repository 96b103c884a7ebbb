"""Equinox models under `autocast`, `loss_scaled` and `select_tree`.

* The three defects found first: a returned module with non-array leaves
  (its activation function), an `eqx.nn.State` and an LSTM carry that came back
  in the output dtype, `select_tree` over modules.
* A small model with `Conv2d`, `BatchNorm` (and its `State`), `Linear`,
  `MultiheadAttention` (causal mask, dropout) and `Dropout`, and an `LSTMCell` in
  `lax.scan`, under `mixed_bfloat16`, `mixed_float16` and `m=bf16`: every
  product of the lowered forward and backward program takes half operands and
  gives a float32 result, as many products as in float32; gradients are close to
  float32's; the state keeps its dtype.
* `eqx.filter_vmap` over an ensemble, `eqx.filter_jit` train steps with
  `loss_scaled` and `DynamicLossScale`.

Gradient tolerance, per leaf, the error norm relative to the float32
gradient's norm: both operands of each product are rounded to the half dtype
(relative error 2^-9 in bfloat16, 2^-12 in float16) and the backward pass
rounds the cotangents once more; a few such roundings through the model give
about 1e-2 in bfloat16 and 1e-3 in float16 (measured figures at `GRAD_TOL`).

Compilation dominates the run time: each policy's gradients are compiled once,
all in one program (module fixtures), and the lowered text is read for the
products.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax

import jmp_policy as jmp
from jmp_policy import autocast

from helpers import contractions

F32, BF16, F16 = np.dtype(np.float32), np.dtype(jnp.bfloat16), np.dtype(np.float16)
M_BF16 = "p=f32,c=bf16,o=f32,m=bf16"
POLICIES = {"mixed_bfloat16": "bf16", "mixed_float16": "f16", M_BF16: "bf16"}
# Measured worst leaf of the model's gradients: 1.6e-2 (bfloat16), 1.4e-3 (float16).
GRAD_TOL = {"bf16": 4e-2, "f16": 5e-3}
# BatchNorm's statistics after a step, relative to the largest one: measured 2e-3
# (bfloat16), 3e-4 (float16).
STAT_TOL = {"bf16": 5e-3, "f16": 1e-3}
BATCH = 8


def dtypes(tree):
    return [np.dtype(x.dtype) for x in jax.tree.leaves(tree) if eqx.is_array(x)]


def float_dtypes(tree):
    return {d for d in dtypes(tree) if jnp.issubdtype(d, jnp.floating)}


def assert_grads_close(actual, expected, tol):
    pairs = zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True)
    for i, (a, e) in enumerate(pairs):
        assert a.dtype == e.dtype == F32, (i, a.dtype)
        a, e = np.asarray(a, np.float64), np.asarray(e, np.float64)
        err = np.linalg.norm(a - e) / max(np.linalg.norm(e), 1e-30)
        assert err <= tol, f"leaf {i}: relative error {err:.2e} > {tol}"


def assert_half_products(text, half, count):
    """Every matmul and convolution of a lowered program: half x half -> half
    (float32 accumulation; results in the reduce dtype, the compute dtype)."""
    found = [(op.name, op.operand_types, op.result_types) for op in contractions(text)]
    wrong = [f for f in found if f[1:] != ((half, half), (half,))]
    assert not wrong and len(found) == count, (wrong, len(found), count)


# --- The three defects ------------------------------------------------------------


def test_autocast_returns_modules_with_non_array_leaves():
    mlp = eqx.nn.MLP(3, 2, 4, depth=1, activation=jax.nn.gelu, key=jax.random.key(0))

    def scale_first_layer(model, factor):  # A module in, a module (and a result) out.
        w = model.layers[0].weight
        return eqx.tree_at(lambda m: m.layers[0].weight, model, w * factor), model(jnp.ones(3))

    def build(key):  # Nothing goes in: the layers it makes come back as made.
        return eqx.nn.MLP(3, 2, 4, depth=1, activation=jax.nn.gelu, key=key)

    w0 = mlp.layers[0].weight
    for run in (lambda f, *a: f(*a), lambda f, *a: eqx.filter_jit(f)(*a)):
        new, y = run(autocast(scale_first_layer, "c=bf16"), mlp, jnp.float32(2.0))
        assert new.activation is jax.nn.gelu and new.final_activation is mlp.final_activation
        # What came back as it went in keeps its dtype; the weight computed
        # from it is a result, unless said to be state.
        assert new.layers[0].weight.dtype == BF16 and y.dtype == BF16
        assert float_dtypes(eqx.tree_at(lambda m: m.layers[0].weight, new, w0)) == {F32}
        said = autocast(scale_first_layer, "c=bf16", returns_state=(True, False))
        new, y = run(said, mlp, jnp.float32(2.0))
        assert float_dtypes(new) == {F32} and y.dtype == BF16
        np.testing.assert_array_equal(new.layers[0].weight, 2 * mlp.layers[0].weight)
    built = eqx.filter_jit(autocast(build, "c=bf16", returns_state=True))(jax.random.key(1))
    assert built.activation is jax.nn.gelu and float_dtypes(built) == {F32}  # As made.
    assert float_dtypes(eqx.filter_jit(autocast(build, "c=bf16"))(jax.random.key(1))) == {BF16}


def batch_norm_step(bn):
    def step(x, state):
        return jax.vmap(bn, axis_name="batch", in_axes=(0, None), out_axes=(0, None))(x, state)

    return step


def test_autocast_keeps_equinox_state_dtype():
    bn, state = eqx.nn.make_with_state(eqx.nn.BatchNorm)(4, "batch", mode="ema")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((BATCH, 4)), F32)
    step = autocast(batch_norm_step(bn), "c=bf16")  # Output dtype bfloat16.
    y, state1 = step(x, state)
    assert y.dtype == BF16
    assert dtypes(state1) == dtypes(state) == [np.dtype(bool), F32, F32]
    y2, state2 = eqx.filter_jit(step)(x, state1)  # Equinox checks the dtypes it gets back.
    assert y2.dtype == BF16 and dtypes(state2) == dtypes(state)
    # The statistics are float32 values, not bfloat16 ones stored as float32.
    _, ref = batch_norm_step(bn)(x, state)
    mean, ref_mean = (s.get(bn.ema_state_index)[0] for s in (state1, ref))
    np.testing.assert_allclose(mean, ref_mean, rtol=1e-6)


def lstm_body(cell):
    def body(carry, x):
        carry = cell(x, carry)
        return carry, carry[0]

    return body


@pytest.mark.parametrize(
    "policy, carry_dtype", [("c=bf16", F32), ("mixed_bfloat16", BF16)], ids=["f32-carry", "bf16"]
)
def test_autocast_scan_body_keeps_lstm_carry_dtype(policy, carry_dtype):
    # A bfloat16 carry comes with a bfloat16 cell (Equinox's `weight @ h` does not promote).
    cast = jmp.Policy(carry_dtype, carry_dtype, carry_dtype).cast_to_param
    cell = cast(eqx.nn.LSTMCell(3, 4, key=jax.random.key(0)))
    xs = cast(jnp.asarray(np.random.default_rng(1).standard_normal((5, 3)), F32))
    carry = (jnp.zeros(4, carry_dtype), jnp.zeros(4, carry_dtype))
    # lax.scan requires the body's carry out to have the carry's types.
    (h, c), ys = lax.scan(autocast(lstm_body(cell), policy), carry, xs)
    assert h.dtype == c.dtype == carry_dtype
    assert ys.dtype == jmp.get_policy(policy).output_dtype


def test_select_tree_passes_non_array_leaves_of_modules():
    def model(key):
        return eqx.nn.Sequential([eqx.nn.Linear(3, 2, key=key), eqx.nn.Dropout(0.5)])

    a, b = model(jax.random.key(0)), model(jax.random.key(1))
    for select in (jmp.select_tree, eqx.filter_jit(jmp.select_tree)):
        for pred, want in ((True, a), (False, b)):
            out = select(jnp.bool_(pred), a, b)
            np.testing.assert_array_equal(out.layers[0].weight, want.layers[0].weight)
            # Plain Python values: Dropout tests `if inference` and needs a bool.
            assert out.layers[1].inference is False and out.layers[1].p == 0.5
            assert type(out.layers[1].p) is float
    other = eqx.tree_at(lambda m: m.layers[1].p, b, 0.1)
    assert float(jmp.select_tree(jnp.bool_(False), a, other).layers[1].p) == pytest.approx(0.1)
    mlps = [eqx.nn.MLP(2, 2, 2, 1, activation=f, key=jax.random.key(0)) for f in (jnp.tanh, abs)]
    with pytest.raises(TypeError, match=r"differ at \.activation .*not an array"):
        jmp.select_tree(jnp.bool_(True), *mlps)


# --- A model with every layer kind ------------------------------------------------


class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    norm: eqx.nn.BatchNorm
    proj: eqx.nn.Linear
    attn: eqx.nn.MultiheadAttention
    drop: eqx.nn.Dropout
    head: eqx.nn.Linear

    def __init__(self, key):
        k = jax.random.split(key, 4)
        # No bias before BatchNorm: its gradient would be 0 up to rounding.
        self.conv = eqx.nn.Conv2d(1, 4, 3, padding=1, use_bias=False, key=k[0])
        self.norm = eqx.nn.BatchNorm(4, axis_name="batch", mode="ema")
        self.proj = eqx.nn.Linear(32, 16, key=k[1])
        self.attn = eqx.nn.MultiheadAttention(2, 16, dropout_p=0.25, key=k[2])
        self.drop = eqx.nn.Dropout(0.25)
        self.head = eqx.nn.Linear(16, 10, key=k[3])

    def __call__(self, x, state, key):  # x: (1, 8, 8), one example.
        k1, k2 = jax.random.split(key)
        h, state = self.norm(self.conv(x), state)
        tokens = jax.vmap(self.proj)(jax.nn.relu(h).transpose(1, 0, 2).reshape(8, 32))
        mask = jnp.tril(jnp.ones((8, 8), bool))  # Causal: token i sees tokens <= i.
        h = self.attn(tokens, tokens, tokens, mask, key=k1)
        return self.head(self.drop(h.mean(0), key=k2)), state


def net_loss(model, state, x, y, key):
    keys = jax.random.split(key, x.shape[0])
    batched = jax.vmap(model, axis_name="batch", in_axes=(0, None, 0), out_axes=(0, None))
    logits, state = batched(x, state, keys)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), state


def grads_fn(loss_fn, policy, scale=1.0):
    """(grads, loss, state) of `loss_fn` under `policy` (None: as written), by
    `eqx.filter_grad` of the scaled loss, unscaled after."""
    f = loss_fn if policy is None else autocast(loss_fn, policy)

    def scaled(model, *args):
        loss, state = f(model, *args)
        return loss * scale, (loss, state)

    def grads(model, *args):
        g, (loss, state) = eqx.filter_grad(scaled, has_aux=True)(model, *args)
        return jax.tree.map(lambda x: x / scale, g), loss, state

    return grads


@pytest.fixture(scope="module")
def net_setup():
    model, state = eqx.nn.make_with_state(Net)(jax.random.key(0))
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((BATCH, 1, 8, 8)), F32)
    y = jnp.asarray(rng.integers(0, 10, BATCH), jnp.int32)
    return model, state, x, y, jax.random.key(1)


def scale_for(policy):
    return 2.0**8 if policy == "mixed_float16" else 1.0  # float16 gradients underflow


@pytest.fixture(scope="module")
def net_results(net_setup):
    """{policy: (grads, loss, state)} for float32 (None) and every policy, one program."""
    names = [None, *POLICIES]
    fns = [grads_fn(net_loss, p, scale_for(p)) for p in names]
    outs = eqx.filter_jit(lambda *a: [f(*a) for f in fns])(*net_setup)
    return dict(zip(names, outs))


@pytest.fixture(scope="module")
def net_product_count(net_setup):
    text = eqx.filter_jit(grads_fn(net_loss, None)).lower(*net_setup).as_text()
    return len(contractions(text))


@pytest.mark.parametrize("policy", POLICIES)
def test_net_every_product_half_with_float32_accumulation(net_setup, net_product_count, policy):
    count = net_product_count
    assert count >= 20  # Convolution, linears and attention, forward and backward.
    text = eqx.filter_jit(grads_fn(net_loss, policy)).lower(*net_setup).as_text()
    assert_half_products(text, POLICIES[policy], count)


@pytest.mark.parametrize("policy", POLICIES)
def test_net_gradients_close_to_float32(net_results, policy):
    grads, loss, _ = net_results[policy]
    ref_grads, ref_loss, _ = net_results[None]
    assert loss.dtype == F32 and np.isfinite(loss)
    assert abs(float(loss) - float(ref_loss)) < 10 * GRAD_TOL[POLICIES[policy]]
    assert_grads_close(grads, ref_grads, GRAD_TOL[POLICIES[policy]])


@pytest.mark.parametrize("policy", POLICIES)
def test_net_batch_norm_state_keeps_float32(net_setup, net_results, policy):
    model, state = net_setup[:2]
    new_state, ref_state = net_results[policy][2], net_results[None][2]
    assert dtypes(new_state) == dtypes(state) == [np.dtype(bool), F32, F32]
    mean, var = new_state.get(model.norm.ema_state_index)
    ref_mean, ref_var = ref_state.get(model.norm.ema_state_index)
    assert not np.array_equal(mean, state.get(model.norm.ema_state_index)[0])  # It was updated.
    # Statistics of the convolution's result, a half-operand product: close, not equal.
    for stat, ref in ((mean, ref_mean), (var, ref_var)):
        np.testing.assert_allclose(stat, ref, atol=STAT_TOL[POLICIES[policy]] * np.abs(ref).max())


def test_dropout_and_attention_dropout_draw_the_float32_masks():
    attn = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.5, key=jax.random.key(0))
    drop = eqx.nn.Dropout(0.5)
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4, 8)), F32)

    def f(x, key):
        k1, k2 = jax.random.split(key)
        return drop(attn(x, x, x, key=k1), key=k2)

    keys = [jax.random.key(3), jax.random.key(4)]
    outs = jax.jit(lambda x: [g(x, k) for g in (f, autocast(f, M_BF16)) for k in keys])(x)
    (ref3, ref4, auto3, auto4) = (np.asarray(o) for o in outs)
    for ref, auto in ((ref3, auto3), (ref4, auto4)):
        np.testing.assert_array_equal(auto == 0, ref == 0)  # The same elements dropped...
        assert 0 < (ref == 0).mean() < 1
        np.testing.assert_allclose(auto, ref, atol=5e-2)  # ...and the rest close.
    assert not np.array_equal(ref3 == 0, ref4 == 0)  # Another key, another mask.


def test_attention_mask_hides_later_tokens():
    attn = eqx.nn.MultiheadAttention(2, 8, key=jax.random.key(0))
    mask = jnp.tril(jnp.ones((4, 4), bool))
    x = jnp.asarray(np.random.default_rng(5).standard_normal((4, 8)), F32)
    later = x.at[2:].set(100.0)  # Only tokens 2 and 3 change.

    def f(x):
        return attn(x, x, x, mask)

    out, out_later = jax.jit(lambda a, b: (autocast(f, M_BF16)(a), autocast(f, M_BF16)(b)))(
        x, later
    )
    np.testing.assert_array_equal(out[:2], out_later[:2])
    assert not np.allclose(out[2:], out_later[2:])
    np.testing.assert_allclose(out, f(x), atol=5e-2)


# --- LSTMCell in lax.scan ---------------------------------------------------------


def lstm_loss(cell, carry, xs, y):
    carry, hs = lax.scan(lstm_body(cell), carry, xs)
    return jnp.mean((hs.sum(-1) - y) ** 2), carry


@pytest.mark.parametrize("policy", POLICIES)
def test_lstm_in_scan_gradients_carry_and_products(policy):
    cell = eqx.nn.LSTMCell(3, 8, key=jax.random.key(0))
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((6, 3)), F32)
    y = jnp.asarray(rng.standard_normal(6), F32)
    carry = (jnp.zeros(8, F32), jnp.zeros(8, F32))
    args = (cell, carry, xs, y)
    grads, ref = grads_fn(lstm_loss, policy, scale_for(policy)), grads_fn(lstm_loss, None)
    (g, loss, new_carry), (ref_g, ref_loss, ref_carry) = eqx.filter_jit(
        lambda *a: (grads(*a), ref(*a))
    )(*args)
    tol = GRAD_TOL[POLICIES[policy]]
    assert dtypes(new_carry) == [F32, F32] and loss.dtype == F32
    assert abs(float(loss) - float(ref_loss)) <= tol * float(ref_loss)
    assert_grads_close(g, ref_g, tol)
    np.testing.assert_allclose(new_carry[0], ref_carry[0], atol=tol)
    # The scan body's matmuls, forward and backward (scan keeps each in its body).
    text = eqx.filter_jit(grads).lower(*args).as_text()
    count = len(contractions(eqx.filter_jit(ref).lower(*args).as_text()))
    assert count >= 3
    assert_half_products(text, POLICIES[policy], count)


# --- filter_vmap and filter_jit ---------------------------------------------------


def test_filter_vmap_over_an_ensemble():
    keys = jax.random.split(jax.random.key(0), 5)
    ensemble = eqx.filter_vmap(lambda k: eqx.nn.Linear(4, 3, key=k))(keys)
    xs = jnp.asarray(np.random.default_rng(4).standard_normal((5, 4)), F32)

    def apply(model, x):
        return jnp.tanh(model(x))

    inside = eqx.filter_vmap(autocast(apply, "mixed_bfloat16"))
    outside = autocast(eqx.filter_vmap(apply), "mixed_bfloat16")
    jit_inside = autocast(eqx.filter_jit(eqx.filter_vmap(apply)), "mixed_bfloat16")
    fns = (inside, outside, jit_inside)
    *outs, ref = eqx.filter_jit(
        lambda m, x: [*(f(m, x) for f in fns), eqx.filter_vmap(apply)(m, x)]
    )(ensemble, xs)
    for out in outs:
        assert out.dtype == F32 and out.shape == (5, 3)
        np.testing.assert_allclose(out, ref, atol=3e-2)
    for fn in fns:
        assert_half_products(eqx.filter_jit(fn).lower(ensemble, xs).as_text(), "bf16", 1)


def test_filter_jit_train_step_with_loss_scaled(net_setup):
    # bfloat16 (no loss scale) trains in examples/equinox_vit.py, tested in test_examples.py.
    model, state, x, y, key = net_setup
    policy = "mixed_float16"
    tx = jmp.loss_scaled(optax.sgd(0.1), jmp.DynamicLossScale(jnp.float32(2.0**15), period=2))
    opt_state = tx.init(eqx.filter(model, eqx.is_inexact_array))
    traces = []

    @eqx.filter_jit
    def train_step(model, state, opt_state, x, y, key):
        traces.append(1)
        scale = jmp.get_loss_scale(opt_state)

        def loss_fn(model):
            loss, new_state = autocast(net_loss, policy)(model, state, x, y, key)
            return scale.scale(loss), (loss, new_state)

        grads, (loss, state) = eqx.filter_grad(loss_fn, has_aux=True)(model)
        params = eqx.filter(model, eqx.is_inexact_array)
        updates, opt_state = tx.update(grads, opt_state, params)
        return eqx.apply_updates(model, updates), state, opt_state, loss

    losses = []
    for step in range(3):
        model, state, opt_state, loss = train_step(
            model, state, opt_state, x, y, jax.random.fold_in(key, step)
        )
        losses.append(float(loss))
    assert len(traces) == 1  # The same types every step: one trace.
    assert float_dtypes(model) == {F32} and dtypes(state) == [np.dtype(bool), F32, F32]
    assert int(opt_state.total_notfinite) == 0 and np.isfinite(losses).all()
    # Grew after `period` finite steps: 2^15 -> 2^16.
    assert float(jmp.get_loss_scale(opt_state).loss_scale) == 2.0**16
