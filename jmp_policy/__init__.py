"""jmp_policy: mixed precision training for JAX, Flax and optax.

A superset of DeepMind's jmp: `import jmp_policy as jmp` runs jmp code.
"""

from jmp_policy.core.half_params import HalfParamState
from jmp_policy.core.half_params import half_param_updates
from jmp_policy.diagnostics import GradientReport
from jmp_policy.diagnostics import diagnose
from jmp_policy.diagnostics import plot_histogram
from jmp_policy.linen import with_policy
from jmp_policy.loss_scale import DynamicLossScale
from jmp_policy.loss_scale import ExpectedScalarError
from jmp_policy.loss_scale import LossScale
from jmp_policy.loss_scale import NoOpLossScale
from jmp_policy.loss_scale import StaticLossScale
from jmp_policy.loss_scale import all_finite
from jmp_policy.loss_scale import select_tree
from jmp_policy.ops import FLOAT32_PRIMITIVES
from jmp_policy.ops import HALF_PRIMITIVES
from jmp_policy.ops import PROMOTE_PRIMITIVES
from jmp_policy.ops import autocast
from jmp_policy.ops import half_conv_general_dilated
from jmp_policy.ops import half_dot_general
from jmp_policy.optimizer import LossScaledState
from jmp_policy.optimizer import get_loss_scale
from jmp_policy.optimizer import loss_scaled
from jmp_policy.policy import Policy
from jmp_policy.policy import cast_to_full
from jmp_policy.policy import cast_to_half
from jmp_policy.policy import get_policy
from jmp_policy.policy import half_dtype

__version__ = "0.1.0"

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
    "autocast",
    "cast_to_full",
    "cast_to_half",
    "diagnose",
    "get_loss_scale",
    "get_policy",
    "half_conv_general_dilated",
    "half_dot_general",
    "half_dtype",
    "half_param_updates",
    "loss_scaled",
    "plot_histogram",
    "select_tree",
    "with_policy",
)
