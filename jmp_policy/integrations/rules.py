"""Per-module rules, one engine for the linen and NNX integrations.

A rule maps a module class or a module path pattern to a policy. `RuleSet`
checks the rules once, when the policy is applied; `RuleSet.policy_for`
picks a module's policy: a path pattern (`fnmatch`, `*` also matches `/`)
beats any class, among patterns the one with more literal characters wins,
among classes the nearest in the module's MRO, remaining ties go to the rule
listed first, and a module that no rule matches inherits its parent's policy.

A path pattern that matches no module of the model is an error in both
integrations (`RuleSet.check_all_matched`): it is almost always a typo, and
a typo in a rule that keeps the logits layer in float32 would otherwise
change nothing, silently.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping

from jmp_policy.core.policy import Policy, get_policy

PolicyLike = Policy | str
Rules = Mapping[type | str, PolicyLike]


class RuleSet:
    """Validated rules, matched per module by `policy_for`.

    Args:
      rules: `{module class or path pattern: Policy or spec}`, or None.
      module_class: the base class rule keys must subclass (`nn.Module`, `nnx.Module`).
      pattern_example: a path in the integration's notation, for error messages.

    Raises:
      TypeError: if `rules` is not a mapping, a key is neither a subclass of
        `module_class` nor a non-empty string, or a value is neither a
        `Policy` nor a string.
      ValueError: if a policy spec is malformed.
    """

    def __init__(self, rules: Rules | None, module_class: type, pattern_example: str):
        self.rules: list[tuple[type | str, Policy]] = []
        if rules is None:
            return
        if not isinstance(rules, Mapping):
            raise TypeError(
                "rules must be a mapping of module class or module path pattern to "
                f"policy, got {rules!r}."
            )
        base = f"{module_class.__module__.removesuffix('.module')}.{module_class.__name__}"
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
            self.rules.append((key, get_policy(value)))

    @property
    def param_dtypes(self) -> set:
        """The param dtypes the rules name."""
        return {p.param_dtype for _, p in self.rules}

    @property
    def matmul_dtypes(self) -> set:
        """The matmul dtypes the rules name (None included)."""
        return {p.matmul_dtype for _, p in self.rules}

    def policy_for(
        self, module: object, path: str, inherited: Policy, matched: set[str] | None = None
    ) -> tuple[Policy, bool]:
        """`(policy, whether a rule named the module)` for `module` at `path`.

        The path patterns that match are added to `matched`.
        """
        best, best_score = inherited, None
        for key, policy in self.rules:
            score = _specificity(key, module, path)
            if score is None:
                continue
            if isinstance(key, str) and matched is not None:
                matched.add(key)
            if best_score is None or score > best_score:
                best, best_score = policy, score  # Ties: the rule listed first wins.
        return best, best_score is not None

    def check_all_matched(
        self, matched: set[str], paths: Iterable[str], root: object | None
    ) -> None:
        """Raises if a path pattern matched none of the model's modules.

        Raises:
          ValueError: naming the pattern and some of the module paths.
        """
        unmatched = [k for k, _ in self.rules if isinstance(k, str) and k not in matched]
        if not unmatched:
            return
        shown = sorted({p for p in paths if p}, key=lambda p: (p.count("/"), p))[:12]
        name = type(root).__name__ if root is not None else "model"
        where = (
            f"here {shown}"
            if shown
            # A leaf module (a Dense, an nnx.Linear) has no submodule a pattern could name.
            else f"and this {name} has no submodules: give a class rule (e.g. "
            f"{{{name}: policy}}) or change the policy itself"
        )
        raise ValueError(
            f"rules path pattern {unmatched[0]!r} matches no module of the model; "
            f"patterns are fnmatch patterns over '/'-joined module paths, {where}."
        )


def input_names(keep_inputs: str | Iterable[str]) -> frozenset[str]:
    """The argument names of `keep_inputs` (one name or several), checked.

    Raises:
      TypeError: if they are not non-empty strings.
    """
    names: tuple = (keep_inputs,) if isinstance(keep_inputs, str) else ()
    if not names:
        try:
            names = tuple(keep_inputs)
        except TypeError:
            names = (None,)
    if not all(isinstance(n, str) and n for n in names):
        raise TypeError(
            "keep_inputs must be an argument name or a sequence of argument names of the "
            f"model's __call__ (or method=), such as ('timesteps',), got {keep_inputs!r}."
        )
    return frozenset(names)


def _specificity(key: type | str, module: object, path: str) -> tuple[int, int] | None:
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
