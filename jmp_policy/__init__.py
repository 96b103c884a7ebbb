"""jmp_policy: mixed precision training for JAX, Flax and optax.

A superset of DeepMind's jmp: `import jmp_policy as jmp` runs jmp code.
"""

from jmp_policy.linen import with_policy
from jmp_policy.loss_scale import DynamicLossScale
from jmp_policy.loss_scale import ExpectedScalarError
from jmp_policy.loss_scale import LossScale
from jmp_policy.loss_scale import NoOpLossScale
from jmp_policy.loss_scale import StaticLossScale
from jmp_policy.loss_scale import all_finite
from jmp_policy.loss_scale import select_tree
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
    "LossScale",
    "LossScaledState",
    "NoOpLossScale",
    "Policy",
    "StaticLossScale",
    "all_finite",
    "cast_to_full",
    "cast_to_half",
    "get_loss_scale",
    "get_policy",
    "half_dtype",
    "loss_scaled",
    "select_tree",
    "with_policy",
)
