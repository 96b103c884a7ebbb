"""The one path that runs a call again after it failed.

A call runs again only where it was refused in a way a second form of it is
known to answer: JAX refusing a float32 program the half values it is given
(`interpreter.traced_widened_where_refused`), a third party's model refusing
the policy's dtypes in its own fields (`casting.run_as_written`). Every such
run goes through `run_again_where_refused`: once, said in a `RuntimeWarning`,
and where the second form fails too, the first failure is raised as it came.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_again_where_refused(
    run: Callable[[], T],
    again: Callable[[Exception], T],
    *,
    refused: Callable[[Exception], bool],
    says: Callable[[Exception], str],
    note: str | None = None,
) -> T:
    """`run()`, or where it raises an error `refused` accepts, `again()`.

    Args:
      run: the call as the policy has it.
      again: the call in its second form, run once, given `run`'s error.
      refused: whether an error of `run` is one `again` answers; any other
        is raised as it came.
      says: the warning's text, from `run`'s error, where `again` succeeds.
      note: added to `run`'s error where `again` fails too (None: raised
        unchanged, as a model's own error is).

    Raises:
      `run`'s error, where it is not refused or `again` fails too.
    """
    try:
        return run()
    except Exception as e:
        if not refused(e):
            raise
        error = e
    try:
        out = again(error)
    except Exception:
        failed = True
    else:
        failed = False
    if failed:
        if note is not None:
            error.add_note(note)
        raise error  # Outside the handlers: its cause and context as they were.
    warnings.warn(says(error), RuntimeWarning, stacklevel=3)
    return out
