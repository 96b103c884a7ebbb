"""`jmp-policy demo`: one model, four precisions, on a real dataset.

Trains a small Flax linen MLP on scikit-learn's 8x8 digits (shipped inside
scikit-learn, no download) four times, from the same initial weights on the
same batches: float32; mixed_bfloat16; mixed_float16 with dynamic loss
scaling; mixed_float16 without loss scaling. Then prints a table and writes
a PNG of the loss curves and the loss-scale trajectory.

The loss is the mean cross-entropy times a small power of two. Adam (with
its eps scaled alike) takes the same steps whatever that factor, so float32
trains as on the plain loss, but the gradients land where Micikevicius et al.
(2018, Figure 3) found most activation gradients of real networks: near and
below float16's smallest subnormal 2^-24. Without loss scaling float16
flushes them to zero; with it, they survive.

How much the flushing hurts depends on the optimizer. Adam divides each
update by the gradient's running size, so the few values that survive
(sparse, coarsely rounded subnormals) become noisy full-size steps and the
unscaled float16 run diverges, chaotically: its final loss and accuracy
change with the seed and between machines (over seeds 0-4 on one 2-core
machine it ended between 17% and 51% test accuracy, float32 between 97% and
99%), its gap to float32 does not. Measured once (seed 0, 600 steps) with SGD
with momentum instead, the unscaled float16 run lost 95% of its gradient
values and still reached float32's accuracy: the large gradients that drive
SGD survive.

Needs the `demo` extra: `pip install 'jmp_policy[demo]'`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from jmp_policy.core import diagnostics
from jmp_policy.core.loss_scale import DynamicLossScale, LossScale, NoOpLossScale
from jmp_policy.core.loss_scaled import get_loss_scale, loss_scaled
from jmp_policy.core.policy import Policy, get_policy
from jmp_policy.integrations.linen import with_policy

DEFAULT_STEPS = 600
DEFAULT_BATCH_SIZE = 128
QUICK_STEPS = 30
QUICK_BATCH_SIZE = 64
DEFAULT_LOSS_MULTIPLIER = 2.0**-15
DEFAULT_OUTPUT = "jmp_policy_demo.png"
LEARNING_RATE = 1e-3
ADAM_EPS = 1e-8
INITIAL_LOSS_SCALE = 2.0**15
SCALE_PERIOD = 2000  # The DynamicLossScale default.
HIDDEN = (256, 256)
TEST_SIZE = 360


class MLP(nn.Module):
    """Dense-ReLU layers, then logits. `perturb` exposes activation gradients to `doctor`."""

    features: tuple[int, ...] = HIDDEN
    classes: int = 10

    @nn.compact
    def __call__(self, x):
        for i, width in enumerate(self.features):
            x = self.perturb(f"hidden_{i}", nn.Dense(width)(x))
            x = nn.relu(x)
        return self.perturb("logits", nn.Dense(self.classes)(x))


@dataclasses.dataclass(frozen=True)
class Config:
    """One of the demo's runs: a name, a policy and its loss scale."""

    name: str
    policy: Policy
    make_loss_scale: Callable[[], LossScale]


CONFIGS = (
    Config("float32", get_policy("f32"), NoOpLossScale),
    Config("mixed_bfloat16", get_policy("mixed_bfloat16"), NoOpLossScale),
    Config(
        "mixed_float16 + scaling",
        get_policy("mixed_float16"),
        lambda: DynamicLossScale(np.float32(INITIAL_LOSS_SCALE), period=SCALE_PERIOD),
    ),
    Config("mixed_float16, no scaling", get_policy("mixed_float16"), NoOpLossScale),
)


@dataclasses.dataclass
class Data:
    """The digits, pixels in [0, 1], split once with a fixed seed."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


@dataclasses.dataclass
class RunResult:
    """What one run produced."""

    name: str
    policy: Policy
    losses: np.ndarray  # per step: mean cross-entropy of the batch (unmultiplied)
    zero_grads: np.ndarray  # per step: share of the weight gradient values that are 0
    loss_scales: np.ndarray  # per step, after the update
    skipped_at: np.ndarray  # steps whose update was skipped (non-finite gradients)
    final_loss: float  # mean cross-entropy on the whole training set
    test_accuracy: float  # in [0, 1]
    step_ms: float  # median wall time of a training step
    skipped: int
    final_loss_scale: float
    params: dict


def load_data(seed: int = 0) -> Data:
    """The 1797 8x8 digits of scikit-learn: 1437 to train on, 360 to test."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    x, y = x[order], y[order]
    return Data(x[TEST_SIZE:], y[TEST_SIZE:], x[:TEST_SIZE], y[:TEST_SIZE])


@functools.lru_cache(maxsize=16)
def _jitted_init(model: MLP) -> Callable[..., Any]:
    return jax.jit(model.init)


def init_params(model: MLP, data: Data, seed: int = 0) -> dict:
    """float32 parameters (the master weights every run starts from)."""
    variables = _jitted_init(model)(jax.random.key(seed), data.x_train[:1])
    return {"params": variables["params"]}


def make_optimizer(loss_multiplier: float) -> optax.GradientTransformation:
    """Adam with eps scaled like the loss, so its steps do not depend on the multiplier."""
    return optax.adam(LEARNING_RATE, eps=ADAM_EPS * loss_multiplier)


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Per-example cross-entropy, in float32 whatever the logits' dtype."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), labels)


# Cached, so that runs with the same set-up (demo, then doctor) compile once.
@functools.lru_cache(maxsize=16)
def make_train_step(
    model: MLP, config: Config, loss_multiplier: float
) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The train step of the README, jitted: scale, differentiate, update.

    Returns:
      `(init, step)`: the jitted optimizer `init(params) -> opt_state` and
      `step(params, opt_state, x, y) -> (params, opt_state, loss, zero_share)`
      (params and opt_state are donated), where `zero_share` is the share of
      the weight-gradient values that are exactly 0.
    """
    tx = loss_scaled(make_optimizer(loss_multiplier), config.make_loss_scale())
    apply = with_policy(model.apply, config.policy)
    multiplier = np.float32(loss_multiplier)

    def train_step(params, opt_state, x, y):
        loss_scale = get_loss_scale(opt_state)

        def loss_fn(p):
            loss = cross_entropy(apply(p, x), y).mean()
            return loss_scale.scale(loss * multiplier), loss

        grads, loss = jax.grad(loss_fn, has_aux=True)(params)
        leaves = jax.tree.leaves(grads)
        zeros = sum(jnp.sum((g == 0).astype(jnp.float32)) for g in leaves)
        zero_share = zeros / np.float32(sum(g.size for g in leaves))
        # optax's Adam computes `decay ** count` (a float to an int32 power),
        # which strict dtype promotion rejects; the user's code runs standard.
        with jax.numpy_dtype_promotion("standard"):
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
        return params, opt_state, loss, zero_share

    return jax.jit(tx.init), jax.jit(train_step, donate_argnums=(0, 1))


@functools.lru_cache(maxsize=16)
def make_evaluate(model: MLP, policy: Policy) -> Callable[..., Any]:
    """Per-example loss and correctness, computed under the run's policy."""
    apply = with_policy(model.apply, policy)

    @jax.jit
    def evaluate(params, x, y):
        logits = apply(params, x)
        return cross_entropy(logits, y), jnp.argmax(logits, axis=-1) == y

    return evaluate


def batches(data: Data, steps: int, batch_size: int, seed: int) -> np.ndarray:
    """Index batches, the same for every run: each epoch a new permutation."""
    rng = np.random.default_rng(seed)
    n = len(data.x_train)
    per_epoch = n // batch_size
    if per_epoch == 0:  # a batch larger than the data: sample with replacement
        return rng.integers(0, n, size=(steps, batch_size))
    epochs = -(-steps // per_epoch)
    order = np.concatenate([rng.permutation(n)[: per_epoch * batch_size] for _ in range(epochs)])
    return order.reshape(-1, batch_size)[:steps]


def train(
    config: Config,
    data: Data,
    initial_params: dict,
    *,
    steps: int,
    batch_size: int,
    loss_multiplier: float,
    seed: int = 0,
    progress: bool = True,
    model: MLP | None = None,
) -> RunResult:
    """Trains one configuration and evaluates it."""
    from tqdm.auto import tqdm

    model = model or MLP()
    init, step = make_train_step(model, config, loss_multiplier)
    params = jax.tree.map(jnp.array, initial_params)  # a copy: the step donates it
    opt_state = init(params)

    losses, zero_grads, scales, skipped_at, times = [], [], [], [], []
    bar = tqdm(
        batches(data, steps, batch_size, seed),
        desc=f"{config.name:<26}",
        unit="step",
        file=sys.stderr,
        disable=not progress,
        mininterval=0.5,
        dynamic_ncols=True,
    )
    for i, idx in enumerate(bar):
        x, y = data.x_train[idx], data.y_train[idx]
        start = time.perf_counter()
        skipped_before = int(opt_state.total_notfinite)
        params, opt_state, loss, zeros = jax.block_until_ready(step(params, opt_state, x, y))
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
        zero_grads.append(float(zeros))
        scales.append(float(get_loss_scale(opt_state).loss_scale))
        if int(opt_state.total_notfinite) > skipped_before:
            skipped_at.append(i)
        if i % 25 == 0 or i == steps - 1:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    bar.close()

    evaluate = make_evaluate(model, config.policy)
    x_all = np.concatenate([data.x_train, data.x_test])
    y_all = np.concatenate([data.y_train, data.y_test])
    per_example, correct = map(np.asarray, evaluate(params, x_all, y_all))
    n = len(data.x_train)
    return RunResult(
        name=config.name,
        policy=config.policy,
        losses=np.asarray(losses),
        zero_grads=np.asarray(zero_grads),
        loss_scales=np.asarray(scales),
        skipped_at=np.asarray(skipped_at, dtype=np.int64),
        final_loss=float(per_example[:n].mean()),
        test_accuracy=float(correct[n:].mean()),
        # The first step compiles; the rest is what a step costs.
        step_ms=1e3 * float(np.median(times[1:] if len(times) > 1 else times)),
        skipped=int(opt_state.total_notfinite),
        final_loss_scale=float(get_loss_scale(opt_state).loss_scale),
        params=params,
    )


@functools.lru_cache(maxsize=16)
def activation_grad_fn(model: MLP, loss_multiplier: float) -> Callable[..., Any]:
    """A function of (variables, x, y) returning float32 gradients of the demo's loss.

    `variables` holds "params" and "perturbations" (see `with_perturbations`):
    the gradients are those of the weights and of the activations, what
    `diagnose` judges.
    """
    multiplier = np.float32(loss_multiplier)

    def loss_fn(variables: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        logits: Any = model.apply(variables, x)  # an array: nothing is mutable
        return cross_entropy(logits, y).mean() * multiplier

    return jax.jit(jax.grad(loss_fn))


def with_perturbations(model: MLP, params: dict, x: jax.typing.ArrayLike) -> dict:
    """`params` plus zero "perturbations", whose gradients are the activation gradients."""
    shapes = jax.eval_shape(model.init, jax.random.key(0), x)["perturbations"]
    zeros = jax.tree.map(lambda s: np.zeros(s.shape, s.dtype), shapes)
    return {"params": params["params"], "perturbations": zeros}


def format_table(results: list[RunResult]) -> str:
    """The results as an aligned text table."""
    header = (
        "run",
        "policy",
        "final loss",
        "test accuracy",
        "step time (median)",
        "skipped steps",
        "final loss scale",
    )
    rows = [
        (
            r.name,
            str(r.policy),
            f"{r.final_loss:.4f}",
            f"{100 * r.test_accuracy:.1f}%",
            f"{r.step_ms:.2f} ms",
            str(r.skipped),
            _pow2(r.final_loss_scale),
        )
        for r in results
    ]
    widths = [max(len(row[i]) for row in (header, *rows)) for i in range(len(header))]

    def line(row):
        return "  ".join(
            c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
        )

    rule = "-" * len(line(header))
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def format_multiplier(x: float) -> str:
    """2^-14 for a power of two, else the number."""
    exponent = math.log2(x)
    return f"2^{exponent:g}" if exponent == int(exponent) else f"{x:g}"


def _pow2(x: float) -> str:
    if x > 0 and math.isfinite(x) and math.log2(x) == int(math.log2(x)):
        return "1" if x == 1 else f"2^{int(math.log2(x))}"
    return f"{x:g}"


def plot_runs(results: list[RunResult], path: str | os.PathLike, *, title: str = "") -> None:
    """Writes the PNG: loss curves, loss-scale trajectories, share of zero gradients."""
    from matplotlib.figure import Figure  # Not pyplot: the caller's backend is left alone.

    fig = Figure(figsize=(16, 4.8), dpi=100)
    ax_loss, ax_scale, ax_zero = fig.subplots(1, 3)
    colors = ("tab:blue", "tab:green", "tab:orange", "tab:red")
    styles = ("-", "--", ":", "-")
    for r, color, style in zip(results, colors, styles):
        steps = np.arange(1, len(r.losses) + 1)
        ax_loss.plot(steps, r.losses, color=color, alpha=0.15, lw=0.8)
        ax_loss.plot(
            steps,
            _smooth(r.losses),
            color=color,
            ls=style,
            lw=1.8,
            label=f"{r.name}: {100 * r.test_accuracy:.1f}% test accuracy",
        )
        ax_scale.plot(steps, r.loss_scales, color=color, ls=style, lw=1.8, label=r.name)
        if len(r.skipped_at):
            ax_scale.plot(
                r.skipped_at + 1,
                r.loss_scales[r.skipped_at],
                "x",
                color=color,
                label=f"{r.name}: skipped steps ({len(r.skipped_at)})",
            )
        ax_zero.plot(
            steps, 100 * _smooth(r.zero_grads), color=color, ls=style, lw=1.8, label=r.name
        )
    ax_loss.set_yscale("log")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("training loss (batch mean cross-entropy)")
    ax_loss.set_title("Loss curves")
    ax_loss.legend(fontsize=8)
    ax_scale.set_yscale("log", base=2)
    ax_scale.set_xlabel("step")
    ax_scale.set_ylabel("loss scale")
    ax_scale.set_title("Loss scale (1 = no scaling)")
    ax_scale.legend(fontsize=8)
    ax_zero.set_xlabel("step")
    ax_zero.set_ylabel("% of weight-gradient values that are 0")
    ax_zero.set_title("Gradients lost (flushed to zero, or dead ReLUs)")
    ax_zero.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, format="png")


def _smooth(x: np.ndarray, span: int = 20) -> np.ndarray:
    out, acc, alpha = np.empty_like(x), x[0] if len(x) else 0.0, 2.0 / (span + 1)
    for i, v in enumerate(x):
        acc = alpha * v + (1 - alpha) * acc
        out[i] = acc
    return out


def _verdict(results: list[RunResult]) -> list[str]:
    """What the accuracies show, decided from the numbers, not assumed."""
    by = {r.name: r for r in results}
    f32, bf16 = by["float32"], by["mixed_bfloat16"]
    scaled, unscaled = by["mixed_float16 + scaling"], by["mixed_float16, no scaling"]
    # From the accuracies as the table prints them, so that the two agree.
    points = lambda r: round(100 * r.test_accuracy, 1) - round(100 * f32.test_accuracy, 1)  # noqa: E731
    lines = []
    close = all(abs(points(r)) <= 1.0 for r in (bf16, scaled))
    lines.append(
        (
            "As Micikevicius et al. (2018) found, mixed precision with loss scaling "
            "matches float32: "
            if close
            else "Mixed precision did NOT match float32 within 1 point here: "
        )
        + f"mixed_bfloat16 {points(bf16):+.1f} points, mixed_float16 + scaling "
        f"{points(scaled):+.1f} points of test accuracy."
    )
    zeros = f"{100 * unscaled.zero_grads.mean():.0f}%"
    zeros_f32 = f"{100 * f32.zero_grads.mean():.0f}%"
    if points(unscaled) < -1.0:
        how = (
            "its loss ends above where it started"
            if unscaled.final_loss > unscaled.losses[0]
            else "it stalls while float32 keeps learning"
        )
        lines.append(
            f"float16 without loss scaling is clearly worse: {points(unscaled):+.1f} points, "
            f"final loss {unscaled.final_loss:.3g} against {f32.final_loss:.3g}. Its gradients "
            f"fall below 2^-24 and flush to zero ({zeros} of its weight-gradient values were 0, "
            f"against {zeros_f32} in float32, from dead ReLUs). Adam divides each update by the "
            "gradient's running size, so what survives, sparse and coarsely rounded "
            f"subnormals, turns into noisy full-size steps: {how}. Those steps are chaotic: "
            "this row's figures change with --seed and from machine to machine (rounding "
            "differences grow), while the gap to float32 stays."
        )
    else:
        lines.append(
            f"float16 without loss scaling was not clearly worse here ({points(unscaled):+.1f} "
            f"points, final loss {unscaled.final_loss:.3g} against {f32.final_loss:.3g}; "
            f"{zeros} of its weight-gradient values were 0, against {zeros_f32} in float32): "
            "with these settings too few gradients underflow to hurt. A smaller "
            "--loss-multiplier pushes more of them below 2^-24."
        )
    return lines


def _gradient_finding(
    model: MLP, data: Data, float32_run: RunResult, multiplier: float, batch_size: int
) -> str:
    """Measures, in float32 on one batch, what float16 would make of the gradients."""
    grad_fn = activation_grad_fn(model, multiplier)
    x, y = data.x_train[:batch_size], data.y_train[:batch_size]
    scale = INITIAL_LOSS_SCALE

    grads = grad_fn(with_perturbations(model, float32_run.params, x), x, y)
    values = np.concatenate([np.abs(np.asarray(g)).ravel() for g in jax.tree.leaves(grads)])
    values = values[values > 0].astype(np.float64)
    total = max(values.sum(), 1e-300)

    def lost(s):  # share of the gradient, by magnitude, in values below 2^-24
        return _share(float(values[values * s < diagnostics.F16_TINIEST].sum() / total))

    acts = diagnostics.diagnose(grads["perturbations"])
    weights = diagnostics.diagnose(grads["params"])
    return (
        f"Measured in float32 on one batch, at the float32 run's final weights: median "
        f"|activation gradient| 2^{_median_log2(acts):.0f}; {_share(acts.total.f16_underflow)} "
        f"of the activation-gradient and {_share(weights.total.f16_underflow)} of the "
        "weight-gradient values are below 2^-24, float16's smallest subnormal. Without loss "
        f"scaling float16 would lose {lost(1.0)} of the gradient (by magnitude) there; "
        f"scaled by 2^{math.log2(scale):.0f}, {lost(scale)}."
    )


def _share(x: float) -> str:
    if x == 0 or x >= 0.005:
        return f"{100 * x:.0f}%"
    return f"{100 * x:.2f}%" if x >= 5e-5 else "<0.01%"


def _median_log2(report: diagnostics.GradientReport) -> float:
    counts = report.log2_counts
    if counts.sum() == 0:
        return float("nan")
    cdf = np.cumsum(counts) / counts.sum()
    return float(report.log2_edges[int(np.searchsorted(cdf, 0.5))])


def run_demo(
    *,
    steps: int = DEFAULT_STEPS,
    batch_size: int = DEFAULT_BATCH_SIZE,
    output: str | os.PathLike = DEFAULT_OUTPUT,
    loss_multiplier: float = DEFAULT_LOSS_MULTIPLIER,
    seed: int = 0,
    progress: bool = True,
    out: TextIO | None = None,
) -> list[RunResult]:
    """Runs the four configurations, prints the table and writes the PNG."""
    out = out or sys.stdout
    started = time.perf_counter()
    data = load_data(seed)
    model = MLP()
    initial = init_params(model, data, seed)
    widths = "-".join(map(str, (data.x_train.shape[1], *model.features, model.classes)))
    mult = format_multiplier(loss_multiplier)
    print(
        f"jmp-policy demo: a {widths} MLP (Flax linen) on scikit-learn's 8x8 digits "
        f"({len(data.x_train)} train / {len(data.x_test)} test images), Adam, {steps} steps "
        f"of batch {batch_size}; the same initial weights and batches in all four runs "
        f"({jax.default_backend()}).\n"
        f"The loss is mean cross-entropy x {mult}. Adam (eps scaled alike) takes the same "
        "steps whatever that factor, so float32 trains as on the plain loss; but the "
        "gradients land where Micikevicius et al. (2018, Figure 3) found most activation "
        "gradients of real networks: near and below float16's smallest subnormal, 2^-24.",
        file=out,
        flush=True,
    )
    run = functools.partial(
        train, data=data, initial_params=initial, steps=steps, batch_size=batch_size,
        loss_multiplier=loss_multiplier, seed=seed, progress=progress, model=model,
    )  # fmt: skip
    results = [run(config) for config in CONFIGS]
    print("\n" + format_table(results) + "\n", file=out)
    print("\n".join(_verdict(results)), file=out)
    print(_gradient_finding(model, data, results[0], loss_multiplier, batch_size), file=out)
    if jax.default_backend() == "cpu":
        print(
            "Step times were measured on a CPU: without Tensor Cores half precision is "
            "emulated and slower here; the speed-up of mixed precision needs a GPU or TPU.",
            file=out,
        )
    plot_runs(
        results,
        output,
        title=f"jmp-policy demo: 8x8 digits, loss x {mult}, {steps} steps of batch {batch_size}",
    )
    print(f"Wrote {output} ({time.perf_counter() - started:.0f} s in all).", file=out)
    return results
