"""`jmp_policy.nnx`: mixed precision policies for Flax NNX modules.

`with_policy(module, policy)` returns a copy of an NNX module computing under
the policy; `PolicyModule` adds the policy's casts at the model's boundary;
`get_loss_scale` reads the loss scale of an `nnx.Optimizer`. Importing this
module imports Flax.
"""

from jmp_policy.integrations.nnx import PolicyModule
from jmp_policy.integrations.nnx import get_loss_scale
from jmp_policy.integrations.nnx import with_policy

__all__ = ("PolicyModule", "get_loss_scale", "with_policy")
