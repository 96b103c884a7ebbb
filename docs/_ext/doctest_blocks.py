"""A griffe extension: docstrings' `>>>` examples render as code.

The package's docstrings put their runnable examples after Args/Returns/Raises
without an `Examples:` heading (pytest collects them as doctests). To the
Markdown renderer a `>>>` line is a nested block quote and `x["a"]` a link, so
each run of `>>>` lines and their output (up to the next blank line) is
fenced as a `pycon` block before mkdocstrings renders the docstring.
"""

from __future__ import annotations

from typing import Any

import griffe


def fence_doctests(text: str) -> str:
    """Wraps every doctest block of `text` (a `>>>` line up to a blank line) in a fence."""
    out: list[str] = []
    in_fence = in_doctest = False
    indent = ""
    for line in text.splitlines():
        stripped = line.lstrip()
        if in_doctest and not stripped:
            out.append(f"{indent}```")
            in_doctest = False
        elif not in_doctest and stripped.startswith("```"):
            in_fence = not in_fence
        elif not in_doctest and not in_fence and stripped.startswith(">>>"):
            indent = line[: len(line) - len(stripped)]
            out.append(f"{indent}```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestBlocks(griffe.Extension):
    """Fences the doctest blocks of every docstring griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
