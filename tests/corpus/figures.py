"""Prints the corpus table of docs/model_coverage.md: each model's forward error
against float32, its own half config's and each policy's, as tests/test_corpus.py
measures them (gemma prints its own: `tests/corpus/gemma_check.py`).

    .venv/bin/python tests/corpus/figures.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # tests/: corpus, helpers

import test_corpus as corpus  # noqa: E402

import jmp_policy as jmp  # noqa: E402
import jmp_policy.nnx  # noqa: E402

from corpus import checks  # noqa: E402


def qwen3() -> dict[str, float]:
    model = corpus.qwen3.Qwen3(corpus.QWEN3, rngs=nnx.Rngs(0))
    ref = corpus.qwen3_forward(model, jnp.float32)
    own = nnx.clone(model)
    nnx.update(own, checks.cast_floats(nnx.state(own, nnx.Param), jnp.bfloat16))
    errors = {"own bf16": checks.relative_error(corpus.qwen3_forward(own, jnp.bfloat16), ref)}
    for policy in checks.POLICIES:
        mixed = jmp_policy.nnx.PolicyModule(model, policy)
        out = corpus.qwen3_forward(mixed, checks.compute_dtype(policy))
        errors[policy] = checks.relative_error(out, ref)
    return errors


def llamalike() -> dict[str, float]:
    forward, params = corpus.pz_forward_of(corpus.llamalike_model(jnp.float32))
    ref = checks.jit(forward)(params, corpus.TOKENS)
    errors = {}
    for dtype, name in ((checks.BF16, "own bf16"), (checks.F16, "own f16")):
        own, _ = corpus.pz_forward_of(corpus.llamalike_model(dtype))
        out = checks.jit(own)(checks.cast_floats(params, dtype), corpus.TOKENS)
        errors[name] = checks.relative_error(out, ref)
    for policy in checks.POLICIES:
        out = checks.jit(jmp.autocast(forward, policy))(params, corpus.TOKENS)
        errors[policy] = checks.relative_error(out, ref)
    return errors


def resnet() -> dict[str, float]:
    hk, images = corpus.hk, corpus.IMAGES
    net = hk.transform_with_state(corpus.resnet_fn)
    params, state = checks.jit(net.init, static_argnums=2)(jax.random.key(1), images, True)
    params = checks.jit(corpus.perturbed)(params, jax.random.key(2))

    def error(apply):
        out, _ = checks.jit(apply, static_argnums=4)(params, state, None, images, False)
        return checks.relative_error(out, ref)

    ref, _ = checks.jit(net.apply, static_argnums=4)(params, state, None, images, False)
    errors = {}
    for spec, name in (("p=f32,c=bf16,o=f32", "own bf16"), ("p=f32,c=f16,o=f32", "own f16")):
        hk.mixed_precision.set_policy(hk.nets.ResNet, jmp.get_policy(spec))
        try:
            errors[name] = error(hk.transform_with_state(corpus.resnet_fn).apply)
        finally:
            hk.mixed_precision.clear_policy(hk.nets.ResNet)
    for policy in checks.POLICIES:
        errors[policy] = error(jmp.autocast(net.apply, policy))
    return errors


def main() -> int:
    columns = ["own bf16", "own f16", *checks.POLICIES]
    print(f"{'model':<24}" + "".join(f"{c:>28}" for c in columns))
    with jax.numpy_dtype_promotion("standard"):
        for name, measure in (
            ("bonsai Qwen3 (NNX)", qwen3),
            ("penzai llamalike", llamalike),
            ("Haiku ResNet", resnet),
        ):
            errors = measure()
            print(f"{name:<24}" + "".join(f"{errors.get(c, float('nan')):>28.4f}" for c in columns))
    print("forward error: max |out - float32| / max |float32|; nan: no such config")
    return 0


if __name__ == "__main__":
    sys.exit(main())
