"""The reduce dtype (`r=`): the dtype products give their results in, so what a
sharded program sums across devices, in every front end.

On XLA:CPU every bf16 collective is widened to f32, so the collectives
themselves are read from a GPU compile (`benchmarks/gpu_collectives.py`, 8
compile-only H200s; skipped where the CUDA plugin is missing); on the CPU the
products' result dtypes are read from the lowered program, and the loss of
a data-parallel run over 8 devices is compared with float32 reduction.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import jaxlib
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jmp_policy as jmp
import jmp_policy.nnx  # noqa: F401  (jmp.nnx, also where this file runs as a script)
from jmp_policy.app import transformer_lm

from helpers import import_benchmark, lowered_ops

M_BF16 = "p=f32,c=bf16,o=f32,m=bf16"


# --- The policy word ---------------------------------------------------------


@pytest.mark.parametrize(
    "spec, text",
    [
        ("mixed_bfloat16", "p=full,c=bf16,o=full"),
        (M_BF16 + ",r=f32", "p=full,c=bf16,o=full,m=bf16,r=full"),
        (M_BF16 + ",reduce=bf16", "p=full,c=bf16,o=full,m=bf16"),  # The default: not printed.
        ("c=f32,r=bf16", "p=full,c=full,o=full,r=bf16"),
        ("mixed_float16", "p=full,c=f16,o=full"),
        # A preset and parts that replace its own: float32 reduction, one word away.
        ("mixed_bfloat16,r=f32", "p=full,c=bf16,o=full,r=full"),
        ("mixed_float8, r=f32", "p=full,c=bf16,o=full,m=f8,r=full"),
        ("mixed_float8,m=bf16", "p=full,c=bf16,o=full,m=bf16"),
    ],
)
def test_the_reduce_dtype_round_trips_through_str(spec, text):
    policy = jmp.get_policy(spec)
    assert str(policy) == text and jmp.get_policy(text) == policy
    assert hash(jmp.get_policy(text)) == hash(policy)


def test_the_reduce_dtype_follows_the_compute_dtype_unless_given():
    policy = jmp.get_policy(M_BF16)
    assert policy.reduce_dtype is None  # The compute dtype's, as FSDP's reduce_dtype default.
    wide = policy.with_reduce_dtype("f32")
    assert wide.reduce_dtype is jnp.float32 and wide.with_reduce_dtype(None) == policy
    # Given as the compute dtype, it is the default: one policy, one spelling.
    assert jmp.Policy("f32", "bf16", "f32", reduce_dtype=jnp.bfloat16) == jmp.get_policy(
        "mixed_bfloat16"
    )
    assert policy.with_compute_dtype("f16").with_reduce_dtype("f16").reduce_dtype is None


def test_a_bad_reduce_dtype_is_refused_by_name():
    with pytest.raises(ValueError, match="Unknown dtype 'int8'"):
        jmp.get_policy(M_BF16 + ",r=int8")
    with pytest.raises(ValueError, match="Duplicate key 'reduce'"):
        jmp.get_policy("r=f32,reduce=bf16")
    with pytest.raises(ValueError, match="Bad part 'mixed_float16'"):
        jmp.get_policy("mixed_bfloat16,mixed_float16")
    with pytest.raises(TypeError, match=r"Policy\.reduce_dtype must be"):
        jmp.Policy("f32", "bf16", "f32", reduce_dtype="int8")
    with pytest.raises(TypeError, match="reduce_dtype must be"):
        jmp.half_dot_general(jnp.ones((2, 3)), jnp.ones((3, 4)), (((1,), (0,)), ((), ())),
                             reduce_dtype=jnp.int8)  # fmt: skip


# --- Every front end: the products' results in the lowered program -------------


class Mlp(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dense(4)(jnp.tanh(nn.Dense(16)(x)))


class NnxMlp(nnx.Module):
    def __init__(self, rngs):
        self.a, self.b = nnx.Linear(8, 16, rngs=rngs), nnx.Linear(16, 4, rngs=rngs)

    def __call__(self, x):
        return self.b(jnp.tanh(self.a(x)))


X = jnp.linspace(-1, 1, 16 * 8, dtype=jnp.float32).reshape(16, 8)


def _grad_fn(front_end, policy):
    """`grad(params, x) -> gradients` of a mean-square loss through `front_end`."""
    if front_end == "nnx":
        model = jmp.nnx.PolicyModule(NnxMlp(nnx.Rngs(0)), policy)
        graph, params = nnx.split(model)
        apply = lambda p, x: nnx.merge(graph, p)(x)  # noqa: E731
    else:
        mlp = Mlp()
        params = mlp.init(jax.random.key(0), X)
        transform = jmp.with_policy if front_end == "with_policy" else jmp.autocast
        apply = transform(mlp.apply, policy)
    loss = lambda p, x: jnp.mean(jnp.square(apply(p, x).astype(jnp.float32)))  # noqa: E731
    return jax.grad(loss), params


@pytest.mark.parametrize("front_end", ["with_policy", "autocast", "nnx"])
@pytest.mark.parametrize("reduce, results", [("", "bf16"), (",r=f32", "f32")])
@pytest.mark.parametrize("matmul", ["none", "bf16", "f8", "f8_rowwise", "mxfp8", "nvfp4"])
def test_every_product_gives_its_results_in_the_reduce_dtype(front_end, reduce, results, matmul):
    # "none": products the fields already give in the compute dtype take the word too.
    spec = "mixed_bfloat16" if matmul == "none" else M_BF16.replace("m=bf16", f"m={matmul}")
    grad, params = _grad_fn(front_end, spec + reduce)
    dots = [op for op in lowered_ops(grad, params, X) if op.name == "dot_general"]
    # Two layers: two forward products, three backward ones (the first
    # layer's input needs no gradient); NVFP4 adds its four Hadamard
    # transforms (float32 matmuls of the weight gradients' operands).
    hadamard = 4 if matmul == "nvfp4" else 0
    assert len(dots) == 5 + hadamard, dots
    in_results = sum(op.result_types == (results,) for op in dots)
    assert in_results == 5 + (hadamard if results == "f32" else 0), dots
    if matmul in ("none", "bf16"):
        assert all(op.operand_types == ("bf16", "bf16") for op in dots), dots
    elif matmul.startswith("f8"):  # FP8 operands into the products themselves.
        assert all(op.operand_types[1] == "f8E4M3FN" for op in dots), dots


def test_a_float32_result_the_program_asks_of_half_operands_is_kept():
    # The author's choice: bf16 operands, a float32 result asked for.
    def f(x, w):
        return jnp.einsum("ij,jk->ik", x.astype(jnp.bfloat16), w.astype(jnp.bfloat16),
                          preferred_element_type=jnp.float32)  # fmt: skip

    w = jnp.ones((8, 4))
    dots = [op for op in lowered_ops(jmp.autocast(f, M_BF16), X, w) if op.name == "dot_general"]
    assert [op.result_types for op in dots] == [("f32",)]


# --- Over 8 devices ---------------------------------------------------------------


@pytest.fixture(scope="module")
def mesh():
    if len(jax.devices()) < 8:
        pytest.skip("needs 8 devices (XLA_FLAGS=--xla_force_host_platform_device_count=8)")
    return Mesh(np.array(jax.devices()[:8]), ("data",))


STEPS = 40


def _data_parallel_losses(mesh, policy):
    """The training loss of the benchmark Transformer LM (2 blocks of width 64)
    after each of `STEPS` Adam steps, the batch sharded over 8 devices."""
    batches, _, vocab = transformer_lm.make_data(STEPS, batch=16)
    model = transformer_lm.make_model(vocab, width=64, depth=2)
    apply = jmp.with_policy(model.apply, policy)
    params = jmp.with_policy(model.init, policy)(jax.random.key(0), batches[0, :, :-1])["params"]
    tx = optax.adam(3e-3)

    @jax.jit
    def step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(functools.partial(transformer_lm.loss_fn, apply))(
            params, batch
        )
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    sharded = jax.device_put(batches, NamedSharding(mesh, P(None, "data")))
    opt_state, losses = tx.init(params), []
    for i in range(STEPS):
        params, opt_state, loss = step(params, opt_state, sharded[i])
        losses.append(float(loss))
    return np.array(losses)


@pytest.mark.slow
def test_bf16_reduction_trains_as_float32_reduction_does(mesh):
    with jax.numpy_dtype_promotion("standard"):  # optax's adam: float ** int32
        narrow = _data_parallel_losses(mesh, M_BF16)
        wide = _data_parallel_losses(mesh, M_BF16 + ",r=f32")
    print(f"loss after {STEPS} steps: r=bf16 {narrow[-1]:.4f}, r=f32 {wide[-1]:.4f}")
    assert narrow[-1] < 0.8 * narrow[0]  # Both learn ...
    # ... to within 2% of each other (measured: see docs/guides/distributed.md).
    assert abs(narrow[-5:].mean() - wide[-5:].mean()) <= 0.02 * wide[-5:].mean()


# --- The collectives of a GPU compile -----------------------------------------------

PLUGIN = Path(__file__).resolve().parent.parent / ".venv" / "cuda-plugin"


def _plugin_or_skip() -> None:
    found = sorted(PLUGIN.glob("jax_cuda12_plugin-*.dist-info"))
    version = found[0].name.removesuffix(".dist-info").split("-")[1] if found else None
    if version != jaxlib.__version__:
        pytest.skip(
            f"no CUDA plugin for jaxlib {jaxlib.__version__} in {PLUGIN} (found {version}); "
            "./run installs it where pip has one"
        )


def _gradient_all_reduces(front_end: str, policy: str) -> dict[str, float]:
    """The bytes the all-reduces of the gradient step sum, per element type,
    data-parallel over 8 H200s (compiled, in a process of its own with the
    CUDA plugin)."""
    root = PLUGIN.parent.parent
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "XLA_FLAGS")}
    env["JAX_PLATFORMS"] = "cpu"  # Compile for the GPUs; run nothing.
    env["PYTHONPATH"] = os.pathsep.join(
        map(str, (root / "benchmarks", root, root / "tests", PLUGIN))
    )
    run = subprocess.run(
        [sys.executable, __file__, front_end, policy],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    return json.loads(run.stdout.splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("front_end", ["with_policy", "autocast", "nnx"])
def test_gradients_are_reduced_in_the_reduce_dtype_on_the_gpu(front_end):
    _plugin_or_skip()
    narrow = _gradient_all_reduces(front_end, M_BF16)
    wide = _gradient_all_reduces(front_end, M_BF16 + ",r=f32")
    # The products' weight gradients (8 x 16 + 16 x 4 kernel entries) are
    # summed in the reduce dtype: bf16 by default, f32 one word away. What no
    # product makes (a bias's sum over the batch) takes the dtype the
    # parameter is used in, as in the model's own half config: 20 entries.
    kernels, biases = 8 * 16 + 16 * 4, 16 + 4
    assert narrow.get("bf16", 0) >= 2 * kernels and narrow.get("f32", 0) <= 4 * biases, narrow
    assert wide.get("f32", 0) >= 4 * kernels and wide.get("bf16", 0) <= 2 * biases, wide


def _compile_for_gpus(front_end: str, policy: str) -> None:
    """Prints, as JSON, the bytes the gradient step's all-reduces sum, per element type."""
    gpu_collectives = import_benchmark("gpu_collectives")
    gpu_compile = import_benchmark("gpu_compile")
    config = gpu_compile.target_configs()["h200_sxm"]
    mesh = Mesh(np.array(gpu_compile.cuda_devices(config, 8)), ("x",))
    grad, params = _grad_fn(front_end, policy)

    def placed(x, spec):
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec))

    params = jax.tree.map(lambda x: placed(x, P()), params)
    hlo = jax.jit(grad).trace(params, placed(X, P("x"))).lower().compile().as_text()
    found: dict[str, float] = {}
    for c in gpu_collectives.collectives(hlo, 8):
        for dtype, size in c.bytes_by_type if c.kind == "all-reduce" else ():
            found[dtype] = found.get(dtype, 0) + size
    print(json.dumps(found))


if __name__ == "__main__":
    _compile_for_gpus(*sys.argv[1:])


# --- One account of the words: README, the policies guide, `Policy`'s docstring ---

_ROOT = Path(__file__).resolve().parent.parent
_TYPE_NAMES = {"f8e4m3": "f8E4M3FN", "f8e5m2": "f8E5M2"}


def _words_table(text):
    """The rows of the table of what each word changes: (spec, forward, backward)."""
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`p=") and " -> " in cells[2]:
            passes = [p.strip().strip("`") for p in cells[2].split(" / ")]
            rows.append((cells[0].strip("`"), *passes))
    return rows


def _as_types(text):
    ins, out = text.split(" -> ")
    lhs, rhs = (_TYPE_NAMES.get(t, t) for t in ins.split(" x "))
    return (lhs, rhs), (_TYPE_NAMES.get(out, out),)


def test_the_words_are_explained_once_and_as_the_program_lowers_them():
    readme = _words_table((_ROOT / "README.md").read_text())
    assert len(readme) == 5, readme
    assert _words_table((_ROOT / "docs/guides/policies.md").read_text()) == readme
    assert _words_table(jmp.Policy.__doc__) == readme
    dense, x = nn.Dense(4), jnp.ones((2, 8))
    params = dense.init(jax.random.key(0), x)
    for spec, forward, backward in readme:
        apply = jmp.with_policy(dense.apply, spec)
        grad = jax.grad(lambda p: jnp.sum(apply(p, x)))  # The weight gradient's product.
        for fn, args, expected in ((apply, (params, x), forward), (grad, (params,), backward)):
            dots = [op for op in lowered_ops(fn, *args) if op.name == "dot_general"]
            assert [(op.operand_types, op.result_types) for op in dots] == [_as_types(expected)]
