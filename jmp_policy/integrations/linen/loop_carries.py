"""The carries of lifted loops (`nn.scan`, `nn.RNN`, `nn.while_loop`) keep their dtypes."""

from __future__ import annotations

import re
from typing import Any

import flax.linen as nn

from jmp_policy.engine.data_flow import keep_carry
from jmp_policy.integrations.linen import flax_internals

# Flax's lifted transforms name themselves in the debug path of the scope they
# create for their body (e.g. "remat(scan(blocks))", innermost first). Those
# that only wrap the body leave its signature as it is.
_TRANSPARENT_LIFTS = frozenset(
    {"remat", "checkpoint", "jit", "vmap", "map_variables", "named_call"}
)
_LIFT_NAME = re.compile(r"([A-Za-z_]\w*)\(")


def _carry_loop(module: nn.Module) -> str | None:
    """'scan' or 'while_loop' if this call is the body of that lifted loop, else None.

    A lifted transform runs its body on a module bound to a new root scope
    (no parent, but the module's path), whose debug path names the
    transforms. Children of the body have a parent scope: only the body's
    own call returns the carry.
    """
    scope = module.scope
    if scope is None or scope.parent is not None or not scope.path:
        return None
    debug_path = flax_internals.debug_path(scope)
    for name in _LIFT_NAME.findall(debug_path[-1] if debug_path else ""):
        if name in ("scan", "while_loop"):
            return name
        if name not in _TRANSPARENT_LIFTS:
            return None
    return None


def _restore_carry(loop: str, given_args: tuple, out: Any) -> Any:
    """The body's result with its carry in the dtypes the loop gave it.

    A scan body is `(carry, *xs) -> (carry, ys)`, a while-loop body
    `carry -> carry`: JAX requires the carry to come out as it went in. The
    body computes under the policy (a half carry for half layers, float32
    for a float32 rule or parameter); the carry keeps the dtypes the model
    gave it (e.g. the float32 state of `LSTMCell.initialize_carry`), as the
    state rule keeps a loop body's carry (`keep_carry`).
    """
    if not given_args:
        return out
    return keep_carry(out, "while_loop" if loop == "while_loop" else "scan", given_args[0])
