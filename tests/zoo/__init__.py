"""A model zoo: architectures written the way their users write them.

Each module builds one architecture (Flax linen, and Flax NNX where Flax has
the layers) at a tiny size, makes its own deterministic data with NumPy, and
defines its loss. `tests/test_zoo.py` trains every model for 20 jitted steps
under float32, `mixed_bfloat16` and `mixed_float16` (`jmp_policy.with_policy`,
or `jmp_policy.nnx.PolicyModule`), `autocast`, and Flax's hand-written
`dtype=jnp.bfloat16` recipe, and compares them.

A model is described by a `LinenSpec` or an `NnxSpec`:

* `make(dtype=None)` (linen) or `make(rngs, dtype=None)` (NNX) builds the
  model; `dtype` is the hand-written recipe's compute dtype, passed to every
  Flax layer as users do (`None`: Flax infers it, float32 here);
* `data()` returns `{"init": (args, kwargs), "batch": batch}`, deterministic;
* `loss(apply, variables, batch, rng)` (linen) returns `(loss, new_state)`,
  `new_state` being the updated mutable collections (`{}` if none);
  `loss(model, batch)` (NNX) returns the loss;
* `kept_f32[variant]`: how many matmuls/convolutions of the lowered train
  step keep float32 (or complex) operands under that half-precision variant,
  and why (a rule, the model's own float32 maths, complex numbers);
* `cpu_error[variant]`: the error with which the variant fails on a CPU where
  JAX cannot lower the hand-written model either (not jmp_policy's; before
  jaxlib 0.12.1); tested as such, and as training where JAX lowers both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

# The half-precision variants the zoo trains, besides the float32 reference.
HALF_VARIANTS = ("mixed_bfloat16", "mixed_float16", "autocast", "handwritten_bf16")
VARIANTS = ("float32", *HALF_VARIANTS)
# |final loss - float32's final loss| <= LOSS_TOL * float32's initial loss.
LOSS_TOL = 0.02


@dataclasses.dataclass(frozen=True)
class LinenSpec:
    name: str
    make: Callable[..., Any]
    data: Callable[[], dict]
    loss: Callable[..., Any]
    # The PRNG streams `init` needs besides "params".
    init_rngs: tuple[str, ...] = ()
    # Whether `make(dtype=jnp.bfloat16)` is a working hand-written bf16 model.
    handwritten: bool = True
    kept_f32: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rules: Mapping[Any, str] | None = None
    # Arguments of the model's call that the policy keeps as given (`keep_inputs`).
    keep_inputs: tuple[str, ...] = ()
    cpu_error: Mapping[str, str] = dataclasses.field(default_factory=dict)
    learning_rate: float = 3e-3
    # Tolerance of each half variant's final loss against float32's, as a
    # fraction of float32's initial loss.
    loss_tol: float = LOSS_TOL
    kind: str = "linen"


@dataclasses.dataclass(frozen=True)
class NnxSpec:
    name: str
    make: Callable[..., Any]
    data: Callable[[], dict]
    loss: Callable[..., Any]
    handwritten: bool = True
    kept_f32: Mapping[str, int] = dataclasses.field(default_factory=dict)
    rules: Mapping[Any, str] | None = None
    cpu_error: Mapping[str, str] = dataclasses.field(default_factory=dict)
    learning_rate: float = 3e-3
    loss_tol: float = LOSS_TOL
    kind: str = "nnx"


def all_specs() -> list[LinenSpec | NnxSpec]:
    """Every zoo model, linen first."""
    import importlib

    names = (
        "resnet", "recurrent", "transformer", "vit", "diffusion", "vae", "moe", "gnn",
        "seq2seq", "complex_layer", "f32_math", "side_inputs",
    )  # fmt: skip
    modules = []
    for n in names:
        try:
            modules.append(importlib.import_module(f"zoo.{n}"))
        except ModuleNotFoundError:
            pass
    linen = [s for m in modules for s in getattr(m, "LINEN", ())]
    nnx = [s for m in modules for s in getattr(m, "NNX", ())]
    return linen + nnx
