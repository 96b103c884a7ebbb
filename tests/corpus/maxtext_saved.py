"""What MaxText's backward pass saves under `mixed_bfloat16`, per front end,
against its own bf16 config (`dtype=bfloat16, weight_dtype=float32`).

A tiny llama2 and mixtral (4 experts, 2 a token) decoder built by MaxText's
own `pyconfig` and `model_creation_utils`, with `scan_layers` on and off and
`remat_policy` minimal and full: the bytes `jax.grad` of the loss saves for
its backward pass, arguments left out (`saved_residuals`), for the own
config (and its linen form, `TransformerLinen`, with the same variables),
`jmp_policy.nnx.PolicyModule` (told `config_dtype=jnp.float32`, MaxText's
`cfg.dtype`, and not), linen `with_policy` (of `TransformerLinen`)
and `autocast` (of the NNX model). Prints one JSON line:
`{"llama2 scan=... remat=...": {"own config": bytes, front end: bytes}}`.
With `--h200`, the temporary memory of the gradient compiled for an H200
instead (`on_h200`: the CUDA plugin for the installed jaxlib, no GPU).
Run apart, with MaxText first on the path (`checks.run_apart`), by
benchmarks/saved_bytes.py and tests/test_maxtext.py.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from typing import Any

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = " ".join(
    f for f in os.environ.get("XLA_FLAGS", "").split() if "device_count" not in f
)
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from maxtext import configs
from maxtext.configs import pyconfig
from maxtext.utils import maxtext_utils, maxtext_utils_nnx, model_creation_utils

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy.core.diagnostics import saved_residuals

from corpus import on_h200

POLICY = "mixed_bfloat16"
B, T, VOCAB = 2, 16, 64
TOKENS = jax.random.randint(jax.random.key(1), (B, T), 1, VOCAB)
KWARGS = {"enable_dropout": False, "model_mode": "train"}
POSITIONS = jnp.broadcast_to(jnp.arange(T), (B, T))
SEGMENTS = jnp.ones((B, T), jnp.int32)
# `PolicyModule` without `config_dtype`: MaxText's `y.astype(cfg.dtype)` after
# the embedding, float32 in the float32 config, then widens the residual stream.
UNSAID = "PolicyModule, no config_dtype"
BLOCKS = {
    "llama2": {"decoder_block": "llama2"},
    "mixtral": {"decoder_block": "mixtral", "num_experts": 4, "num_experts_per_tok": 2},
}


def config(block: str, scan: bool, remat: str, dtype: str) -> pyconfig.HyperParameters:
    xla_flags = os.environ.get("XLA_FLAGS")
    c = pyconfig.initialize(
        ["maxtext_saved", os.path.join(os.path.dirname(configs.__file__), "base.yml")],
        hardware="cpu",
        skip_jax_distributed_system=True,
        enable_checkpointing=False,
        jax_cache_dir="",
        run_name="maxtext_saved",
        base_output_directory=os.path.join(os.environ.get("TMPDIR", "/tmp"), "maxtext_saved"),
        dataset_type="synthetic",
        attention="dot_product",
        base_emb_dim=32,
        base_num_query_heads=2,
        base_num_kv_heads=2,
        base_mlp_dim=64,
        base_moe_mlp_dim=64,
        base_num_decoder_layers=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_target_length=T,
        per_device_batch_size=B,
        scan_layers=scan,
        remat_policy=remat,
        dtype=dtype,
        weight_dtype="float32",
        **BLOCKS[block],
    )
    if xla_flags is None:  # pyconfig sets XLA_FLAGS to dump HLO.
        os.environ.pop("XLA_FLAGS", None)
    else:
        os.environ["XLA_FLAGS"] = xla_flags
    return c


def loss(logits: jax.Array) -> jax.Array:
    labels = jnp.roll(TOKENS, -1, axis=1)
    return optax.softmax_cross_entropy_with_integer_labels(
        logits.astype(jnp.float32), labels
    ).mean()


def saved_bytes(loss_of_params, params) -> int:
    return sum(
        int(aval.size) * aval.dtype.itemsize
        for aval, origin in saved_residuals(loss_of_params, params)
        if not origin.startswith("from the argument")
    )


def nnx_loss(model: nnx.Module, policy: str | None, rest=None):
    """The loss of `model`'s parameters, and those parameters; its other
    state (`rest`: random keys and counts) given, where the model is abstract."""
    graph, params, own_rest = nnx.split(model, nnx.Param, ...)
    rest = own_rest if rest is None else rest

    def call(model):
        return model(TOKENS, POSITIONS, SEGMENTS, **KWARGS)

    call = call if policy is None else jmp.autocast(call, policy)

    def loss_of_params(params):
        return loss(call(nnx.merge(graph, params, on_h200.made_again(rest))))

    return loss_of_params, params


def nnx_model(c, mesh, abstract: bool) -> nnx.Module:
    def make():
        rngs = maxtext_utils_nnx.create_nnx_rngs(c, model_mode="train")
        return model_creation_utils.from_config(c, mesh=mesh, rngs=rngs, model_mode="train")

    return nnx.eval_shape(make) if abstract else make()


def losses(block: str, scan: bool, remat: str, mesh, rests=None) -> dict[str, tuple]:
    """Front end -> (loss of the parameters, the parameters). With `rests`
    (each NNX front end's state but its parameters, made on the CPU), the
    models are abstract, on `mesh`."""
    own_config, f32_config = (config(block, scan, remat, d) for d in ("bfloat16", "float32"))
    abstract = rests is not None
    rests = rests or {}
    with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(f32_config.logical_axis_rules):
        model, own = (nnx_model(c, mesh, abstract) for c in (f32_config, own_config))
        if not abstract:
            nnx.update(own, nnx.state(model, nnx.Param))
        mixed = jmp_policy.nnx.PolicyModule(model, POLICY, config_dtype=jnp.float32)
        unsaid = jmp_policy.nnx.PolicyModule(model, POLICY)
        linen, own_linen = (
            model_creation_utils.from_config(c, mesh=mesh, model_mode="train")
            for c in (f32_config, own_config)
        )

        def init():
            return linen.init(jax.random.key(0), TOKENS, POSITIONS, SEGMENTS, **KWARGS)

        variables = jax.eval_shape(init) if abstract else init()
        with_policy = jmp.with_policy(linen.apply, POLICY)
        return {
            "own config": nnx_loss(own, None, rests.get("model")),
            # The linen form of the model (`ToLinen`) saves what its NNX layers
            # see through `ToLinen` (the kernels' sharding constraints): the
            # own config `with_policy` is held against.
            "own config (linen)": (
                lambda v: loss(own_linen.apply(v, TOKENS, POSITIONS, SEGMENTS, **KWARGS)),
                variables,
            ),
            "PolicyModule": nnx_loss(mixed, None, rests.get("PolicyModule")),
            UNSAID: nnx_loss(unsaid, None, rests.get("PolicyModule")),
            "with_policy": (
                lambda v: loss(with_policy(v, TOKENS, POSITIONS, SEGMENTS, **KWARGS)),
                variables,
            ),
            "autocast": nnx_loss(model, POLICY, rests.get("model")),
        }


def h200_figures(block: str, scan: bool, remat: str) -> dict[str, int]:
    """The temporary memory of the gradient compiled for an H200, per front end
    (`on_h200`): the models abstract on a mesh of one H200."""
    rests = on_h200.portable(cpu_rests(block, scan, remat))
    f32_config = config(block, scan, remat, "float32")
    mesh = maxtext_utils.get_mesh_from_config(f32_config, devices=on_h200.devices())
    found = {}
    for name, (loss_of_params, params) in losses(block, scan, remat, mesh, rests).items():
        with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(f32_config.logical_axis_rules):
            found[name] = on_h200.temp_bytes(loss_of_params, params, mesh)
    return found


def cpu_rests(block: str, scan: bool, remat: str) -> dict[str, Any]:
    """The state but the parameters of the float32 model, and of it under
    `PolicyModule`, made on the CPU."""
    f32_config = config(block, scan, remat, "float32")
    mesh = cpu_mesh(block, scan, remat)
    with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(f32_config.logical_axis_rules):
        model = nnx_model(f32_config, mesh, abstract=False)
        mixed = jmp_policy.nnx.PolicyModule(model, POLICY, config_dtype=jnp.float32)
        return {name: nnx.split(m, nnx.Param, ...)[2] for name, m in
                {"model": model, "PolicyModule": mixed}.items()}  # fmt: skip


def cpu_mesh(block: str, scan: bool, remat: str):
    return maxtext_utils.get_mesh_from_config(config(block, scan, remat, "float32"))


def saved_figures(block: str, scan: bool, remat: str) -> dict[str, int]:
    mesh = cpu_mesh(block, scan, remat)
    found = losses(block, scan, remat, mesh)
    f32_config = config(block, scan, remat, "float32")
    with jax.set_mesh(mesh), flax.core.spmd.logical_axis_rules(f32_config.logical_axis_rules):
        return {name: saved_bytes(*pair) for name, pair in found.items()}


def main(argv: list[str]) -> int:
    figures = h200_figures if "--h200" in argv else saved_figures
    found = {}
    for block, scan, remat in itertools.product(BLOCKS, (False, True), ("minimal", "full")):
        name = f"{block} scan={'on' if scan else 'off'} remat={remat}"
        found[name] = figures(block, scan, remat)
        print(name, found[name], file=sys.stderr)
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):
        sys.exit(main(sys.argv[1:]))
