"""One process of the two-process test (`tests/test_multiprocess.py`), and the shared training run.

Run as a script it is one JAX process of a multi-controller job: it joins
`jax.distributed` on localhost, sees 4 local CPU devices of an 8-device
global mesh, trains, and writes what it saw to `--out`::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python tests/_multiprocess_worker.py \
        --process-id 0 --port 12345 --phase train --out DIR --ckpt DIR/ckpt

`--phase train` trains steps 0..STEPS from fresh parameters and saves an
orbax checkpoint after SAVE_AT steps (every process writes its own shards),
for each configuration (`--configs`, default both: parameters sharded
FSDP-style, and replicated);
`--phase resume` restores that checkpoint into freshly initialised, sharded
state and trains steps SAVE_AT..STEPS. The test imports the same module and
runs `train` on the 8 devices of its own process as the single-process
reference.

What a process writes (`<phase>_<config>_process<i>.json` and `.npz`): per step the
loss-scale state it holds (loss scale, counter, overflow counters), whether
the step was skipped and whether its own parameter shards stayed bit for bit
the same; at the end every one of its addressable shards of the parameters
and optimizer state, with the device and the global index it holds, so the
test can check that every copy of every piece agrees across devices and
processes and assemble the global arrays.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy

N_PROCESSES, DEVICES_PER_PROCESS = 2, 4
N_DEVICES = N_PROCESSES * DEVICES_PER_PROCESS
GLOBAL_BATCH, FEATURES, OUTPUTS = 16, 8, 4
ROWS_PER_PROCESS = GLOBAL_BATCH // N_PROCESSES
POLICY = "mixed_float16"  # float16 compute: the policy that needs loss scaling
INITIAL_SCALE, PERIOD = 2.0**15, 3
STEPS, SAVE_AT = 14, 7
# step -> the process whose shard of the batch overflows at that step. After
# the checkpoint too, so the restored loss-scale state has to be right.
INJECT = {2: 0, 3: 1, 8: 1, 12: 0}
# Finite in float32 but above float16's 65504: the policy's cast of the
# input to float16 turns it into inf, a real overflow of the half compute.
OVERFLOW_VALUE = 1e30
CONFIGS = ("fsdp", "replicated")


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.gelu(nn.Dense(32)(x))
        x = nn.gelu(nn.Dense(32)(x))
        return nn.Dense(OUTPUTS)(x)


MODEL = MLP()
APPLY = jmp_policy.with_policy(MODEL.apply, POLICY)


def make_tx():
    return jmp_policy.loss_scaled(
        optax.adam(1e-2), jmp_policy.DynamicLossScale(INITIAL_SCALE, period=PERIOD)
    )


def global_batch(step: int) -> tuple[np.ndarray, np.ndarray]:
    """The global batch of `step` (the same numbers in every process), with its injection."""
    rng = np.random.default_rng(1000 + step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = np.tanh(x[:, :OUTPUTS] * 2.0 - x[:, OUTPUTS:]).astype(np.float32)
    if step in INJECT:  # one element of one row in the rows of process INJECT[step]
        x[INJECT[step] * ROWS_PER_PROCESS + 1, 2] = OVERFLOW_VALUE
    return x, y


def spec_for(shape: tuple[int, ...], config: str) -> P:
    """FSDP: shard the first axis over the mesh where it divides; replicated: nothing."""
    if config == "fsdp" and len(shape) >= 1 and shape[0] % N_DEVICES == 0:
        return P("data")
    return P()


def shardings(mesh: Mesh, abstract, config: str):
    return jax.tree.map(lambda a: NamedSharding(mesh, spec_for(a.shape, config)), abstract)


def make_step(mesh: Mesh, tx, param_sh, state_sh):
    batch_sh = NamedSharding(mesh, P("data"))
    replicated = NamedSharding(mesh, P())

    def step(params, opt_state, x, y):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def loss_fn(p):
            loss = jnp.mean((APPLY(p, x) - y) ** 2)
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(
        step,
        in_shardings=(param_sh, state_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, state_sh, replicated),
    )


def local_rows(mesh: Mesh) -> slice:
    """The rows of the global batch that this process's devices hold."""
    sharding = NamedSharding(mesh, P("data"))
    index_map = sharding.addressable_devices_indices_map((GLOBAL_BATCH, FEATURES))
    starts = sorted(idx[0].start for idx in index_map.values())
    stops = sorted(idx[0].stop for idx in index_map.values())
    rows = slice(starts[0], stops[-1])
    assert rows.stop - rows.start == len(index_map) * (GLOBAL_BATCH // N_DEVICES), index_map
    return rows


def local_value(x) -> np.ndarray:
    """The value of a replicated array, read from this process's first copy."""
    return np.asarray(x.addressable_shards[0].data)


def loss_scale_record(opt_state) -> dict:
    ls = jmp_policy.get_loss_scale(opt_state)
    return {
        "loss_scale": float(local_value(ls.loss_scale)),
        "counter": int(local_value(ls.counter)),
        "notfinite_count": int(local_value(opt_state.notfinite_count)),
        "total_notfinite": int(local_value(opt_state.total_notfinite)),
    }


def local_bytes(tree) -> list[bytes]:
    return [s.data.tobytes() for leaf in jax.tree.leaves(tree) for s in leaf.addressable_shards]


def init_state(mesh: Mesh, config: str, tx):
    """Fresh parameters and optimizer state, created sharded by jit."""
    x0 = jnp.zeros((GLOBAL_BATCH, FEATURES), jnp.float32)
    init = jmp_policy.with_policy(MODEL.init, POLICY)
    param_sh = shardings(mesh, jax.eval_shape(init, jax.random.key(0), x0), config)
    params = jax.jit(lambda k: init(k, x0), out_shardings=param_sh)(jax.random.key(0))
    state_sh = shardings(mesh, jax.eval_shape(tx.init, params), config)
    opt_state = jax.jit(tx.init, out_shardings=state_sh)(params)
    return params, opt_state, param_sh, state_sh


def train(mesh: Mesh, config: str, phase: str = "train", ckpt: str | None = None):
    """Trains on `mesh` (8 devices, in one process or across several); returns the records.

    Returns `(records, params, opt_state)`; records is a list of per-step dicts.
    """
    tx = make_tx()
    params, opt_state, param_sh, state_sh = init_state(mesh, config, tx)
    rows = local_rows(mesh)
    batch_sh = NamedSharding(mesh, P("data"))
    step_fn = make_step(mesh, tx, param_sh, state_sh)
    start = 0
    if phase == "resume":
        import orbax.checkpoint as ocp

        abstract = jax.tree.map(
            ocp.utils.to_shape_dtype_struct, {"params": params, "opt_state": opt_state}
        )
        with ocp.StandardCheckpointer() as checkpointer:
            restored = checkpointer.restore(ckpt, abstract)
        params, opt_state, start = restored["params"], restored["opt_state"], SAVE_AT
        for leaf, sh in zip(jax.tree.leaves(params), jax.tree.leaves(param_sh)):
            assert leaf.sharding.is_equivalent_to(sh, leaf.ndim), (leaf.sharding, sh)
    records = []
    if phase == "resume":
        records.append({"step": "restored", **loss_scale_record(opt_state)})
    for i in range(start, STEPS):
        x, y = global_batch(i)
        xl, yl = x[rows], y[rows]
        gx = jax.make_array_from_process_local_data(batch_sh, xl, (GLOBAL_BATCH, FEATURES))
        gy = jax.make_array_from_process_local_data(batch_sh, yl, (GLOBAL_BATCH, OUTPUTS))
        before = local_bytes((params, opt_state.inner_state))
        total_before = loss_scale_record(opt_state)["total_notfinite"]
        params, opt_state, loss = step_fn(params, opt_state, gx, gy)
        record = loss_scale_record(opt_state)
        record.update(
            step=i,
            # Whether this process's own rows held the injected overflow.
            overflow_in_my_rows=bool((np.abs(xl) > np.finfo(np.float16).max).any()),
            skipped=record["total_notfinite"] == total_before + 1,
            unchanged=before == local_bytes((params, opt_state.inner_state)),
            loss=float(local_value(loss)),
        )
        records.append(record)
        if phase == "train" and ckpt is not None and i + 1 == SAVE_AT:
            import orbax.checkpoint as ocp

            # Every process calls save: each writes the shards it holds.
            with ocp.StandardCheckpointer() as checkpointer:
                checkpointer.save(ckpt, {"params": params, "opt_state": opt_state})
    return records, params, opt_state


def shards_of(tree) -> tuple[list[dict], dict[str, np.ndarray]]:
    """Every addressable shard of every leaf: (meta list, arrays by key)."""
    meta, arrays = [], {}
    for path, leaf in jax.tree_util.tree_leaves_with_path(tree):
        for shard in leaf.addressable_shards:
            key = f"s{len(meta)}"
            index = [
                [0 if s.start is None else s.start, dim if s.stop is None else s.stop]
                for s, dim in zip(shard.index, leaf.shape)
            ]
            meta.append(
                {
                    "key": key,
                    "leaf": jax.tree_util.keystr(path),
                    "shape": list(leaf.shape),
                    "dtype": str(leaf.dtype),
                    "device": shard.device.id,
                    "index": index,
                    "fully_replicated": leaf.sharding.is_fully_replicated,
                }
            )
            arrays[key] = np.asarray(shard.data)
    return meta, arrays


def write_result(out: Path, name: str, records, params, opt_state, extra: dict) -> None:
    meta, arrays = shards_of({"params": params, "opt_state": opt_state})
    np.savez(out / f"{name}.npz", **arrays)
    (out / f"{name}.json").write_text(
        json.dumps({"records": records, "shards": meta, **extra}, indent=1)
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated {CONFIGS}")
    parser.add_argument("--phase", choices=("train", "resume"), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--ckpt", type=Path, required=True, help="one checkpoint per config in it")
    args = parser.parse_args(argv)
    configs = args.configs.split(",")
    if not set(configs) <= set(CONFIGS):
        parser.error(f"--configs: {args.configs!r}: each must be one of {CONFIGS}")

    # Cross-process collectives on CPU go through gloo; must precede the backend's start.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=f"localhost:{args.port}",
        num_processes=N_PROCESSES,
        process_id=args.process_id,
        initialization_timeout=60,
    )
    try:
        assert jax.process_count() == N_PROCESSES, jax.process_count()
        assert len(jax.local_devices()) == DEVICES_PER_PROCESS, jax.local_devices()
        assert len(jax.devices()) == N_DEVICES, jax.devices()
        mesh = Mesh(np.array(jax.devices()), ("data",))
        rows = local_rows(mesh)
        for config in configs:
            with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32
                records, params, opt_state = train(
                    mesh, config, args.phase, str(args.ckpt.resolve() / config)
                )
            write_result(
                args.out,
                f"{args.phase}_{config}_process{args.process_id}",
                records,
                params,
                opt_state,
                {
                    "process_index": jax.process_index(),
                    "local_devices": [d.id for d in jax.local_devices()],
                    "rows": [rows.start, rows.stop],
                },
            )
            print(f"process {args.process_id}: {args.phase} {config} done", flush=True)
    finally:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
