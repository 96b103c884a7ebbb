"""What EasyDeL's Llama saves for its backward pass under `mixed_bfloat16`,
per front end, against its own bf16 config.

The tiny float32 Llama of `easydel_check.py` (2 layers, width 64, batch 2 x
32, EasyDeL 0.3.0): the bytes `jax.grad` of a cross-entropy loss saves for
its backward pass, arguments left out (`saved_residuals`), for EasyDeL's own
half config (`dtype=bfloat16, param_dtype=float32`, attention in bfloat16,
the same weights), `jmp_policy.nnx.PolicyModule` (told
`config_dtype=jnp.float32`, and not) and `autocast` of the float32 model. Prints one JSON line: `{"own config": bytes, front end: bytes}`. With `--h200`, the temporary
memory of the gradient compiled for an H200 instead (`on_h200`).
Run apart, with EasyDeL first on the path (`checks.run_apart`), by
benchmarks/saved_bytes.py.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy.core.diagnostics import saved_residuals

from corpus import easydel_check as ec
from corpus import on_h200

POLICY = "mixed_bfloat16"


def loss_and_params(module: nnx.Module, policy: str | None, rest: Any = None) -> tuple:
    """The loss of `module`'s parameters, and those parameters; its other
    state (`rest`) given where the module is abstract (`on_h200`)."""
    graphdef, params, own_rest = nnx.split(module, nnx.Param, ...)
    rest = own_rest if rest is None else rest
    call = lambda m: m(input_ids=ec.IDS, position_ids=ec.positions(0)).logits  # noqa: E731
    call = call if policy is None else jmp.autocast(call, policy)

    def loss(params):
        logits = call(nnx.merge(graphdef, params, on_h200.made_again(rest)))
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), ec.LABELS
        ).mean()

    return loss, params


def saved_bytes(loss: Any, params: Any) -> int:
    return sum(
        int(aval.size) * aval.dtype.itemsize
        for aval, origin in saved_residuals(loss, params)
        if not origin.startswith("from the argument")
    )


def front_ends(model: nnx.Module, own: nnx.Module, rests: dict | None = None) -> dict:
    rests = rests or {}
    # Told that float32 is its config's dtype (`dtype`, `attn_dtype`), and not.
    told = jmp_policy.nnx.PolicyModule(model, POLICY, config_dtype=jnp.float32)
    untold = jmp_policy.nnx.PolicyModule(model, POLICY)
    return {
        "own config": loss_and_params(own, None, rests.get("model")),
        "PolicyModule": loss_and_params(told, None, rests.get("PolicyModule")),
        "PolicyModule, no config_dtype": loss_and_params(untold, None, rests.get("PolicyModule")),
        "autocast": loss_and_params(model, POLICY, rests.get("model")),
    }


def main(argv: list[str]) -> int:
    config, model = ec.build("llama", half=False)
    if "--h200" not in argv:
        _, own = ec.build("llama", half=True)
        nnx.update(own, nnx.state(model, nnx.Param))
        with config.mesh:  # EasyDeL's sharding constraints read the mesh in context.
            found = {k: saved_bytes(*pair) for k, pair in front_ends(model, own).items()}
    else:
        rests = {
            "model": nnx.split(model, nnx.Param, ...)[2],
            "PolicyModule": nnx.split(jmp_policy.nnx.PolicyModule(model, POLICY), nnx.Param, ...)[
                2
            ],
        }
        cpu_mesh = config.mesh
        mesh = jax.sharding.Mesh(
            np.array(on_h200.devices()).reshape(cpu_mesh.devices.shape), cpu_mesh.axis_names
        )
        configs = []

        def abstract(half: bool) -> nnx.Module:
            def make():
                config, module = ec.build("llama", half=half)
                configs.append(config)
                return module

            return nnx.eval_shape(make)

        model, own = abstract(False), abstract(True)
        for c in configs:
            c.set_model_mesh(mesh)
        with mesh:
            found = {
                k: on_h200.temp_bytes(*pair, mesh)
                for k, pair in front_ends(model, own, on_h200.portable(rests)).items()
            }
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):
        sys.exit(main(sys.argv[1:]))
