"""What EasyDeL's Llama saves for its backward pass under `mixed_bfloat16`,
per front end, against its own bf16 config.

The tiny float32 Llama of `easydel_check.py` (2 layers, width 64, batch 2 x
32, EasyDeL 0.3.0): the bytes `jax.grad` of a cross-entropy loss saves for
its backward pass, arguments left out (`saved_residuals`), for EasyDeL's own
half config (`dtype=bfloat16, param_dtype=float32`, attention in bfloat16,
the same weights), `jmp_policy.nnx.PolicyModule` and `autocast` of the
float32 model. Prints one JSON line: `{"own config": bytes, front end: bytes}`.
Run apart, with EasyDeL first on the path (`checks.run_apart`), by
benchmarks/saved_bytes.py.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import jmp_policy as jmp
import jmp_policy.nnx
from jmp_policy.core.diagnostics import saved_residuals

from corpus import easydel_check as ec

POLICY = "mixed_bfloat16"


def saved_bytes(module: nnx.Module, policy: str | None) -> int:
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    call = lambda m: m(input_ids=ec.IDS, position_ids=ec.positions(0)).logits  # noqa: E731
    call = call if policy is None else jmp.autocast(call, policy)

    def loss(params):
        logits = call(nnx.merge(graphdef, params, rest))
        return optax.softmax_cross_entropy_with_integer_labels(
            logits.astype(jnp.float32), ec.LABELS
        ).mean()

    return sum(
        int(aval.size) * aval.dtype.itemsize
        for aval, origin in saved_residuals(loss, params)
        if not origin.startswith("from the argument")
    )


def main() -> int:
    config, model = ec.build("llama", half=False)
    _, own = ec.build("llama", half=True)
    nnx.update(own, nnx.state(model, nnx.Param))
    with config.mesh:  # EasyDeL's sharding constraints read the mesh in context.
        found = {
            "own config": saved_bytes(own, None),
            "PolicyModule": saved_bytes(jmp_policy.nnx.PolicyModule(model, POLICY), None),
            "autocast": saved_bytes(model, POLICY),
        }
    print(json.dumps(found))
    return 0


if __name__ == "__main__":
    with jax.numpy_dtype_promotion("standard"):
        sys.exit(main())
