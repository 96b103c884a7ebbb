"""How long the train step takes to trace and lower, relative to Flax's hand-written bf16 model.

What it measures
----------------
The README's train step (`loss_scaled(adam, NoOpLossScale())`, value and
gradient of the loss) of the benchmark's linen Transformer LM
(`jmp_policy/app/transformer_lm.py`) at 12 layers of width 128, batch 16 x 32 tokens,
lowered with `jax.jit(step).lower(...)` (tracing and lowering to StableHLO,
no XLA compilation), in four variants:

  flax dtype=bf16     `dtype=jnp.bfloat16` on every Flax layer by hand, plain
                      `model.apply`: the reference, 1.00
  with_policy         `with_policy(model.apply, "mixed_bfloat16")`
  with_policy m=bf16  `with_policy(model.apply, "p=f32,c=bf16,o=f32,m=bf16")`:
                      every product through the op-level rewrite
  autocast            `autocast(model.apply, "mixed_bfloat16")`

The same four for DeepMind's Griffin (recurrentgemma, where installed), a
model written elsewhere: its own `dtype=bfloat16` config is the reference,
its train step the value and gradient of the next-token loss, at `depth`
residual blocks (recurrent and attention, alternating) of width `width`; and
for Google's MaxText (where `./run` installed it, in .venv/maxtext), its
llama2 decoder of `depth` layers against its own bf16 config.

Each round lowers every variant once, a new `jax.jit` each time (no cached
trace, and jmp_policy's shared product traces forgotten: a first lowering),
in an order that rotates from round to round; the figure is the median over
the rounds of each round's ratio to the reference. Targets
with_policy <= 1.2 (every product decided by the op-level rewrite),
m=bf16 <= 1.25, autocast <= 1.4. Beside each figure, the median of the
minor page faults a lowering made (where the platform counts them): a
trace whose hot calls sit at the end of one of CPython's frame-stack
chunks maps a new chunk on every call (see `jmp_policy/engine/stack_room.py`).

Usage::

    python benchmarks/lowering.py           # 5 rounds, ~2 minutes on 2 CPU cores
    python benchmarks/lowering.py --quick   # 2 rounds
    python benchmarks/lowering.py --depth 2 --rounds 1
    python benchmarks/lowering.py --models transformer griffin
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import optax

import jmp_policy
from jmp_policy.app import transformer_lm
from jmp_policy.engine.interpreter import clear_shared_traces
from transformer import train_step

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = "flax dtype=bf16"
TARGETS = {"with_policy": 1.2, "with_policy m=bf16": 1.25, "autocast": 1.4}
# Every product through the op-level rewrite (results in the reduce dtype, bf16).
M_BF16 = "p=f32,c=bf16,o=f32,m=bf16"


def variants(vocab_size: int, depth: int, width: int) -> dict[str, Callable]:
    """`{name: apply}` of the four variants."""
    model = transformer_lm.make_model(vocab_size, depth=depth, width=width)
    hand = transformer_lm.make_model(vocab_size, depth=depth, width=width, dtype=jnp.bfloat16)
    return {
        REFERENCE: hand.apply,
        "with_policy": jmp_policy.with_policy(model.apply, "mixed_bfloat16"),
        "with_policy m=bf16": jmp_policy.with_policy(model.apply, M_BF16),
        "autocast": jmp_policy.autocast(model.apply, "mixed_bfloat16"),
    }


def lowering_cost(step: Callable, *args: Any) -> tuple[float, int]:
    """Seconds and minor page faults to trace and lower a fresh `jax.jit(step)`
    on `args`, as a first lowering."""
    fresh = lambda *a: step(*a)  # noqa: E731  (a new function: no cached trace)
    # Products are traced once per signature and shared, also between train
    # steps: forgotten here, so that each figure is a first lowering.
    clear_shared_traces()
    gc.collect()  # The last lowering's garbage is not charged to this one.
    faults = minor_page_faults()
    start = time.perf_counter()
    jax.jit(fresh).lower(*args)
    return time.perf_counter() - start, minor_page_faults() - faults


def minor_page_faults() -> int:
    """This process's minor page faults so far; 0 where the platform does not count them."""
    try:
        import resource
    except ImportError:  # Windows
        return 0
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


POLICIES = ("mixed_bfloat16", M_BF16)


def init_as_users_do(init: Callable, *args: Any) -> None:
    """`with_policy(model.init, policy)` (abstractly), as the README's train step
    starts: it tells `with_policy` the dtypes the model makes its parameters in."""
    for policy in POLICIES:
        jax.eval_shape(jmp_policy.with_policy(init, policy), jax.random.key(0), *args)


def transformer_steps(depth: int, width: int) -> tuple[dict[str, Callable], tuple]:
    """The benchmark Transformer's train step per variant, and its arguments (shapes)."""
    _, _, vocab_size = transformer_lm.make_data(1)
    batch = jax.ShapeDtypeStruct((transformer_lm.BATCH, transformer_lm.SEQ_LEN + 1), jnp.int32)
    model = transformer_lm.make_model(vocab_size, depth=depth, width=width)
    tokens = jnp.zeros(batch.shape, jnp.int32)[:, :-1]
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    init_as_users_do(model.init, tokens)
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.NoOpLossScale())
    opt_state = jax.eval_shape(tx.init, params)
    steps = {
        name: train_step(transformer_lm, apply, tx)
        for name, apply in variants(vocab_size, depth, width).items()
    }
    return steps, (params, opt_state, batch)


def next_token_steps(applies: dict[str, Callable], logits: Callable, tx: Any) -> dict:
    """`{name: train step}`: Adam on the next-token loss of `logits(apply, params, tokens)`."""

    def step_of(apply: Callable) -> Callable:
        def step(params: Any, opt_state: Any, tokens: jax.Array) -> Any:
            def loss(p: Any) -> jax.Array:
                return optax.softmax_cross_entropy_with_integer_labels(
                    logits(apply, p, tokens[:, :-1]).astype(jnp.float32), tokens[:, 1:]
                ).mean()

            value, grads = jax.value_and_grad(loss)(params)
            updates, opt_state = tx.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, value

        return step

    return {name: step_of(apply) for name, apply in applies.items()}


def griffin_steps(depth: int, width: int) -> tuple[dict[str, Callable], tuple] | None:
    """Griffin's train step per variant and its arguments; None without recurrentgemma."""
    try:
        from recurrentgemma import jax as griffin  # type: ignore[import-untyped]
    except ImportError:
        return None
    kinds = (griffin.TemporalBlockType.RECURRENT, griffin.TemporalBlockType.ATTENTION)
    config = griffin.GriffinConfig(
        vocab_size=256,
        width=width,
        mlp_expanded_width=2 * width,
        num_heads=2,
        block_types=tuple(kinds[i % 2] for i in range(depth)),
        embeddings_scale_by_sqrt_dim=True,
        attention_window_size=16,
        logits_soft_cap=30.0,
        scan_type=griffin.ScanType.LINEAR_NATIVE,
    )
    model = griffin.Griffin(config)
    applies = {
        REFERENCE: griffin.Griffin(config, dtype=jnp.bfloat16).apply,
        "with_policy": jmp_policy.with_policy(model.apply, "mixed_bfloat16"),
        "with_policy m=bf16": jmp_policy.with_policy(model.apply, M_BF16),
        "autocast": jmp_policy.autocast(model.apply, "mixed_bfloat16"),
    }
    tokens = jnp.zeros((8, 33), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (8, 32))
    params = jax.eval_shape(model.init, jax.random.key(0), tokens[:, :-1], pos)["params"]
    init_as_users_do(model.init, tokens[:, :-1], pos)
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.NoOpLossScale())

    def logits(apply: Callable, params: Any, tokens: jax.Array) -> jax.Array:
        return apply({"params": params}, tokens, pos, return_cache=False)[0]

    steps = next_token_steps(applies, logits, tx)
    return steps, (params, jax.eval_shape(tx.init, params), tokens)


def maxtext_steps(depth: int, width: int) -> tuple[dict[str, Callable], tuple] | None:
    """MaxText's train step per variant and its arguments; None without MaxText.

    Its linen `TransformerLinen` (a llama2 decoder, MaxText's NNX model behind
    its own `ToLinen`), made by its own `pyconfig` and `from_config`; its own
    `dtype=bfloat16, weight_dtype=float32` config is the reference. Lowered
    under its mesh and logical axis rules (`maxtext_context`).
    """
    installed = ROOT / ".venv" / "maxtext"
    if installed.is_dir() and str(installed) not in sys.path:
        sys.path.insert(0, str(installed))  # `./run` installs it apart.
    os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # No Google Cloud clients.
    try:
        from maxtext import configs
        from maxtext.configs import pyconfig
        from maxtext.utils import maxtext_utils, model_creation_utils
    except ImportError:
        return None
    xla_flags = os.environ.get("XLA_FLAGS")

    def config(dtype: str) -> Any:
        return pyconfig.initialize(
            ["lowering", os.path.join(os.path.dirname(configs.__file__), "base.yml")],
            hardware="cpu", skip_jax_distributed_system=True, enable_checkpointing=False,
            jax_cache_dir="", run_name="lowering", dataset_type="synthetic",
            base_output_directory=os.path.join(tempfile.gettempdir(), "maxtext_lowering"),
            attention="dot_product", decoder_block="llama2", base_emb_dim=width,
            base_num_query_heads=2, base_num_kv_heads=2, base_mlp_dim=2 * width,
            base_num_decoder_layers=depth, head_dim=width // 2, vocab_size=256,
            max_target_length=32, max_prefill_predict_length=16, per_device_batch_size=8,
            scan_layers=False, dtype=dtype, weight_dtype="float32",
        )  # fmt: skip

    configs_ = {dtype: config(dtype) for dtype in ("float32", "bfloat16")}
    # pyconfig sets XLA_FLAGS to dump HLO: the lowerings need not.
    if xla_flags is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = xla_flags
    mesh = maxtext_utils.get_mesh_from_config(configs_["float32"])
    MAXTEXT_CONTEXT[:] = [mesh, configs_["float32"].logical_axis_rules]
    model, hand = (model_creation_utils.from_config(configs_[d], mesh=mesh) for d in configs_)
    applies = {
        REFERENCE: hand.apply,
        "with_policy": jmp_policy.with_policy(model.apply, "mixed_bfloat16"),
        "with_policy m=bf16": jmp_policy.with_policy(model.apply, M_BF16),
        "autocast": jmp_policy.autocast(model.apply, "mixed_bfloat16"),
    }
    tokens = jnp.zeros((8, 33), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(32, dtype=jnp.int32), (8, 32))
    segments = jnp.ones((8, 32), jnp.int32)
    call = {"enable_dropout": False, "model_mode": "train"}
    init = functools.partial(model.init, **call)
    with maxtext_context():
        params = jax.eval_shape(init, jax.random.key(0), tokens[:, :-1], pos, segments)["params"]
        init_as_users_do(init, tokens[:, :-1], pos, segments)
    tx = jmp_policy.loss_scaled(optax.adam(1e-3), jmp_policy.NoOpLossScale())

    def logits(apply: Callable, params: Any, tokens: jax.Array) -> jax.Array:
        return apply(params, tokens, pos, segments, **call)

    steps = next_token_steps(applies, logits, tx)
    return steps, (params, jax.eval_shape(tx.init, params), tokens)


# MaxText's mesh and logical axis rules, once made: its model is lowered under them.
MAXTEXT_CONTEXT: list[Any] = []


@contextlib.contextmanager
def maxtext_context() -> Iterator[None]:
    if not MAXTEXT_CONTEXT:
        yield
        return
    import flax

    mesh, rules = MAXTEXT_CONTEXT
    with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(rules):
        yield


def measure(
    rounds: int, steps: dict[str, Callable], args: tuple
) -> tuple[list[float], dict[str, list[float]], dict[str, list[int]]]:
    """The reference's seconds, per variant its ratio to them in each round
    (interleaved, in a rotating order), and per variant (the reference
    too) its page faults in each round."""
    names = list(steps)
    for name in names:  # Warm-up: imports and JAX's own first-use caches.
        lowering_cost(steps[name], *args)
    ratios: dict[str, list[float]] = {name: [] for name in names if name != REFERENCE}
    faults: dict[str, list[int]] = {name: [] for name in names}
    reference_s = []
    for r in range(rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        costs = {name: lowering_cost(steps[name], *args) for name in order}
        for name in ratios:
            ratios[name].append(costs[name][0] / costs[REFERENCE][0])
        for name in faults:
            faults[name].append(costs[name][1])
        reference_s.append(costs[REFERENCE][0])
    return reference_s, ratios, faults


MODELS = {
    "transformer": ("Transformer", transformer_steps),
    "griffin": ("Griffin (recurrentgemma)", griffin_steps),
    "maxtext": ("MaxText (llama2)", maxtext_steps),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="2 rounds")
    parser.add_argument("--depth", type=int, default=12)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument(
        "--models",
        nargs="+",
        choices=MODELS,
        default=list(MODELS),
        help="the models to measure (MaxText puts its own packages, .venv/maxtext, "
        "first on this process's path)",
    )
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    for key in args.models:
        model, make = MODELS[key]
        with jax.numpy_dtype_promotion("standard"):  # Griffin and MaxText are written for it.
            made = make(args.depth, args.width)
            if made is None:
                print(f"\n{model}: not installed, not measured")
                continue
            with maxtext_context():
                seconds, ratios, faults = measure(rounds, *made)
            MAXTEXT_CONTEXT.clear()
        reference_s = statistics.median(seconds)
        page_faults = {name: round(statistics.median(values)) for name, values in faults.items()}
        print(
            f"\n{model} train step lowering, {args.depth} layers x width {args.width}, median "
            f"of {rounds} interleaved rounds; {REFERENCE}: {reference_s:.2f} s = 1.00, "
            f"{page_faults[REFERENCE]} page faults"
        )
        print(f"{'variant':<22}{'ratio':>8}{'target':>8}{'page faults':>13}")
        for name, values in ratios.items():
            median = statistics.median(values)
            print(f"{name:<22}{median:>8.2f}{TARGETS[name]:>8.2f}{page_faults[name]:>13}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
