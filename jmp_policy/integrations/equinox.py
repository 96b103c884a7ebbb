"""Equinox: what its API says is state in a result, for `autocast`.

An `eqx.nn.State` holds what Equinox layers carry from call to call
(BatchNorm's statistics, spectral norm's vectors): it comes back as the
program made it, never in the output dtype.
"""

from __future__ import annotations

from typing import Any

import equinox as eqx
import jax


def state_in_result(result: Any) -> Any:
    """A `returns_state` prefix of `result`: True at each `eqx.nn.State`; None if it holds none."""
    is_state = lambda x: isinstance(x, eqx.nn.State)  # noqa: E731
    said = jax.tree.map(lambda x: True if is_state(x) else None, result, is_leaf=is_state)
    return said if any(jax.tree.leaves(said)) else None
