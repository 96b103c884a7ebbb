"""Google's MaxText (PyPI `maxtext`), a tiny llama2 decoder built by its own
`pyconfig` and `model_creation_utils.from_config`, under the corpus policies
against its own bf16 config, by `corpus/checks.py`'s measures.

`python maxtext_check.py FRONT_END`: `nnx` (its NNX `Transformer` in a
`jmp_policy.nnx.PolicyModule`), `nnx-config` (the same, told that its casts
to float32 are its config's `dtype`: `config_dtype=jnp.float32`), `linen`
(its `TransformerLinen`, NNX wrapped for linen by its own `ToLinen`, through
`with_policy`), `nnx-autocast` or
`linen-autocast` (the same models through `autocast`). Run by
tests/test_maxtext.py in a process of its own, with MaxText and what it
imports first on the path, as `./run` installs them apart (`.venv/maxtext`):
their pins clash with this project's. MaxText's own half config is
`dtype=bfloat16, weight_dtype=float32` (float32 weights, bf16 compute and KV
cache); the policies run its float32 config. Exits non-zero with the failed
check.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One device: MaxText's batch is per device (the test suite sets up eight).
os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
)
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # No Google Cloud clients.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from maxtext import configs  # noqa: E402
from maxtext.configs import pyconfig  # noqa: E402
from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils  # noqa: E402

import jmp_policy as jmp  # noqa: E402
import jmp_policy.nnx  # noqa: E402

from corpus import checks  # noqa: E402
from helpers import contractions  # noqa: E402

POLICIES = (
    "mixed_bfloat16",
    "mixed_float16",
    "p=f32,c=bf16,o=f32,m=bf16",
    "mixed_float8",
    "mixed_mxfp8",
)
FRONT_ENDS = ("nnx", "nnx-config", "linen", "nnx-autocast", "linen-autocast")
B, T, PROMPT = 2, 16, 8
VOCAB = 64
TOKENS = jax.random.randint(jax.random.key(1), (B, T), 1, VOCAB)
POSITIONS = jnp.broadcast_to(jnp.arange(T), (B, T))
SEGMENTS = jnp.ones((B, T), jnp.int32)


def config(dtype: str) -> pyconfig.HyperParameters:
    xla_flags = os.environ.get("XLA_FLAGS")
    c = pyconfig.initialize(
        ["maxtext_check", os.path.join(os.path.dirname(configs.__file__), "base.yml")],
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        jax_cache_dir="",
        run_name="maxtext_check",
        base_output_directory=os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxtext_check"),
        dataset_type="synthetic",
        attention="dot_product",
        decoder_block="llama2",
        base_emb_dim=32,
        base_num_query_heads=2,
        base_num_kv_heads=2,
        base_mlp_dim=64,
        base_num_decoder_layers=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_target_length=T,
        max_prefill_predict_length=PROMPT,
        per_device_batch_size=B,
        scan_layers=False,
        dtype=dtype,
        weight_dtype="float32",
    )
    # pyconfig sets XLA_FLAGS to dump HLO; later compiles need not.
    if xla_flags is None:
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = xla_flags
    return c


CONFIGS = {dtype: config(dtype) for dtype in ("float32", "bfloat16", "float16")}
MESH = maxtext_utils.get_mesh_from_config(CONFIGS["float32"])


def nnx_model(dtype: str, mode: str = "train") -> nnx.Module:
    c = CONFIGS[dtype]
    rngs = maxtext_utils_nnx.create_nnx_rngs(c, model_mode=mode)
    return model_creation_utils.from_config(c, mesh=MESH, rngs=rngs, model_mode=mode)


def linen_model(dtype: str, mode: str = "train") -> flax.linen.Module:
    return model_creation_utils.from_config(CONFIGS[dtype], mesh=MESH, model_mode=mode)


def call_args(lo: int, hi: int, mode: str) -> tuple[tuple, dict]:
    """MaxText's call for tokens `lo:hi`: one-token decode steps take no segments."""
    segments = None if mode == "autoregressive" else SEGMENTS[:, lo:hi]
    args = (TOKENS[:, lo:hi], POSITIONS[:, lo:hi], segments)
    return args, {"enable_dropout": False, "model_mode": mode}


# ---------------------------------------------------------------------------
# Each front end: `(forward(params, tokens), params)` of a model under a
# policy (None: as built), and `decode(params, policy, dtype)`: a prefill of
# the prompt, then a token a step, into a KV cache in `dtype`.


class NNX:
    def __init__(self, autocast: bool, config_dtype: np.dtype | None = None) -> None:
        self.autocast = autocast
        self.config_dtype = config_dtype
        self.model = nnx_model("float32")
        self.params = nnx.state(self.model, nnx.Param)

    def own(self, dtype: str):
        model = nnx_model(dtype)
        nnx.update(model, self.params)
        return self._forward(model, None), self.params

    def mixed(self, policy: str):
        if self.autocast:
            return self._forward(self.model, policy), self.params
        mixed = jmp_policy.nnx.PolicyModule(self.model, policy, config_dtype=self.config_dtype)
        return self._forward(mixed, None), nnx.state(mixed, nnx.Param)

    def _forward(self, model: nnx.Module, policy: str | None):
        graph, _, rest = nnx.split(model, nnx.Param, ...)
        call = self._caller(policy)

        def forward(params, tokens):
            args, kwargs = call_args(0, tokens.shape[1], "train")
            # New variables for the rest, in this trace: MaxText's layers update
            # their PRNG counters as they run.
            model = nnx.merge(graph, params, jax.tree.map(lambda x: x, rest))
            return call(model, tokens, *args[1:], **kwargs)

        return forward

    def _caller(self, policy: str | None):
        def call(model, *args, **kwargs):
            return model(*args, **kwargs)

        return call if policy is None else jmp.autocast(call, policy)

    def decode(self, policy: str | None, dtype: np.dtype):
        model = nnx_model("float32" if policy else np.dtype(dtype).name, "autoregressive")
        nnx.update(model, self.params)
        nnx.update(model, checks.cast_floats(nnx.state(model, nnx.Cache), dtype))
        if policy is not None and not self.autocast:
            mixed = jmp_policy.nnx.PolicyModule(model, policy, config_dtype=self.config_dtype)
            model, policy = mixed, None
        step = nnx.jit(self._caller(policy), static_argnames=("enable_dropout", "model_mode"))
        steps = [step(model, *call_args(0, PROMPT, "prefill")[0], **call_args(0, 0, "prefill")[1])]
        for i in range(PROMPT, T):
            args, kwargs = call_args(i, i + 1, "autoregressive")
            steps.append(step(model, *args, **kwargs))
        cache = nnx.state(model, nnx.Cache)
        assert float_dtypes(cache) == {np.dtype(dtype)}, float_dtypes(cache)
        return jnp.concatenate(steps, 1)


class Linen:
    def __init__(self, autocast: bool) -> None:
        self.autocast = autocast
        args, kwargs = call_args(0, T, "train")
        self.params = linen_model("float32").init(jax.random.key(0), *args, **kwargs)

    def own(self, dtype: str):
        return self._forward(linen_model(dtype).apply, None), self.params

    def mixed(self, policy: str):
        return self._forward(linen_model("float32").apply, policy), self.params

    def _wrap(self, apply, policy: str | None):
        if policy is None:
            return apply
        return jmp.autocast(apply, policy) if self.autocast else jmp.with_policy(apply, policy)

    def _forward(self, apply, policy: str | None):
        apply = self._wrap(apply, policy)

        def forward(params, tokens):
            args, kwargs = call_args(0, tokens.shape[1], "train")
            return apply(params, tokens, *args[1:], **kwargs)

        return forward

    def decode(self, policy: str | None, dtype: np.dtype):
        model = linen_model("float32" if policy else np.dtype(dtype).name, "autoregressive")
        args, kwargs = call_args(0, PROMPT, "prefill")
        cache = model.init(jax.random.key(0), *args, **kwargs)["cache"]
        cache = checks.cast_floats(cache, dtype)
        apply = self._wrap(model.apply, policy)

        def step(cache, args, mode):
            variables = {**self.params, "cache": cache}
            out, updated = apply(
                variables, *args, enable_dropout=False, model_mode=mode, mutable=["cache"]
            )
            return out, updated["cache"]

        step = checks.jit(step, static_argnums=2)
        out, cache = step(cache, call_args(0, PROMPT, "prefill")[0], "prefill")
        steps = [out]
        for i in range(PROMPT, T):
            out, cache = step(cache, call_args(i, i + 1, "autoregressive")[0], "autoregressive")
            steps.append(out)
        assert float_dtypes(cache) == {np.dtype(dtype)}, float_dtypes(cache)
        return jnp.concatenate(steps, 1)


def float_dtypes(tree) -> set[np.dtype]:
    return {x.dtype for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)}


def loss(forward, params):
    labels = jnp.roll(TOKENS, -1, axis=1)
    logits = forward(params, TOKENS).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def main(front_end: str) -> int:
    autocast = front_end.endswith("autocast")
    if front_end == "nnx-config":
        model = NNX(autocast, config_dtype=np.dtype(np.float32))
    else:
        model = (NNX if front_end.startswith("nnx") else Linen)(autocast)
    ref_forward, params = model.own("float32")
    ref = checks.jit(ref_forward)(params, TOKENS)
    own_errors, own_texts = {}, {}
    for dtype in (checks.BF16, checks.F16):
        forward, params = model.own(dtype.name)
        own = checks.jit(forward)
        own_errors[dtype] = checks.relative_error(own(params, TOKENS), ref)
        own_texts[dtype] = own.lower(params, TOKENS).as_text()
    print("own config's error:", {str(k): round(v, 5) for k, v in own_errors.items()})
    for policy in POLICIES:
        dtype = checks.compute_dtype(policy)
        forward, params = model.mixed(policy)
        out = checks.jit(forward)(params, TOKENS)
        error = checks.relative_error(out, ref)
        print(f"{policy}: error {error:.5f} (bound {checks.error_bound(policy, own_errors):.5f})")
        assert out.dtype == jnp.float32, out.dtype
        assert error <= checks.error_bound(policy, own_errors), policy
        text = checks.jit(forward).lower(params, TOKENS).as_text()
        checks.assert_products(policy, text, own_texts[dtype])
        # For tests/test_maxtext.py's conformance across the front ends.
        operands = sorted(list(op.operand_types) for op in contractions(text))
        print(f"products {policy}: {json.dumps(operands)}")
        checks.assert_trains(*checks.train(lambda p, f=forward: loss(f, p), params, policy))
        cached = model.decode(policy, dtype)
        checks.assert_decodes_as_uncached(policy, cached, out, own_errors)
    print(f"maxtext {front_end}: every check holds under", ", ".join(POLICIES))
    return 0


if __name__ == "__main__":
    if sys.argv[1:] not in ([f] for f in FRONT_ENDS):
        sys.exit(f"usage: maxtext_check.py {{{' | '.join(FRONT_ENDS)}}}")
    # What MaxText is written for: its mesh, logical axis rules and promotion.
    with (
        jax.numpy_dtype_promotion("standard"),
        jax.set_mesh(MESH),
        flax.core.spmd.logical_axis_rules(CONFIGS["float32"].logical_axis_rules),
    ):
        sys.exit(main(sys.argv[1]))
