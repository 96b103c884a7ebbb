"""EasyDeL (PyPI `easydel` 0.3.0, Flax NNX): tiny float32 Llama, Mixtral and
DeepSeek-V3 causal LMs under `jmp_policy.nnx.PolicyModule` and `autocast`,
against EasyDeL's own half config.

`python easydel_check.py` prints one JSON object: per model, the max abs error
of the logits against the float32 model (the same weights) for

- `hand`: EasyDeL's own half config, `dtype=bfloat16, param_dtype=float32`
  and its attention in bfloat16 (`attn_dtype`, the default);
- `policy_module[SPEC]`: `jmp_policy.nnx.PolicyModule(model, SPEC)` of the
  float32 model; `policy_module_config[SPEC]` told `config_dtype=jnp.float32`
  (the config's `dtype` and `attn_dtype` it casts to);
- `autocast[SPEC]`: `jmp_policy.autocast` of a functional call of the
  float32 model (its graphdef and state, merged inside);

at `pos8000` (positions 8000..8031, given as `position_ids`) and `pos0`
(positions 0..31); and `train[FRONT_END][SPEC]`: one Adam step the way
EasyDeL's trainer takes it (`jax.value_and_grad` of a loss that merges the
graphdef with the parameters and the rest, `stop_gradient`ed, and calls the
model), through the `PolicyModule` or `autocast`, with
`jmp_policy.loss_scaled` and a `DynamicLossScale(2**15)`: whether it ran, and
whether the loss, the gradients and the update are finite. A front end that
raises gets `{"error": ...}` in place of its numbers.

The float32 reference runs EasyDeL's float32 config with `attn_dtype`
float32 (EasyDeL's default is bfloat16 whatever the model's `dtype`).
Models are called through `nnx.split` / `nnx.merge` under plain `jax.jit`:
under `nnx.jit` a second call leaks a tracer from a cached frequency table.
Dropout layers and their `Rngs` are kept (rate 0). ejkernel's kernels take
their heuristic configs (no autotuning) and no cache is written outside a
temporary directory.

Run by tests/test_easydel.py in a process of its own, with EasyDeL and what
it imports first on the path (`./run` installs them apart, in .venv/easydel;
their pins clash with this project's).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
import types
import warnings

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One device (the test suite sets up eight).
os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
)
# EasyDeL's import would add GPU and TPU flags to XLA_FLAGS (the CPU client
# rejects them) and set other process-wide defaults.
os.environ["EASYDEL_AUTO"] = "0"
# ejkernel autotunes its kernels on a cache miss and keeps the results, and
# JAX's compilation cache, under $HOME (Hugging Face its hub's): heuristics,
# and a temporary directory.
_CACHE = tempfile.mkdtemp(prefix="easydel_check-")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)
os.environ["EJKERNEL_AUTOTUNE_POLICY"] = "heuristics"
os.environ["EJKERNEL_PERSISTENT_CACHE_DIR"] = os.path.join(_CACHE, "ejkernel")
os.environ["COMPILE_FUNC_DIR"] = os.path.join(_CACHE, "compiled")
os.environ["HF_HOME"] = os.path.join(_CACHE, "huggingface")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")
warnings.filterwarnings("ignore", category=DeprecationWarning)  # `with mesh:`


def _stub_torch_only_modules() -> None:
    """Without PyTorch, transformers' modeling modules are placeholders that
    raise ImportError on any attribute; EasyDeL's configs patch six of them
    (`getattr(module, name, None)`) at import. Empty modules in their place."""
    for name in ("dbrx", "llama4", "qwen3_next", "qwen3_5_moe", "phimoe", "glm4v_moe"):
        qualified = f"transformers.models.{name}.modeling_{name}"
        stub = sys.modules[qualified] = types.ModuleType(qualified)
        setattr(importlib.import_module(f"transformers.models.{name}"), f"modeling_{name}", stub)


_stub_torch_only_modules()

import easydel as ed  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import jmp_policy as jmp  # noqa: E402
import jmp_policy.nnx  # noqa: E402

from corpus import checks  # noqa: E402

# ejkernel's `ejit` points JAX's compilation cache at its own directory.
jax.config.update("jax_enable_compilation_cache", False)

POLICIES = ("mixed_bfloat16", "mixed_bfloat16,m=bf16", "mixed_float8")
MODELS = ("llama", "mixtral", "deepseek_v3")
B, T, VOCAB = 2, 32, 256
STARTS = {"pos8000": 8000, "pos0": 0}
FRONT_ENDS = ("policy_module", "policy_module_config", "autocast")
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=8192,
    attn_mechanism="vanilla",
)
TOKENS = jax.random.randint(jax.random.key(1), (B, T + 1), 0, VOCAB)
IDS, LABELS = TOKENS[:, :-1], TOKENS[:, 1:]


def build(name: str, half: bool) -> tuple[ed.EasyDeLBaseConfig, nnx.Module]:
    """The model, float32 (attention too) or EasyDeL's half config."""
    attn = jnp.bfloat16 if half else jnp.float32
    dtypes = dict(attn_dtype=attn, kvdtype=attn)
    if name == "llama":
        config, cls = ed.LlamaConfig(**COMMON, **dtypes), ed.LlamaForCausalLM
    elif name == "mixtral":
        config = ed.MixtralConfig(
            **COMMON, **dtypes, num_local_experts=4, num_experts_per_tok=2, sliding_window=None
        )
        cls = ed.MixtralForCausalLM
    else:
        config = ed.DeepseekV3Config(
            **COMMON,
            **dtypes,
            mla_attn_dtype=attn,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,  # layer 0 dense, layer 1 MoE
            q_lora_rank=32,
            kv_lora_rank=32,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
        )
        cls = ed.DeepseekV3ForCausalLM
    dtype = jnp.bfloat16 if half else jnp.float32
    model = cls(config=config, dtype=dtype, param_dtype=jnp.float32, rngs=nnx.Rngs(0))
    return config, model


def positions(start: int) -> jax.Array:
    return jnp.broadcast_to(jnp.arange(start, start + T, dtype=jnp.int32), (B, T))


def logits_fn(graphdef):
    """`(state, ids, position_ids) -> logits` of the module `graphdef` describes."""

    def logits(state, ids, position_ids):
        return nnx.merge(graphdef, state)(input_ids=ids, position_ids=position_ids).logits

    return logits


def short(error: Exception) -> str:
    """The error's type and the first line of its message."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def errors(forward, state, refs: dict) -> dict:
    """The front end's max abs error at each set of positions (one trace)."""
    out = {}
    for key, start in STARTS.items():
        got = forward(state, IDS, positions(start))
        out[key] = checks.max_error(got, refs[key])
        out["output_dtype"] = str(got.dtype)
    return out


def front_end(model: nnx.Module, kind: str, policy: str | None):
    """`(module, call)`: the module to split and `call(module, ids, position_ids) -> logits`."""
    plain = lambda m, i, p: m(input_ids=i, position_ids=p).logits  # noqa: E731
    if policy is None:
        return model, plain
    if kind == "policy_module":
        return jmp_policy.nnx.PolicyModule(model, policy), plain
    if kind == "policy_module_config":  # Told that float32 is its config's dtype.
        return jmp_policy.nnx.PolicyModule(model, policy, config_dtype=jnp.float32), plain
    return model, jmp.autocast(plain, policy)


def forward(model: nnx.Module, kind: str, policy: str | None):
    module, call = front_end(model, kind, policy)
    graphdef, state = nnx.split(module)

    @checks.jit
    def run(state, ids, position_ids):
        return call(nnx.merge(graphdef, state), ids, position_ids)

    return run, state


def train_step(model: nnx.Module, kind: str, policy: str) -> dict:
    """One Adam step as EasyDeL's trainer takes it (`state.merge(tree)` inside
    `jax.value_and_grad`), under `loss_scaled` and a dynamic loss scale."""
    module, call = front_end(model, kind, policy)
    graphdef, params, other = nnx.split(module, nnx.Param, ...)
    tx = jmp.loss_scaled(optax.adam(1e-3), jmp.DynamicLossScale(2.0**15))
    opt_state = tx.init(params)
    position_ids = positions(STARTS["pos8000"])

    @checks.jit
    def step(params, other, opt_state):
        scale = jmp.get_loss_scale(opt_state)

        def loss_fn(tree):
            rest = jax.tree.map(jax.lax.stop_gradient, other)
            logits = call(nnx.merge(graphdef, tree, rest), IDS, position_ids)
            loss = optax.softmax_cross_entropy_with_integer_labels(
                logits.astype(jnp.float32), LABELS
            ).mean()
            return scale.scale(loss), loss

        (_, loss), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return loss, scale.unscale(grads), updates, opt_state

    loss, grads, updates, opt_state = step(params, other, opt_state)
    return {
        "ran": True,
        **checks.step_figures(loss, grads, updates, opt_state),
    }


def check_model(name: str) -> dict:
    begin = time.perf_counter()
    config, model = build(name, half=False)
    _, hand = build(name, half=True)
    nnx.update(hand, nnx.state(model, nnx.Param))
    results: dict = {}
    with config.mesh:  # EasyDeL's sharding constraints read the mesh in context.
        ref_forward, ref_state = forward(model, "float32", None)
        refs = {k: ref_forward(ref_state, IDS, positions(s)) for k, s in STARTS.items()}
        results["reference_scale"] = {k: float(jnp.max(jnp.abs(r))) for k, r in refs.items()}
        hand_graphdef, hand_state = nnx.split(hand)
        results["hand"] = errors(checks.jit(logits_fn(hand_graphdef)), hand_state, refs)
        for kind in FRONT_ENDS:
            for policy in POLICIES:
                try:
                    results[f"{kind}[{policy}]"] = errors(*forward(model, kind, policy), refs)
                except Exception as error:  # Reported (the test fails), and the next one runs.
                    results[f"{kind}[{policy}]"] = {"error": short(error)}
                    print(f"{name} {kind}[{policy}]:", file=sys.stderr)
                    traceback.print_exc(limit=-8, file=sys.stderr)
        for kind in FRONT_ENDS:
            for policy in POLICIES:
                try:
                    results[f"train[{kind}][{policy}]"] = train_step(model, kind, policy)
                except Exception as error:
                    results[f"train[{kind}][{policy}]"] = {"ran": False, "error": short(error)}
                    print(f"{name} train[{kind}][{policy}]:", file=sys.stderr)
                    traceback.print_exc(limit=-8, file=sys.stderr)
    results["seconds"] = round(time.perf_counter() - begin, 1)
    return results


def main() -> int:
    begin = time.perf_counter()
    results = {name: check_model(name) for name in (sys.argv[1:] or MODELS)}
    results["seconds"] = round(time.perf_counter() - begin, 1)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
