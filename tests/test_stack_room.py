"""`call_with_room`: a whole model's trace starts at a fresh frame-stack chunk."""

from __future__ import annotations

import types

import pytest

from jmp_policy.engine.stack_room import call_with_room

resource = pytest.importorskip("resource")  # The page-fault count: not on Windows.


def test_calls_pass_their_arguments_results_and_exceptions_through():
    assert call_with_room(lambda a, b: (a, b), 1, "x") == (1, "x")
    error = KeyError("the user's own")

    def raises():
        raise error

    with pytest.raises(KeyError) as caught:
        call_with_room(raises)
    assert caught.value is error


def _small() -> None:
    pass


# A leaf whose frame (256 more words) is larger than a step of the recursion
# below: at some depth it starts just past a chunk's end, whatever the alignment.
_code = _small.__code__
_names = tuple(f"_{i}" for i in range(256))
_leaf = types.FunctionType(_code.replace(co_varnames=_names, co_nlocals=len(_names)), {})


def _calls_at_depth(depth: int, calls: int) -> None:
    if depth:
        return _calls_at_depth(depth - 1, calls)
    for _ in range(calls):
        _leaf()


def _most_page_faults(run) -> int:
    """The most minor page faults `run(depth)` makes at any of 400 depths
    (more than two 16 KiB chunks of this recursion's frames)."""
    most = 0
    for depth in range(400):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        run(depth)
        most = max(most, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    return most


def test_a_hot_call_at_any_depth_of_a_trace_maps_no_memory():
    calls = 2000
    plain = _most_page_faults(lambda depth: _calls_at_depth(depth, calls))
    if plain < calls // 2:
        pytest.skip(f"this CPython keeps its frame chunks ({plain} page faults at most)")
    # Where a chunk ends, each call mapped a new chunk: with room, none (the
    # room's own chunk is about 80 pages; its frame is made at the first call).
    call_with_room(_small)
    roomy = _most_page_faults(lambda depth: call_with_room(_calls_at_depth, depth, calls))
    assert roomy < calls // 10, (plain, roomy)
