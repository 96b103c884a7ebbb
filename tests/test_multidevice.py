"""Loss scaling across 8 devices: every device skips together, state stays replicated."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp

from helpers import assert_bitwise_equal

N_DEVICES, PER_DEVICE = 8, 2
BATCH = N_DEVICES * PER_DEVICE
BAD_DEVICE = 3


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < N_DEVICES:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:N_DEVICES]), ("data",))


def init_params():
    rng = np.random.default_rng(0)
    return {
        "w": jnp.asarray(rng.normal(size=(4, 3)) * 0.5, jnp.float32),
        "b": jnp.zeros(3, jnp.float32),
    }


def make_batch(overflow=False):
    rng = np.random.default_rng(1)
    x = rng.normal(size=(BATCH, 4)).astype(np.float32)
    y = rng.normal(size=(BATCH, 3)).astype(np.float32)
    if overflow:  # one row of one device's shard
        x[BAD_DEVICE * PER_DEVICE, 1] = np.inf
    return jnp.asarray(x), jnp.asarray(y)


def loss_fn(params, x, y):
    return jnp.mean((jnp.tanh(x @ params["w"] + params["b"]) - y) ** 2)


def make_tx(axis_name=None, reduce_inside=False):
    inner = optax.sgd(0.1, momentum=0.9)
    if reduce_inside:  # per-device gradients are averaged inside the wrapper
        mean = optax.stateless(lambda g, p: jax.lax.pmean(g, "data"))
        inner = optax.chain(mean, inner)
    return jmp.loss_scaled(inner, jmp.DynamicLossScale(2.0**15, period=2), axis_name=axis_name)


def train_step(tx):
    def step(params, opt_state, x, y):
        loss_scale = jmp.get_loss_scale(opt_state)
        grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return step


def batches():
    return [make_batch(), make_batch(overflow=True), make_batch()]


@pytest.fixture(scope="module")
def single_device_result():
    """The same three steps on one device, unsharded."""
    tx = make_tx()
    step = jax.jit(train_step(tx))
    params = init_params()
    state = tx.init(params)
    for x, y in batches():
        params, state = step(params, state, x, y)
    return params, state


def assert_replicated(tree):
    """Every leaf is fully replicated and holds the same bits on all 8 devices."""
    for leaf in jax.tree.leaves(tree):
        assert leaf.sharding.is_fully_replicated
        shards = leaf.addressable_shards
        assert len(shards) == N_DEVICES
        first = np.asarray(shards[0].data)
        for shard in shards[1:]:
            assert np.asarray(shard.data).tobytes() == first.tobytes()


def test_data_parallel_jit_skips_on_one_shards_overflow(mesh, single_device_result):
    replicated = NamedSharding(mesh, P())
    sharded = NamedSharding(mesh, P("data"))
    tx = make_tx()
    step = jax.jit(train_step(tx), out_shardings=(replicated, replicated))
    params = jax.device_put(init_params(), replicated)
    state = jax.device_put(tx.init(params), replicated)

    for i, (x, y) in enumerate(batches()):
        x, y = jax.device_put((x, y), sharded)
        assert x.addressable_shards[BAD_DEVICE].data.shape == (PER_DEVICE, 4)
        before = params
        params, state = step(params, state, x, y)
        assert_replicated((params, state))
        if i == 1:  # the overflow in device 3's rows: everyone skipped
            assert np.isinf(np.asarray(x.addressable_shards[BAD_DEVICE].data)).any()
            assert_bitwise_equal(params, before)
            assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**14
            assert int(state.notfinite_count) == 1

    ref_params, ref_state = single_device_result
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**14


def shard_map_step(mesh, tx, reduce_grads, check_vma):
    """A shard_map step that returns every device's own copy of the results."""

    def local(params, opt_state, x, y):
        loss_scale = jmp.get_loss_scale(opt_state)
        if check_vma:
            # With typed shard_map, gradients of replicated params come back
            # already summed over devices; marking the params device-varying
            # keeps them per device, as without check_vma.
            params = jax.lax.pcast(params, "data", to="varying")
        grads = jax.grad(lambda p: loss_scale.scale(loss_fn(p, x, y)))(params)
        if reduce_grads:
            grads = jax.lax.pmean(grads, "data")
        updates, opt_state = tx.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        # A leading axis of size 1 per device, so that the caller sees all 8 copies.
        return jax.tree.map(lambda a: a[None], (params, opt_state))

    return jax.jit(
        jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(), P(), P("data"), P("data")),
            out_specs=P("data"),
            check_vma=check_vma,
        )
    )


@pytest.mark.parametrize(
    "variant",
    ["pmean_then_check", "check_across_devices", "check_across_devices_vma"],
)
def test_shard_map_step_every_device_skips(mesh, variant, single_device_result):
    if variant == "pmean_then_check":
        # Local gradients averaged before the wrapper: an inf anywhere reaches all.
        tx, reduce_grads = make_tx(), True
    else:
        # Unreduced per-device gradients: the wrapper agrees on finiteness over
        # the axis (all_finite(..., axis_name="data")); the inner optimizer
        # averages them.
        tx, reduce_grads = make_tx(axis_name="data", reduce_inside=True), False
    step = shard_map_step(mesh, tx, reduce_grads, check_vma=variant.endswith("vma"))
    params = init_params()
    state = tx.init(params)
    for i, (x, y) in enumerate(batches()):
        before = params
        copies = step(params, state, x, y)
        # All 8 devices hold the same bits: params, loss scale, counters, inner state.
        for leaf in jax.tree.leaves(copies):
            assert leaf.shape[0] == N_DEVICES
            for d in range(1, N_DEVICES):
                assert np.asarray(leaf[d]).tobytes() == np.asarray(leaf[0]).tobytes()
        params, state = jax.tree.map(lambda a: a[0], copies)
        if i == 1:
            assert_bitwise_equal(params, before)
            assert float(jmp.get_loss_scale(state).loss_scale) == 2.0**14
            assert (int(state.notfinite_count), int(state.total_notfinite)) == (1, 1)

    ref_params, ref_state = single_device_result
    for a, b in zip(jax.tree.leaves((params, state)), jax.tree.leaves((ref_params, ref_state))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_all_finite_axis_name_agrees_across_devices(mesh):
    def local(x):
        return jnp.stack([jmp.all_finite(x, axis_name="data"), jmp.all_finite(x)])[None]

    check = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=P("data"), out_specs=P("data")))
    x, _ = make_batch(overflow=True)
    agreed, local_only = np.asarray(check(x)).T
    assert not agreed.any()  # every device says "not finite"
    # Without axis_name only the device with the inf knows (the check can fail).
    assert local_only.tolist() == [d != BAD_DEVICE for d in range(N_DEVICES)]
    agreed, _ = np.asarray(check(make_batch()[0])).T
    assert agreed.all()
