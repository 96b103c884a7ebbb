"""jmp_policy: mixed precision training for JAX, Flax and optax.

A superset of DeepMind's jmp: `import jmp_policy as jmp` runs jmp code.

The public API is the names below and `jmp_policy.nnx`; module paths under
`jmp_policy.core`, `jmp_policy.integrations` and `jmp_policy.app` are not a
promise. The core needs only jax, numpy and optax: `with_policy` (Flax linen)
and `plot_histogram` (matplotlib) load their dependencies on first use.
"""

# Underscored: the namespace is `__all__` (and the subpackages).
import contextlib as _contextlib
import sys as _sys
from typing import TYPE_CHECKING as _TYPE_CHECKING
from typing import Any as _Any

from jmp_policy.engine.decision import FLOAT32_PRIMITIVES
from jmp_policy.engine.decision import HALF_PRIMITIVES
from jmp_policy.engine.decision import PROMOTE_PRIMITIVES
from jmp_policy.engine.interpreter import as_written
from jmp_policy.integrations.autocast import autocast
from jmp_policy.core.diagnostics import GradientReport
from jmp_policy.core.diagnostics import diagnose
from jmp_policy.core.half_params import HalfParamState
from jmp_policy.core.half_params import half_param_updates
from jmp_policy.core.loss_scale import DynamicLossScale
from jmp_policy.core.loss_scale import ExpectedScalarError
from jmp_policy.core.loss_scale import LossScale
from jmp_policy.core.loss_scale import NoOpLossScale
from jmp_policy.core.loss_scale import StaticLossScale
from jmp_policy.core.loss_scale import all_finite
from jmp_policy.core.loss_scale import select_tree
from jmp_policy.core.loss_scaled import LossScaledState
from jmp_policy.core.loss_scaled import get_loss_scale
from jmp_policy.core.loss_scaled import loss_scaled
from jmp_policy.engine.products.fp8 import fp8_dot_general
from jmp_policy.engine.residuals import fp8_residuals
from jmp_policy.engine.products.half import half_conv_general_dilated
from jmp_policy.engine.products.half import half_dot_general
from jmp_policy.core.policy import Policy
from jmp_policy.core.policy import cast_to_full
from jmp_policy.core.policy import cast_to_half
from jmp_policy.core.policy import get_policy
from jmp_policy.core.policy import half_dtype

if _TYPE_CHECKING:
    from jmp_policy.app.doctor import plot_histogram
    from jmp_policy.app.fp8_doctor import recommend_fp8_rules
    from jmp_policy.integrations.linen import with_policy

__version__ = "0.3.0"  # 0.3: Policy fields are JAX scalar types (were np.dtype)

# Names whose modules import Flax or matplotlib: loaded when first used.
_LAZY = {
    "plot_histogram": "jmp_policy.app.doctor",
    "recommend_fp8_rules": "jmp_policy.app.fp8_doctor",
    "with_policy": "jmp_policy.integrations.linen",
}


def _nnx_state_handler(run, fn, args, kwargs):
    # An NNX module can only be in the call if Flax NNX is loaded: importing
    # jmp_policy never imports Flax.
    if "flax.nnx" not in _sys.modules:
        return NotImplemented
    from jmp_policy.integrations.nnx import autocast_with_state

    return autocast_with_state(run, fn, args, kwargs)


def _linen_state_handler(run, fn, args, kwargs):
    if "flax.linen" not in _sys.modules:
        return NotImplemented
    from jmp_policy.integrations.linen import apply_keeping_variables

    return apply_keeping_variables(run, fn, args, kwargs)


def _linen_state_reader(fn, kwargs, result):
    # Linen's `init` returns variables and `apply(..., mutable=...)` the
    # updated collections: state, as the model made it.
    if "flax.linen" not in _sys.modules:
        return None
    from jmp_policy.integrations.linen import state_in_result

    return state_in_result(fn, kwargs)


def _linen_trace_context():
    # An `apply` inside the function returns its mutable collections: state.
    if "flax.linen" not in _sys.modules:
        return _contextlib.nullcontext()
    import flax.linen as nn

    from jmp_policy.integrations.linen.call import recording_interceptor

    return nn.intercept_methods(recording_interceptor())


def _flax_dtype_inference(origin: str) -> bool:
    # A Flax layer with `dtype=None` widens a half input against its kernel.
    if "flax" not in _sys.modules:
        return False
    from jmp_policy.integrations.flax_internals import infers_a_layers_dtype

    return infers_a_layers_dtype(origin)


def _equinox_state_reader(fn, kwargs, result):
    if "equinox" not in _sys.modules:
        return None
    from jmp_policy.integrations.equinox import state_in_result

    return state_in_result(result)


from jmp_policy.engine.intent import register_dtype_inference as _register_dtype_inference  # noqa: E402
from jmp_policy.integrations import autocast as _autocast_module  # noqa: E402
from jmp_policy.integrations.flax_serialization import (  # noqa: E402
    register_when_flax_loads as _register_when_flax_loads,
)

# Linen's first: the NNX handler runs every call that holds no NNX module.
_autocast_module.register_state_handler(_linen_state_handler)
_autocast_module.register_state_handler(_nnx_state_handler)
_autocast_module.register_state_reader(_linen_state_reader)
_autocast_module.register_state_reader(_equinox_state_reader)
_autocast_module.register_trace_context(_linen_trace_context)
_register_dtype_inference(_flax_dtype_inference)
# Loss scales in `flax.serialization` checkpoints, without importing Flax.
_register_when_flax_loads()


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'jmp_policy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = (
    "DynamicLossScale",
    "ExpectedScalarError",
    "FLOAT32_PRIMITIVES",
    "GradientReport",
    "HALF_PRIMITIVES",
    "HalfParamState",
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "PROMOTE_PRIMITIVES",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "as_written",
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "diagnose",
    "fp8_dot_general",
    "fp8_residuals",
    "get_loss_scale",
    "get_policy",
    "half_conv_general_dilated",
    "half_dot_general",
    "half_dtype",
    "half_param_updates",
    "loss_scaled",
    "plot_histogram",
    "recommend_fp8_rules",
    "select_tree",
    "with_policy",
)
