"""The carries of lifted loops (`nn.scan`, `nn.RNN`, `nn.while_loop`) keep their dtypes."""

from __future__ import annotations

from typing import Any

import flax.linen as nn

from jmp_policy.engine.data_flow import keep_carry
from jmp_policy.integrations import flax_internals


def _carry_loop(module: nn.Module) -> str | None:
    """'scan' or 'while_loop' if this call is the body of that lifted loop, else None.

    Children of the body have a parent scope: only the body's own call
    returns the carry.
    """
    return flax_internals.lifted_loop(module.scope)


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
