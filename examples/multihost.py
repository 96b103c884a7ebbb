"""The mixed precision train step on several hosts: `jax.distributed`, one process per host.

JAX's multi-controller runtime runs the same program on every host; each
process drives its own (local) devices, and `jax.jit` over a global mesh
makes the collectives. The train step is the jmp_policy README's:
`with_policy(model.apply, "mixed_float16")` and
`loss_scaled(optax.adam(...), DynamicLossScale(2**15))`. Under `jax.jit` the
finiteness check of the gradients is a global reduction, so an overflow in
one host's part of the batch makes every host skip the step, and the
loss-scale state stays the same everywhere.

Each process loads only its own rows of the global batch and hands them to
`jax.make_array_from_process_local_data`; parameters and Adam state are
replicated (`--fsdp`: sharded over the mesh along their first axis).

On several hosts, run on every host (process 0's host is the coordinator)::

    python examples/multihost.py --coordinator HOST0:1234 --num-processes 2 --process-id 0
    python examples/multihost.py --coordinator HOST0:1234 --num-processes 2 --process-id 1

or set JMP_COORDINATOR, JMP_NUM_PROCESSES and JMP_PROCESS_ID instead of the
flags. With none of them, `jax.distributed.initialize()` detects the cluster
itself (SLURM, Open MPI, Cloud TPU, Kubernetes JobSet).

On one machine, a two-process demonstration (each process gets 4 virtual
CPU devices: one 8-device mesh; the batch rows of process 1 overflow float16
at step 5, and both processes skip it)::

    python examples/multihost.py --demo
"""

from __future__ import annotations

import argparse
import hashlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy

GLOBAL_BATCH, FEATURES, CLASSES = 64, 32, 10
DEMO_PROCESSES, DEMO_DEVICES = 2, 4
DEMO_TIMEOUT = 300  # seconds


class MLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Dense(256)(x))
        x = nn.relu(nn.Dense(256)(x))
        return nn.Dense(CLASSES)(x)


def global_batch(step: int, overflow_at: int | None, overflow_process: int):
    """The global batch of `step`; every process makes the same numbers and keeps its rows."""
    rng = np.random.default_rng(step)
    x = rng.normal(size=(GLOBAL_BATCH, FEATURES)).astype(np.float32)
    y = (x[:, :CLASSES] + 0.5 * rng.normal(size=(GLOBAL_BATCH, CLASSES))).argmax(-1)
    if step == overflow_at:  # finite in float32, inf once cast to float16
        x[overflow_process * GLOBAL_BATCH // jax.process_count(), 0] = 1e30
    return x, y.astype(np.int32)


def train(steps: int, fsdp: bool, overflow_at: int | None, overflow_process: int) -> str:
    """Trains on the global mesh; returns a checksum of this process's parameter shards."""
    mesh = Mesh(np.array(jax.devices()), ("data",))
    n = len(jax.devices())
    if GLOBAL_BATCH % n:
        raise ValueError(f"the global batch {GLOBAL_BATCH} must divide over {n} devices")

    def sharding(shape):  # FSDP: first axis over the mesh where it divides
        spec = P("data") if fsdp and shape and shape[0] % n == 0 else P()
        return NamedSharding(mesh, spec)

    model = MLP()
    policy = "mixed_float16"
    apply = jmp_policy.with_policy(model.apply, policy)
    init = jmp_policy.with_policy(model.init, policy)
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.DynamicLossScale(2.0**15))

    x0 = jnp.zeros((1, FEATURES), jnp.float32)
    abstract = jax.eval_shape(init, jax.random.key(0), x0)
    param_sh = jax.tree.map(lambda a: sharding(a.shape), abstract)
    params = jax.jit(lambda k: init(k, x0), out_shardings=param_sh)(jax.random.key(0))
    state_sh = jax.tree.map(lambda a: sharding(a.shape), jax.eval_shape(tx.init, params))
    opt_state = jax.jit(tx.init, out_shardings=state_sh)(params)
    batch_sh = NamedSharding(mesh, P("data"))

    def step(params, opt_state, x, y):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def loss_fn(p):
            logits = apply(p, x)
            loss = optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()
            return loss_scale.scale(loss), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    step = jax.jit(
        step,
        in_shardings=(param_sh, state_sh, batch_sh, batch_sh),
        out_shardings=(param_sh, state_sh, NamedSharding(mesh, P())),
    )
    # This process's rows of the global batch: the rows its devices hold.
    index_map = batch_sh.addressable_devices_indices_map((GLOBAL_BATCH,))
    first = min(idx[0].start for idx in index_map.values())
    last = max(idx[0].stop for idx in index_map.values())
    me = jax.process_index()
    for i in range(steps):
        x, y = global_batch(i, overflow_at, overflow_process)
        gx = jax.make_array_from_process_local_data(batch_sh, x[first:last], x.shape)
        gy = jax.make_array_from_process_local_data(batch_sh, y[first:last], y.shape)
        params, opt_state, loss = step(params, opt_state, gx, gy)
        # Replicated scalars: every process reads its own copy.
        scale = float(jmp_policy.get_loss_scale(opt_state).loss_scale.addressable_data(0))
        skipped = int(opt_state.total_notfinite.addressable_data(0))
        print(
            f"process {me} step {i}: loss {float(loss.addressable_data(0)):.4f} "
            f"loss scale {scale:g} skipped steps so far {skipped}",
            flush=True,
        )
    digest = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        for shard in sorted(leaf.addressable_shards, key=lambda s: str(s.index)):
            digest.update(str(shard.index).encode() + np.asarray(shard.data).tobytes())
    return digest.hexdigest()[:16]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def demo(argv_rest: Sequence[str]) -> int:
    """Starts DEMO_PROCESSES copies of this script on localhost and waits for them."""
    env = dict(os.environ)
    env.update(
        XLA_FLAGS=f"--xla_force_host_platform_device_count={DEMO_DEVICES}",
        JAX_PLATFORMS="cpu",
    )
    port = _free_port()
    procs, logs = [], []
    try:
        for i in range(DEMO_PROCESSES):
            cmd = [
                sys.executable,
                os.path.abspath(__file__),
                "--coordinator",
                f"localhost:{port}",
                "--num-processes",
                str(DEMO_PROCESSES),
                "--process-id",
                str(i),
                *argv_rest,
            ]
            # Process 0 prints to this terminal; the others into files, shown at the end.
            log = None if i == 0 else tempfile.TemporaryFile()  # noqa: SIM115 (closed below)
            logs.append(log)
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=log, stderr=log, start_new_session=True)
            )
        deadline = time.monotonic() + DEMO_TIMEOUT
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs) or time.monotonic() > deadline:
                break  # one failed (its peers would wait for it) or it hangs: stop them all
            time.sleep(0.1)
    finally:
        for p in procs:  # no process outlives the demo
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:  # it ended in between
                    pass
            p.wait()
        for log in logs[1:]:
            log.seek(0)
            print(log.read().decode(errors="replace").rstrip(), flush=True)
            log.close()
    codes = [p.returncode for p in procs]
    if codes != [0] * DEMO_PROCESSES:
        print(f"demo failed: exit codes {codes}", file=sys.stderr)
        return 1
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--demo",
        action="store_true",
        help="start two processes on this machine (4 CPU devices each)",
    )
    parser.add_argument(
        "--coordinator",
        default=os.environ.get("JMP_COORDINATOR"),
        help="HOST:PORT of process 0 (env JMP_COORDINATOR)",
    )
    parser.add_argument(
        "--num-processes",
        type=int,
        default=os.environ.get("JMP_NUM_PROCESSES"),
        help="processes in the job (env JMP_NUM_PROCESSES)",
    )
    parser.add_argument(
        "--process-id",
        type=int,
        default=os.environ.get("JMP_PROCESS_ID"),
        help="this process's index, 0 .. N-1 (env JMP_PROCESS_ID)",
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument(
        "--fsdp",
        action="store_true",
        help="shard parameters and Adam state over the mesh (default: replicated)",
    )
    parser.add_argument(
        "--overflow-at",
        type=int,
        default=None,
        help="make one process's rows overflow float16 at this step",
    )
    parser.add_argument("--overflow-process", type=int, default=1)
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps: must be at least 1, got {args.steps}")

    if args.demo:
        rest = [a for a in argv if a != "--demo"]
        if args.overflow_at is None:
            rest += ["--overflow-at", "5"]
        return demo(rest)

    # CPU collectives across processes need gloo; GPUs use NCCL whatever this says.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    given = [args.coordinator, args.num_processes, args.process_id]
    if any(v is not None for v in given) and any(v is None for v in given):
        parser.error("give all of --coordinator, --num-processes and --process-id, or none")
    jax.distributed.initialize(
        coordinator_address=args.coordinator,
        num_processes=args.num_processes,
        process_id=args.process_id,
    )
    if not 0 <= args.overflow_process < jax.process_count():
        parser.error(
            f"--overflow-process: must be in [0, {jax.process_count()}), "
            f"got {args.overflow_process}"
        )
    try:
        checksum = train(args.steps, args.fsdp, args.overflow_at, args.overflow_process)
        print(
            f"process {jax.process_index()} of {jax.process_count()}: "
            f"{len(jax.local_devices())} local of {len(jax.devices())} devices, "
            f"checksum of its parameter shards {checksum}",
            flush=True,
        )
    finally:
        jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
