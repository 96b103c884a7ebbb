"""Per-module rules, shared by the linen and NNX integrations.

A rule maps a module class or a module path pattern to a policy. Rules are
checked once, when the policy is applied, and matched per module by
`specificity`: a path pattern beats any class; among patterns the one with
more literal characters wins; among classes the nearest in the module's MRO.
"""

from __future__ import annotations

import fnmatch
from typing import Mapping

from jmp_policy.policy import Policy, get_policy

Rules = Mapping[type | str, Policy | str]
CompiledRules = list[tuple[type | str, Policy]]


def compile_rules(rules: Rules | None, module_class: type, pattern_example: str) -> CompiledRules:
    """Validates `rules` and parses their policy specs.

    Raises:
      TypeError: if `rules` is not a mapping, a key is neither a subclass of
        `module_class` nor a non-empty string, or a value is neither a
        `Policy` nor a string.
      ValueError: if a policy spec is malformed.
    """
    if rules is None:
        return []
    if not isinstance(rules, Mapping):
        raise TypeError(
            "rules must be a mapping of module class or module path pattern to "
            f"policy, got {rules!r}."
        )
    base = f"{module_class.__module__.removesuffix('.module')}.{module_class.__name__}"
    compiled = []
    for key, value in rules.items():
        is_class = isinstance(key, type) and issubclass(key, module_class)
        if not (is_class or (isinstance(key, str) and key)):
            raise TypeError(
                f"rules keys must be a {base} subclass or a non-empty module path "
                f"pattern such as {pattern_example!r}, got {key!r}."
            )
        if not isinstance(value, (Policy, str)):
            raise TypeError(
                f"rules[{key!r}] must be a Policy or a policy spec string such as "
                f"'f32' or 'p=f32,c=bf16,o=f32', got {value!r}."
            )
        compiled.append((key, get_policy(value)))
    return compiled


def specificity(key: type | str, module: object, path: str) -> tuple[int, int] | None:
    """How well a rule matches a module at `path` (higher wins), or None if not at all."""
    if isinstance(key, str):
        if not fnmatch.fnmatchcase(path, key):
            return None
        # A path beats any class; among paths, more literal characters win.
        return (1, sum(c not in "*?[]" for c in key))
    if not isinstance(module, key):
        return None
    # Among classes, the one nearest in the module's MRO wins.
    return (0, -type(module).__mro__.index(key))
