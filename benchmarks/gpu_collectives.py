"""What a sharded train step sends over the wire, per policy, compiled for 8 GPUs without one.

The step: Adam on a 1.3 M-parameter linen Transformer LM (the benchmark
model of `jmp_policy/app/transformer_lm.py`: vocabulary 512, width 256, 2
blocks of 4-head attention and a 256-512-256 MLP), float32 parameters,
a batch of 16 x 32 tokens, compiled for a CUDA topology of `--devices` GPUs
made from a target config (`gpu_targets/*.txtpb`), as `gpu_compile.py` does
for one. Three layouts over one mesh axis:

  fsdp  every parameter (and its Adam state) sharded on its first dimension
        the axis divides, the batch on the same axis: weights all-gathered,
        gradients reduce-scattered
  dp    parameters replicated, the batch sharded: gradients all-reduced
  tp    Megatron-style tensor parallelism, the batch replicated: attention
        heads' projections and the MLP's first layer column-parallel, the
        attention output and the MLP's second layer row-parallel (an
        all-reduce of their results)

and three over a 2 x n/2 mesh (data x model), the batch on data:

  fsdp_tp   tp's layout on model, each sharded parameter's other dimension
            on data (the MLP's kernels P(data, model) and P(model, data))
  tp_rows   every kernel sharded on its (first) contracting dimension over
            model: each product's partial results summed
  explicit_auto  tp's layout on model, an Auto axis; data an Explicit axis
            (`jax.sharding.AxisType`: the batch's sharding in its type)

The collectives are read from the optimised HLO (XLA combines small ones
into tuples; each counts once), their bytes per device by a ring model
(all-reduce 2(n-1)/n of the buffer, all-gather and reduce-scatter (n-1)/n
of the full one, all-to-all (n-1)/n, a permute the buffer). On XLA:CPU every
bf16 collective is widened to f32, so only a GPU compile shows them.

Targets, each printed as holds / FALLS SHORT and written to the JSON: every
policy's bytes at most Flax's hand-written bf16 config's in each layout
and no "Involuntary full rematerialization" in XLA's log while it compiles
(a whole array gathered to be resharded);
`mixed_float8` and `mixed_mxfp8` at most one all-reduce a step beyond
`mixed_bfloat16`'s, and their parameters and Adam state sharded as its;
under FSDP, `mixed_float8`'s weights all-gathered in FP8.

Usage::

    benchmarks/gpu.sh --compile-only --devices 8     # H100 and H200, every layout
    PYTHONPATH=. python benchmarks/gpu_collectives.py --targets h200_sxm --layouts dp
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import hashlib
import math
import os
import re
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import _compiled_hlo
import gpu_compile
import jmp_policy
from jmp_policy.app import transformer_lm

JSON_NAME = "gpu_collectives.json"
BY_HAND = "flax dtype=bf16"
VARIANTS: dict[str, str | None] = {
    "float32": None,
    BY_HAND: None,
    "mixed_bfloat16": "mixed_bfloat16",
    "m=bf16": "p=f32,c=bf16,o=f32,m=bf16",
    "m=bf16 r=f32": "p=f32,c=bf16,o=f32,m=bf16,r=f32",
    "mixed_float8": "mixed_float8",
    "mixed_mxfp8": "mixed_mxfp8",
}
LAYOUTS = ("fsdp", "dp", "tp", "fsdp_tp", "tp_rows", "explicit_auto")
BATCH, SEQ = 16, 32


# Collectives by opcode: the share of the result's bytes a ring sends per
# device, given the group size n (async pairs count at their `-done`).
_RING: dict[str, Callable[[int], float]] = {
    "all-reduce": lambda n: 2 * (n - 1) / n,
    "all-gather": lambda n: (n - 1) / n,
    "reduce-scatter": lambda n: n - 1,  # Its result is one n-th of the buffer.
    "all-to-all": lambda n: (n - 1) / n,
    "collective-permute": lambda n: 1.0,
}
_GROUPS = re.compile(r"replica_groups=(\{\{[0-9,]*\}|\[[0-9,]+\]<=|mesh\[[^\]]*\] \{[^}]*\})")


def model(dtype: Any = None) -> Any:
    return transformer_lm.make_model(512, width=256, depth=2, num_heads=4, mlp_ratio=2, dtype=dtype)


def train_step(variant: str) -> Callable:
    """The variant's `step(params, opt_state, tokens)`: Adam on the next-token loss."""
    policy = VARIANTS[variant]
    apply = model(jnp.bfloat16 if variant == BY_HAND else None).apply
    if policy is not None:
        apply = jmp_policy.with_policy(apply, policy)
    return adam_step(apply)


def adam_step(apply: Callable) -> Callable:
    tx = optax.adam(1e-3)

    def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
        loss, grads = jax.value_and_grad(lambda p: transformer_lm.loss_fn(apply, p, tokens))(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


# Each layout's mesh: one axis "x" over every device, or (data 2, model n/2).
MESHES: dict[str, tuple[str, ...]] = {
    "fsdp": ("x",), "dp": ("x",), "tp": ("x",), "fsdp_tp": ("data", "model"),
    "tp_rows": ("data", "model"), "explicit_auto": ("data", "model"),
}  # fmt: skip


def make_mesh(layout: str, devices: Sequence[Any]) -> jax.sharding.Mesh:
    """The layout's mesh; `explicit_auto`'s data axis Explicit (types hold its
    shardings), its model axis Auto."""
    axes = MESHES[layout]
    shape = (len(devices),) if len(axes) == 1 else (2, len(devices) // 2)
    types = jax.sharding.AxisType
    axis_types = (types.Explicit, types.Auto) if layout == "explicit_auto" else None
    return jax.sharding.Mesh(np.array(devices).reshape(shape), axes, axis_types=axis_types)


def _tensor_parallel(path: str, shape: tuple[int, ...], axis: str) -> list[Any]:
    """Megatron's layout on `axis`: column-parallel attention projections and
    first MLP layer, row-parallel attention output and second MLP layer."""
    spec: list[Any] = [None] * len(shape)
    if re.search(r"(query|key|value)/(kernel|bias)$", path):  # (in, heads, head_dim): head_dim
        spec[-1] = axis
    elif re.search(r"attention[^/]*/out/kernel$", path):  # (heads, head_dim, out)
        spec[1] = axis
    elif re.search(r"Dense_0/(kernel|bias)$", path):
        spec[-1] = axis
    elif re.search(r"Dense_1/kernel$", path):
        spec[0] = axis
    return spec


def param_spec(layout: str, path: str, shape: tuple[int, ...], mesh: jax.sharding.Mesh) -> P:
    """Where a parameter of `shape` (its path "Block_0/Dense_0/kernel") lives."""
    sizes = dict(mesh.shape)
    if layout == "fsdp":
        dim = next((i for i, d in enumerate(shape) if d % sizes["x"] == 0), None)
        return P() if dim is None else P(*[None] * dim, "x")
    if layout in ("tp", "explicit_auto"):
        return P(*_tensor_parallel(path, shape, "x" if layout == "tp" else "model"))
    if layout == "fsdp_tp":  # tensor parallel on model, another dimension sharded on data
        spec = _tensor_parallel(path, shape, "model")
        free = [i for i, e in enumerate(spec) if e is None and shape[i] % sizes["data"] == 0]
        if any(spec) and free:
            spec[free[0]] = "data"
        return P(*spec)
    if layout == "tp_rows" and path.endswith("kernel") and len(shape) > 1:
        return P("model")  # sharded on the (first) contracting dimension
    return P()


def sharded_inputs(layout: str, mesh: jax.sharding.Mesh) -> tuple[Any, Any, Any]:
    """`(params, opt_state, tokens)` as `ShapeDtypeStruct`s placed for `layout`."""
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    inputs = jax.ShapeDtypeStruct((BATCH, SEQ), jnp.int32)
    params = jax.eval_shape(model().init, jax.random.key(0), inputs)["params"]
    specs = jax.tree_util.tree_map_with_path(
        lambda path, x: param_spec(layout, jax.tree_util.keystr(path, simple=True, separator="/"),
                                   x.shape, mesh),
        params,
    )  # fmt: skip

    def placed(x: Any, spec: P) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    tx = optax.adam(1e-3)
    # Adam's moments take their parameter's place; its step count is replicated.
    opt_state = optax.tree_map_params(
        tx, placed, jax.eval_shape(tx.init, params), specs,
        transform_non_params=lambda x: placed(x, P()),
    )  # fmt: skip
    batch_axis = {"tp": None, "fsdp": "x", "dp": "x"}.get(layout, "data")
    return jax.tree.map(placed, params, specs), opt_state, placed(tokens, P(batch_axis))


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # e.g. "all-reduce"
    bytes_by_type: tuple[tuple[str, float], ...]  # Of its result (a combined one: several).
    group: int

    @property
    def element_types(self) -> tuple[str, ...]:
        return tuple(t for t, _ in self.bytes_by_type)

    @property
    def result_bytes(self) -> float:
        return sum(b for _, b in self.bytes_by_type)

    @property
    def wire_bytes(self) -> float:
        return _RING[self.kind](self.group) * self.result_bytes


def group_size(attributes: str, devices: int) -> int:
    """The size of a collective's replica groups (all devices where none are named)."""
    m = _GROUPS.search(attributes)
    if m is None:
        return devices
    text = m[1]
    if text.startswith("{{"):
        return text.count(",") + 1
    if text.startswith("["):  # Iota groups, [groups,size]<=[...].
        return int(text[1:-3].split(",")[-1])
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", text))
    axes = re.findall(r"'(\w+)'", text.split("{", 1)[1])
    return int(np.prod([int(sizes[a]) for a in axes])) if axes else devices


def collectives(hlo: str, devices: int) -> list[Collective]:
    """The collectives of an optimised HLO module (an async pair once, at its `-done`)."""
    found = []
    starts = {}
    for body in _compiled_hlo.computations(hlo).values():
        for i in body:
            if i.opcode.endswith("-start"):
                starts[i.name] = i
                continue
            kind = i.opcode.removesuffix("-done")
            if kind not in _RING:
                continue
            # A `-done`'s groups are its start's.
            source = starts.get(i.operands[0], i) if i.opcode.endswith("-done") else i
            by_type: dict[str, float] = {}
            for t, dims in _compiled_hlo.ARRAY.findall(i.type):
                size = _compiled_hlo.element_bytes(t) * math.prod(
                    int(d) for d in dims.split(",") if d
                )
                by_type[t] = by_type.get(t, 0.0) + size
            group = group_size(source.attributes, devices)
            found.append(Collective(kind, tuple(sorted(by_type.items())), group))
    return found


def summary(found: list[Collective]) -> dict[str, Any]:
    by_kind: collections.Counter[str] = collections.Counter()
    for c in found:
        by_kind[f"{c.kind} {'+'.join(c.element_types)}"] += 1
    return {
        "megabytes_per_device": sum(c.wire_bytes for c in found) / 1e6,
        "collectives": len(found),
        "all_reduces": sum(c.kind == "all-reduce" for c in found),
        "scalar_all_reduces": sum(c.kind == "all-reduce" and c.result_bytes <= 8 for c in found),
        "by_kind": dict(sorted(by_kind.items())),
    }


def compile_step(variant: str, layout: str, devices: Sequence[Any]) -> tuple[Any, int]:
    """The variant's train step compiled for `layout` over `devices`, and the
    "Involuntary full rematerialization" warnings XLA logged (on stderr, its
    C++ log: read from the file descriptor)."""
    mesh = make_mesh(layout, devices)
    args = sharded_inputs(layout, mesh)
    with tempfile.TemporaryFile() as log, _stderr_to(log), jax.set_mesh(mesh):
        with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32
            compiled = jax.jit(train_step(variant)).trace(*args).lower().compile()
        log.seek(0)
        text = log.read().decode(errors="replace")
    sys.stderr.write(text)
    return compiled, text.count("Involuntary full rematerialization")


def output_shardings(compiled: Any) -> str:
    """A digest of the step's output shardings (parameters, Adam state, loss)."""
    specs = [str(s.spec) for s in jax.tree.leaves(compiled.output_shardings)]
    return hashlib.sha256(repr(specs).encode()).hexdigest()[:16]


@contextlib.contextmanager
def _stderr_to(file: Any) -> Any:
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def verdicts(layout: str, rows: dict[str, dict[str, Any]]) -> list[tuple[str, bool | None]]:
    """The targets of one GPU and layout, each with whether it holds (None: a row missing)."""
    out: list[tuple[str, bool | None]] = []
    hand = rows.get(BY_HAND)
    for name in VARIANTS:
        if name in ("float32", BY_HAND, "m=bf16 r=f32"):
            continue
        row = rows.get(name)
        holds = None if row is None or hand is None else (
            row["megabytes_per_device"] <= hand["megabytes_per_device"] * 1.001
        )  # fmt: skip
        out.append((f"{name} sends at most the hand-written bf16 config's bytes", holds))
    for name in VARIANTS:
        row = rows.get(name)
        holds = None if row is None else row["involuntary_rematerializations"] == 0
        out.append((f"{name}: no involuntary full rematerialization", holds))
    for name in ("mixed_float8", "mixed_mxfp8"):
        row, base = rows.get(name), rows.get("mixed_bfloat16")
        holds = None if row is None or base is None else (
            row["all_reduces"] <= base["all_reduces"] + 1
        )  # fmt: skip
        out.append((f"{name}: at most one all-reduce beyond mixed_bfloat16's", holds))
        holds = None if row is None or base is None else (
            row["output_shardings"] == base["output_shardings"]
        )  # fmt: skip
        out.append((f"{name}: parameters and Adam state sharded as mixed_bfloat16's", holds))
    if layout == "fsdp":
        row = rows.get("mixed_float8")
        holds = None if row is None else any(
            k.startswith("all-gather") and "f8e4m3fn" in k for k in row["by_kind"]
        )  # fmt: skip
        out.append(("mixed_float8 all-gathers its weights in FP8", holds))
    return out


def _names_in(accepted: list[str], flag: str) -> Callable[[str], list[str]]:
    """`--flag a,b`'s parser: the names, each one of `accepted`."""
    return lambda text: gpu_compile._names(text, accepted, flag.rstrip("s"))


def main(argv: Sequence[str] | None = None) -> int:
    targets = gpu_compile.target_configs()
    parser = argparse.ArgumentParser(prog="gpu_collectives", description=__doc__.splitlines()[0])
    parser.add_argument("--devices", type=int, default=8)
    for flag, accepted in (("targets", list(targets)), ("layouts", list(LAYOUTS)),
                           ("variants", list(VARIANTS))):  # fmt: skip
        parser.add_argument(f"--{flag}", type=_names_in(accepted, flag), default=accepted)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--require-cuda-plugin", action="store_true")
    args = parser.parse_args(argv)
    jax.config.update("jax_platforms", "cpu")  # Compile for the GPUs; run nothing.
    log = gpu_compile.bench._Log()
    try:
        devices = {t: gpu_compile.cuda_devices(targets[t], args.devices) for t in args.targets}
    except RuntimeError as e:
        log(f"gpu_collectives: not run: {e}")
        return 1 if args.require_cuda_plugin else 0
    log(
        f"collectives of a sharded train step compiled for {args.devices} GPUs without one "
        f"(bytes per device per step, ring model), jax {jax.__version__}"
    )
    figures: dict[str, Any] = {"jax": jax.__version__, "devices": args.devices, "targets": {}}
    failed = 0
    for target in args.targets:
        kind = devices[target][0].device_kind
        for layout in args.layouts:
            rows: dict[str, dict[str, Any]] = {}
            for variant in args.variants:
                try:
                    compiled, remats = compile_step(variant, layout, devices[target])
                except Exception as e:  # Reported in its row's place; the others go on.
                    failed += 1
                    log(f"{variant}: did not compile: {type(e).__name__}: {str(e)[:300]}")
                    continue
                rows[variant] = summary(collectives(compiled.as_text(), args.devices))
                rows[variant]["involuntary_rematerializations"] = remats
                rows[variant]["output_shardings"] = output_shardings(compiled)
            log(f"{args.devices} x {kind} ({target}.txtpb), {layout}")
            log(f"{'variant':<16}{'MB/device':>10}{'count':>7}{'all-reduces':>13}"
                f"{'scalar':>8}  collectives (kind, element types: count)")  # fmt: skip
            for name, r in rows.items():
                kinds = ", ".join(f"{k}: {n}" for k, n in r["by_kind"].items())
                log(f"{name:<16}{r['megabytes_per_device']:>10.2f}{r['collectives']:>7}"
                    f"{r['all_reduces']:>13}{r['scalar_all_reduces']:>8}  {kinds}")  # fmt: skip
            found = verdicts(layout, rows)
            gpu_compile.log_verdicts(found, log)
            figures["targets"].setdefault(target, {"device_kind": kind, "layouts": {}})
            figures["targets"][target]["layouts"][layout] = {
                "variants": rows,
                "verdicts": {text: holds for text, holds in found},
            }
    gpu_compile.write_json(args.out, JSON_NAME, figures, log)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
