"""Room on CPython's frame stack for tracing a whole model.

CPython (3.11 and later) keeps Python frames in chunks, 16 KiB at first,
and unmaps a chunk as soon as the first frame in it returns. A function
called again and again from just below a chunk's end maps a new chunk, and
faults its pages in, on every call. Tracing a model calls small helpers
tens of thousands of times (a framework's `__setattr__` and `isinstance`
checks), so how fast it traces depends, to the frame, on the depth the
trace starts at: MaxText's decoder traced under `with_policy` took 1.46x
its own bf16 config's trace (35,000 minor page faults against 300), and
1.03x traced from a fresh chunk (about 700).

`call_with_room(fn, *args)` calls `fn` from a frame that opens a chunk of
its own, with about 250 KiB left for the frames `fn` makes.

Measured by `benchmarks/stack_room.py` (a one-line function called 200,000
times from each depth of 0 to 599 frames): CPython 3.11.7, 3.12.1 and
3.13.0 all thrash, one minor page fault a call and about 200x the median
depth's time at the worst depth, and none through `call_with_room`. Every
Python this package supports (3.11 and later) keeps frames so, so the room
is taken on each; `tests/test_stack_room.py` shows the thrash and its cure
on the running Python (and skips, saying so, on one that no longer thrashes).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

# A frame of this many local variables (8 bytes each) does not fit a 16 KiB
# chunk: CPython doubles the new chunk's size until it does, to 512 KiB.
_LOCALS = 1 << 15


def _call(fn: Callable[..., Any], args: tuple) -> Any:
    return fn(*args)


@functools.cache
def _roomy_call() -> Callable[..., Any]:
    """`_call` with `_LOCALS` more (unused) local variables in its frame."""
    code = _call.__code__
    names = code.co_varnames + tuple(f"_room{i}" for i in range(_LOCALS))
    return types.FunctionType(code.replace(co_varnames=names, co_nlocals=len(names)), {})


def call_with_room(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)`, called at the start of a fresh frame-stack chunk."""
    return _roomy_call()(fn, args)
