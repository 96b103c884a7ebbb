"""Loss scales in Flax checkpoints: `flax.serialization` learns the three kinds.

Flax serializes a type only once it is registered with it, and importing
jmp_policy never imports Flax. So the registration waits for Flax: it runs at
once if `flax.serialization` is loaded already, else right after Flax loads
it, through a finder on `sys.meta_path` that answers for that one module and
removes itself. Orbax needs none of this: it reads the pytree.

The state dict of a loss scale holds its array leaves by field name
(`{"loss_scale": ..., "counter": ...}`; nothing for `NoOpLossScale` and
`StaticLossScale`, whose values are static); its hyperparameters come from the
target restored into, as Flax's own `DynamicScale` does.
"""

from __future__ import annotations

import dataclasses
import importlib.abc
import sys
import types
from typing import Any

import jax

from jmp_policy.core.loss_scale import DynamicLossScale, NoOpLossScale, StaticLossScale

_MODULE = "flax.serialization"
_LOSS_SCALES = (NoOpLossScale, StaticLossScale, DynamicLossScale)


def _fields(scale: Any) -> list[tuple[str, Any]]:
    """`[(field name, value)]` of a loss scale's pytree children (a child absent
    from this instance, such as `overflows` without hysteresis, is None)."""
    children, _ = jax.tree_util.tree_flatten_with_path(scale, is_leaf=lambda x: x is not scale)
    return [(path[0].name, child) for path, child in children]


def _register(serialization: types.ModuleType) -> None:
    def to_state_dict(scale: Any) -> dict[str, Any]:
        fields = _fields(scale)
        return {name: serialization.to_state_dict(x) for name, x in fields if x is not None}

    def from_state_dict(target: Any, state: dict[str, Any]) -> Any:
        fields = _fields(target)
        names = [name for name, x in fields if x is not None]
        if set(state) != set(names):
            raise ValueError(
                f"The state dict of a {type(target).__name__} at "
                f"'{serialization.current_path()}' has the fields {sorted(state)}; the "
                f"target restored into has {sorted(names)} (a DynamicLossScale has "
                "'overflows' only with hysteresis > 1)."
            )
        restored = {
            name: serialization.from_state_dict(x, state[name], name=name)
            for name, x in fields
            if x is not None
        }
        if not restored:
            return target
        # Through the constructor: the restored values are checked against
        # the target's own bounds (a scale above its `max_loss_scale`, a
        # counter past its `period`) here, not at the first `adjust`.
        try:
            return dataclasses.replace(target, **restored)
        except ValueError as e:
            raise ValueError(
                f"The {type(target).__name__} restored at '{serialization.current_path()}' "
                f"does not fit the target restored into: {e}"
            ) from None

    for cls in _LOSS_SCALES:
        if not serialization.is_serializable(cls):
            serialization.register_serialization_state(cls, to_state_dict, from_state_dict)


class _RegisterAfterLoading(importlib.abc.Loader):
    """Flax's own loader for `flax.serialization`, then the registration."""

    def __init__(self, loader: Any):
        self._loader = loader

    def create_module(self, spec: Any) -> types.ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        _register(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_filename, ...
        return getattr(self._loader, name)


class _WaitForFlax(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        sys.meta_path.remove(self)  # One module, once.
        for finder in sys.meta_path:
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _RegisterAfterLoading(spec.loader)
                return spec
        return None


def register_when_flax_loads() -> None:
    """Registers the loss scales with `flax.serialization` now if it is loaded,
    else when it is."""
    if _MODULE in sys.modules:
        _register(sys.modules[_MODULE])
    elif not any(isinstance(f, _WaitForFlax) for f in sys.meta_path):
        sys.meta_path.insert(0, _WaitForFlax())
