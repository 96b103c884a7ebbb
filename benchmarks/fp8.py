"""FP8 and FP4 training side by side: jmp_policy's four recipes, Qwix's three, Flax's fp8_ops.

What it measures
----------------
Eight low-precision recipes for linen models, each where installed (a missing
peer is reported and skipped):

  jmp tensor     `with_policy(model.apply, "mixed_float8")`: current scaling,
                 one power-of-two scale per operand (bfloat16 activations)
  jmp rowwise    `"mixed_float8_rowwise"`: one scale per row along the
                 non-contracting dimensions
  jmp mxfp8      `"mixed_mxfp8"`: e4m3 with a float8_e8m0fnu scale per block
                 of 32 along each product's contraction, gradients too
  jmp nvfp4      `"mixed_nvfp4"`: e2m1 with a float8_e4m3fn scale per block
                 of 16 and a float32 one per tensor; stochastically rounded
                 gradients, a Hadamard transform in the weight gradient
  qwix qt        `qwix.quantize_model(model, QtProvider([QtRule(weight_qtype=
                 e4m3, act_qtype=e4m3, bwd_qtype=e5m2)]))`: Qwix's quantized
                 training, dynamic per-channel scales (float32 activations)
  qwix mxfp8,    the same with `weight_qtype=act_qtype="mxfp8"` or "nvfp4",
  qwix nvfp4     `tile_size=32` or 16 (Qwix's block formats: float32 block
                 scales rounded to powers of two or to e4m3, no tensor scale)
                 and the output gradient e5m2 per channel (Qwix's block-format
                 backward is experimental and needs every width a tile multiple)
  flax fp8       `nn.Dense(dot_general_cls=Fp8DirectDotGeneralOp)` (and the
                 attention projections): Flax's delayed scaling, amax
                 histories of 1024 steps kept in the `_overwrite_with_gradient`
                 collection, overwritten by their "gradients" each step

against float32 (`model.apply` as written). Every variant starts from the same
float32 parameters, sees the same batches and trains with
`loss_scaled(adam, NoOpLossScale())` (the NaN step below is skipped by it).

1. Loss: the final training loss (mean of the last 10 of 200 steps, Adam
   1e-3) minus float32's, on an MLP (Dense 128, tanh, Dense 128, tanh,
   Dense 10, no biases; batch 64 x 32, labels of a fixed random teacher)
   and, unless `--quick`, on the example Transformer LM
   (`jmp_policy/app/transformer_lm.py`; Flax's FP8 ops in its Dense layers and attention
   projections, not in the attention einsums, which have no module hook).
   The output's error against float32 on the first batch, same parameters.
2. Products: the `dot_general`s of the lowered, jitted train step: forward
   (e4m3 x e4m3), backward (one e5m2 operand), others (not FP8); and the
   FP8 and FP4 types values and scales are converted to. On CPU the
   block-scaled products (`jax.nn.scaled_matmul`) are emulated by
   dequantizing to float32, so they count as "other" dots here.
3. Extra state: arrays and bytes a variant adds to the variables (the
   parameters and optimizer state aside).
4. Memory: the bytes saved for the backward pass of the loss that the
   backward pass, compiled for one device, reads (of what JAX saves, XLA
   drops what no instruction reads; for jmp_policy's recipes also with the
   operands saved instead of their quantized copies,
   `fp8_residuals("operands")`) and
   the compiled step's temporary bytes (XLA's `memory_analysis()`). On CPU
   the emulated FP8 products convert their operands to float32, so XLA's
   temporary bytes say little (and are the same whichever is saved):
   `benchmarks/gpu.sh --compile-only` gives an H100's and an H200's.
5. Robustness, on the MLP after 3 warm-up steps on ordinary
   batches (so delayed scaling has a history): the relative error (Frobenius
   norm) against float32 with the same parameters of
   * the output rows other than the one holding a single outlier of 1e4,
     1e5 or 1e6 (one element of the (64, 32) input);
   * the output for the inputs times 1e-6 and 1e-20;
   * the parameter gradients of the loss times 1e-15;
   and, from the warm state, one train step on a batch with a NaN
   ("skipped" if the parameters come back bit-identical) followed by three
   ordinary steps ("recovers" if their losses are finite), and one step on
   an all-zero batch followed by three ordinary steps. On CPU the FP8
   products are emulated (XLA:CPU converts the operands and multiplies in
   float32): the numerics are those of FP8, the speed is not measured.

Usage::

    python benchmarks/fp8.py           # MLP and Transformer LM, 200 steps (~10 minutes)
    python benchmarks/fp8.py --quick   # MLP, 10 steps (about a minute)
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import re
from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import _compiled_hlo
import jmp_policy
from jmp_policy.app import transformer_lm

OWG = "_overwrite_with_gradient"  # Flax's collection of FP8 scales and amax histories
BATCH, FEATURES, HIDDEN, CLASSES = 64, 32, 128, 10
OUTLIERS = (1e4, 1e5, 1e6)
WARMUP = 3


class Mlp(nn.Module):
    """Dense, tanh, Dense, tanh, Dense; `dense` builds the layers."""

    use_bias: bool = True
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x):
        dense = functools.partial(
            nn.Dense, use_bias=self.use_bias, dot_general_cls=self.dot_general_cls
        )
        x = nn.tanh(dense(HIDDEN)(x))
        x = nn.tanh(dense(HIDDEN)(x))
        return dense(CLASSES)(x)


@dataclasses.dataclass(frozen=True)
class Variant:
    """An FP8 recipe: `wrap(model) -> (init_model, apply)` where the model allows it."""

    name: str
    peer: str | None  # the PyPI distribution it needs, beyond jmp_policy
    wrap: Callable[[nn.Module, Callable[..., nn.Module]], tuple[nn.Module, Callable]]


def _jmp(policy):
    def wrap(model, rebuild):
        return model, jmp_policy.with_policy(model.apply, policy)

    return wrap


def _qwix(qtype: Any, tile: int | None = None) -> Callable:
    """Qwix QT in `qtype` (an FP8 dtype, per channel; or "mxfp8" / "nvfp4" with
    their tiles), the output gradient in e5m2 per channel."""

    def wrap(model, rebuild):
        import qwix

        rule = qwix.QtRule(
            module_path=".*",
            weight_qtype=qtype,
            act_qtype=qtype,
            bwd_qtype=jnp.float8_e5m2,
            **({} if tile is None else {"tile_size": tile}),
        )
        quantized = qwix.quantize_model(model, qwix.QtProvider([rule]))
        return quantized, quantized.apply

    return wrap


def _flax(model, rebuild):
    from flax.linen import fp8_ops

    fp8_model = rebuild(dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp)
    return fp8_model, fp8_model.apply


VARIANTS = [
    Variant("jmp tensor", None, _jmp("mixed_float8")),
    Variant("jmp rowwise", None, _jmp("mixed_float8_rowwise")),
    Variant("jmp mxfp8", None, _jmp("mixed_mxfp8")),
    Variant("jmp nvfp4", None, _jmp("mixed_nvfp4")),
    Variant("qwix qt", "qwix", _qwix(jnp.float8_e4m3fn)),
    Variant("qwix mxfp8", "qwix", _qwix("mxfp8", 32)),
    Variant("qwix nvfp4", "qwix", _qwix("nvfp4", 16)),
    Variant("flax fp8", "flax", _flax),
]


def available(variant: Variant) -> str | None:
    """The peer's version, "" for jmp_policy's own, None where the peer is missing."""
    if variant.peer is None:
        return ""
    try:
        version = importlib.metadata.version(variant.peer)
        __import__(variant.peer)
    except (importlib.metadata.PackageNotFoundError, ImportError):
        return None
    return version


# ------------------------------------------------------------- tasks


@dataclasses.dataclass
class Task:
    """A model, its batches and loss."""

    name: str
    rebuild: Callable[..., nn.Module]  # fields -> the model with them set
    batches: Any  # [steps, ...] of inputs (and labels)
    loss: Callable[[jax.Array, Any], jax.Array]  # (output, batch) -> loss
    inputs: Callable[[Any], jax.Array]


def mlp_task(steps: int, use_bias: bool = True, seed: int = 0) -> Task:
    rng = np.random.default_rng(seed)
    teacher = rng.standard_normal((FEATURES, CLASSES))
    x = rng.standard_normal((steps, BATCH, FEATURES)).astype(np.float32)
    labels = np.argmax(x @ teacher, axis=-1).astype(np.int32)

    def loss(logits, batch):
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[1]).mean()

    return Task(
        "MLP", functools.partial(Mlp, use_bias), (jnp.asarray(x), jnp.asarray(labels)),
        loss, lambda batch: batch[0],
    )  # fmt: skip


def lm_task(steps: int, seed: int = 0) -> Task:
    lm = transformer_lm
    batches, _, vocab = lm.make_data(steps, seed=seed)

    def loss(logits, batch):
        logits = logits.astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return Task(
        "Transformer LM", functools.partial(lm.make_model, vocab), jnp.asarray(batches), loss,
        lambda batch: batch[:, :-1],
    )  # fmt: skip


def batch_at(task: Task, i: int) -> Any:
    return jax.tree.map(lambda a: a[i], task.batches)


def num_steps(task: Task) -> int:
    return len(jax.tree.leaves(task.batches)[0])


# ------------------------------------------------------------- training


def make_step(apply: Callable, loss: Callable, tx: Any, inputs: Callable) -> Callable:
    """The README's train step; Flax's FP8 state is overwritten by its gradient."""

    @jax.jit
    def step(variables, opt_state, batch, loss_factor):
        loss_scale = jmp_policy.get_loss_scale(opt_state)

        def loss_fn(v):
            value = loss(apply(v, inputs(batch)), batch) * loss_factor
            return loss_scale.scale(value), value

        grads, value = jax.grad(loss_fn, has_aux=True)(variables)
        params = variables["params"]
        updates, opt_state = tx.update(grads["params"], opt_state, params)
        new = dict(variables, params=optax.apply_updates(params, updates))
        if OWG in grads:
            new[OWG] = grads[OWG]
        return new, opt_state, value, grads["params"]

    return step


@dataclasses.dataclass
class Run:
    """A variant on a task: its step and state."""

    apply: Callable
    step: Any  # jitted
    variables: dict
    opt_state: Any

    def restart(self, start: Run) -> Run:
        """This variant (its compiled step) from `start`'s state."""
        return dataclasses.replace(self, variables=dict(start.variables), opt_state=start.opt_state)


def start(task: Task, wrap: Callable | None, params: Any, tx: Any) -> Run:
    model = task.rebuild()
    init_model, apply = (model, model.apply) if wrap is None else wrap(model, task.rebuild)
    variables = {"params": params}  # the same start for every variant
    if init_model is not model:  # Its own variables (Flax's FP8 state) besides.
        example = task.inputs(batch_at(task, 0))
        variables = {**jax.jit(init_model.init)(jax.random.key(0), example), **variables}
    step = make_step(apply, task.loss, tx, task.inputs)
    return Run(apply, step, variables, _jit_init(tx)(params))


@functools.cache
def _jit_init(tx: Any) -> Callable:
    return jax.jit(tx.init)


def advance(run: Run, batch: Any, loss_factor: float = 1.0) -> tuple[float, Any]:
    run.variables, run.opt_state, loss, grads = run.step(
        run.variables, run.opt_state, batch, np.float32(loss_factor)
    )
    return float(loss), grads


def train(run: Run, task: Task) -> float:
    """The mean training loss of the last 10 steps."""
    losses = [advance(run, batch_at(task, i))[0] for i in range(num_steps(task))]
    return float(np.mean(losses[-10:]))


# ------------------------------------------------------------- measures

_DOT = re.compile(r"stablehlo\.dot_general.* : \((.*)\) -> (.*)$")
_ELEMENT = re.compile(r"tensor<(?:[0-9?]+x)*([a-zA-Z0-9]+)>")


_CONVERT = re.compile(r"stablehlo\.(?:bitcast_)?convert .* -> tensor<(?:[0-9?]+x)*(f[48]E\w+)>")


def _step_args(run: Run, task: Task) -> tuple:
    return (run.variables, run.opt_state, batch_at(task, 0), np.float32(1))


def fp8_products(text: str) -> tuple[int, int, int]:
    """(forward e4m3 x e4m3, backward with an e5m2 operand, others) in a lowered step."""
    counts: collections.Counter[str] = collections.Counter()
    for line in text.splitlines():
        match = _DOT.search(line)
        if match:
            operands = sorted(_ELEMENT.findall(match[1]))
            if operands == ["f8E4M3FN", "f8E4M3FN"]:
                counts["forward"] += 1
            elif operands == ["f8E4M3FN", "f8E5M2"]:
                counts["backward"] += 1
            else:
                counts["other"] += 1
    return counts["forward"], counts["backward"], counts["other"]


def quantized_to(text: str) -> str:
    """The FP8 and FP4 types values are converted to in a lowered step (scales too)."""
    return " ".join(sorted({m[1] for m in map(_CONVERT.search, text.splitlines()) if m})) or "-"


def residual_bytes(run: Run, task: Task) -> int:
    """The bytes saved for the backward pass of the loss on the first batch
    that the backward pass, compiled for one device, reads."""
    batch = batch_at(task, 0)

    def loss(variables):
        return task.loss(run.apply(variables, task.inputs(batch)), batch)

    return sum(r.size * r.dtype.itemsize for r in _compiled_hlo.residuals_read(loss, run.variables))


def temp_bytes(run: Run, task: Task) -> int:
    """The compiled train step's temporary bytes (XLA's `memory_analysis`)."""
    analysis = run.step.lower(*_step_args(run, task)).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else -1


def extra_state(run: Run) -> tuple[int, int]:
    """(arrays, bytes) of the variables beyond the parameters."""
    leaves = [x for k, v in run.variables.items() if k != "params" for x in jax.tree.leaves(v)]
    return len(leaves), sum(x.size * x.dtype.itemsize for x in leaves)


def _rel(a: Any, b: Any) -> float:
    a = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(a)])
    b = np.concatenate([np.ravel(np.asarray(x, np.float64)) for x in jax.tree.leaves(b)])
    norm = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / norm) if norm else float(np.linalg.norm(a))


def robustness(run: Run, reference: Run, task: Task) -> dict[str, str]:
    """The robustness figures of a warmed-up `run` (see the module docstring)."""
    out: dict[str, str] = {}
    forward = jax.jit(run.apply)
    ref_forward = _jit_forward(reference.apply)
    params = {"params": run.variables["params"]}
    x = task.inputs(batch_at(task, WARMUP))
    for outlier in OUTLIERS:
        spoilt = x.at[0, 5].set(outlier)
        got, want = forward(run.variables, spoilt)[1:], ref_forward(params, spoilt)[1:]
        out[f"outlier {outlier:.0e}: other rows"] = f"{_rel(got, want):.3f}"
    for factor in (1e-6, 1e-20):
        tiny = x * np.float32(factor)
        out[f"inputs x{factor:.0e}"] = (
            f"{_rel(forward(run.variables, tiny), ref_forward(params, tiny)):.3f}"
        )
    # Gradients of the loss times 1e-15: a step of each, from copies of the state.
    grads = _advance_copy(run, batch_at(task, WARMUP), 1e-15)[1]
    ref_grads = _advance_copy(reference, batch_at(task, WARMUP), 1e-15, params["params"])[1]
    out["gradients x1e-15"] = f"{_rel(grads, ref_grads):.3f}"
    out["NaN batch (loss_scaled)"] = _bad_batch(run, task, np.nan)
    out["all-zero batch"] = _bad_batch(run, task, 0.0)
    return out


@functools.cache
def _jit_forward(apply: Callable) -> Callable:
    return jax.jit(apply)


def _advance_copy(run: Run, batch: Any, loss_factor: float, params: Any = None) -> tuple:
    copy = run.restart(run)
    if params is not None:
        copy.variables["params"] = params
    return advance(copy, batch, loss_factor)


def _bad_batch(run: Run, task: Task, value: float) -> str:
    copy = run.restart(run)
    inputs, *rest = batch_at(task, WARMUP)
    bad = inputs.at[0, 0].set(value) if np.isnan(value) else jnp.zeros_like(inputs)
    before = copy.variables["params"]
    advance(copy, (bad, *rest))
    same = all(
        np.array_equal(a, b)
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(copy.variables["params"]))
    )
    state = [x for k, v in copy.variables.items() if k != "params" for x in jax.tree.leaves(v)]
    poisoned = not all(np.isfinite(np.asarray(x)).all() for x in state)
    later = [advance(copy, batch_at(task, WARMUP + 1 + i))[0] for i in range(3)]
    recovers = all(np.isfinite(later))
    first = ("skipped" if same else "applied") if np.isnan(value) else "ok"
    return f"{first}, {'recovers' if recovers else 'NaN after'}" + (
        ", NaN state" if poisoned else ""
    )


# ------------------------------------------------------------- main


def measure(quick: bool) -> tuple[list[str], dict[str, dict[str, str]], list[str]]:
    """`(columns, {row: {column: cell}}, notes)` of the table."""
    steps = 10 if quick else 200
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.NoOpLossScale())
    columns, notes, variants = [], [], []
    rows: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for v in VARIANTS:
        version = available(v)
        if version is None:
            notes.append(f"{v.name}: skipped ({v.peer} is not installed)")
            continue
        variants.append(v)
        columns.append(v.name + (f" {version}" if version else ""))
    # The MLP is bias-free, so that the output of tiny inputs is not the biases'.
    tasks = [mlp_task(max(steps, WARMUP + 4), use_bias=False)]
    tasks += [] if quick else [lm_task(steps)]
    robust: list[tuple[str, Run, Run, Task]] = []
    for task in tasks:
        example = task.inputs(batch_at(task, 0))
        params = jax.jit(task.rebuild().init)(jax.random.key(0), example)["params"]
        reference = start(task, None, params, tx)
        base = train(reference.restart(reference), task)
        rows[f"{task.name}: final loss"]["float32"] = f"{base:.4f}"
        reference_out = _jit_forward(reference.apply)({"params": params}, example)
        rows[f"{task.name}: residual bytes (read)"]["float32"] = (
            f"{residual_bytes(reference, task):,}"
        )
        rows[f"{task.name}: step temp bytes (XLA)"]["float32"] = f"{temp_bytes(reference, task):,}"
        for v, col in zip(variants, columns):
            try:
                run = start(task, v.wrap, params, tx)
                loss = train(run.restart(run), task)
            except Exception as e:  # A peer that cannot run this model: say so, go on.
                rows[f"{task.name}: loss - float32"][col] = "error"
                notes.append(f"{v.name} on {task.name}: {type(e).__name__}: {str(e)[:120]}")
                continue
            rows[f"{task.name}: loss - float32"][col] = f"{loss - base:+.4f}"
            out = jax.jit(run.apply)(run.variables | {"params": params}, example)
            rows[f"{task.name}: output error (a batch)"][col] = f"{_rel(out, reference_out):.4f}"
            text = run.step.lower(*_step_args(run, task)).as_text()
            fwd, bwd, other = fp8_products(text)
            rows[f"{task.name}: FP8 dots fwd / bwd / other"][col] = f"{fwd} / {bwd} / {other}"
            rows[f"{task.name}: quantized to"][col] = quantized_to(text)
            arrays, nbytes = extra_state(run)
            rows[f"{task.name}: extra state arrays (bytes)"][col] = f"{arrays} ({nbytes:,})"
            rows[f"{task.name}: residual bytes (read)"][col] = f"{residual_bytes(run, task):,}"
            rows[f"{task.name}: step temp bytes (XLA)"][col] = f"{temp_bytes(run, task):,}"
            if v.peer is None:  # jmp_policy's: what saving the operands would cost
                with jmp_policy.fp8_residuals("operands"):
                    saved = residual_bytes(run, task)
                rows[f"{task.name}: residual bytes, operands saved"][col] = f"{saved:,}"
            if task.name == "MLP":
                robust.append((col, run, reference, task))
    for col, run, reference, task in robust:
        warm = run.restart(run)
        for i in range(WARMUP):
            advance(warm, batch_at(task, i))
        for row, cell in robustness(warm, reference, task).items():
            rows[f"MLP: {row}"][col] = cell
    return ["float32", *columns], dict(rows), notes


def format_table(columns: list[str], rows: dict[str, dict[str, str]], notes: list[str]) -> str:
    """The table as printed: one line per row, right-aligned columns, then the notes."""
    width = max(len(r) for r in rows) + 2
    cells = [max(len(c), *(len(v.get(c, "")) for v in rows.values())) + 2 for c in columns]
    header = f"{'':<{width}}" + "".join(f"{c:>{w}}" for c, w in zip(columns, cells))
    lines = [header, "-" * len(header)]
    for row, values in rows.items():
        line = f"{row:<{width}}" + "".join(
            f"{values.get(c, ''):>{w}}" for c, w in zip(columns, cells)
        )
        lines.append(line.rstrip())
    return "\n".join(lines + [f"note: {note}" for note in notes])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the MLP only, 10 steps")
    args = parser.parse_args(argv)
    # optax.adam's bias correction needs standard promotion, as user code has.
    with jax.numpy_dtype_promotion("standard"):
        table = measure(args.quick)
    device = jax.devices()[0]
    print(
        f"FP8 and FP4 training side by side ({'--quick: ' if args.quick else ''}"
        f"jax {jax.__version__}, flax {importlib.metadata.version('flax')}, {device.platform}: "
        f"{'FP8 emulated' if device.platform == 'cpu' else device.device_kind})"
    )
    print(format_table(*table))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
