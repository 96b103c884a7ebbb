"""Whether this CPython thrashes its frame-stack chunks, and what `stack_room` saves.

CPython 3.11+ keeps frames in chunks and frees a chunk when its first frame
returns. A loop calling a small function from the last frame that fits a
chunk maps and unmaps a chunk on every call. This script calls a one-line
function 200,000 times from each depth of 0 to 600 frames and prints the
worst depth's minor page faults and time against the median depth's, and
the same loop started through `jmp_policy.engine.stack_room.call_with_room`
(a fresh, larger chunk) at that worst depth. No JAX: run it with each Python.

    python3.11 benchmarks/stack_room.py; python3.12 ...; python3.13 ...
    python benchmarks/stack_room.py --quick      # 20,000 calls per depth
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import resource
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

CALLS = 200_000


def _leaf() -> int:
    return 1


def _loop(calls: int) -> tuple[float, int]:
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    start = time.perf_counter()
    for _ in range(calls):
        _leaf()
    return time.perf_counter() - start, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults


def _at_depth(depth: int, run: Callable[[], tuple[float, int]]) -> tuple[float, int]:
    return run() if depth == 0 else _at_depth(depth - 1, run)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="stack_room", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20,000 calls per depth")
    calls = 20_000 if parser.parse_args(argv).quick else CALLS
    path = Path(__file__).resolve().parent.parent / "jmp_policy" / "engine" / "stack_room.py"
    spec = importlib.util.spec_from_file_location("stack_room", path)
    assert spec is not None and spec.loader is not None, path
    stack_room = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(stack_room)  # Its file alone: no JAX imported.
    loop = functools.partial(_loop, calls)
    by_depth = {d: _at_depth(d, loop) for d in range(600)}
    worst = max(by_depth, key=lambda d: by_depth[d][1])
    median_time = statistics.median(t for t, _ in by_depth.values())
    median_faults = statistics.median(f for _, f in by_depth.values())
    roomy = _at_depth(worst, lambda: stack_room.call_with_room(loop))
    version = ".".join(map(str, sys.version_info[:3]))
    worst_time, worst_faults = by_depth[worst]
    print(
        f"CPython {version}, {calls} calls of a one-line function per depth 0-599:\n"
        f"  median depth  {1e3 * median_time:7.1f} ms  {median_faults:8.0f} minor page faults\n"
        f"  worst depth   {1e3 * worst_time:7.1f} ms  {worst_faults:8d}  (depth {worst})\n"
        f"  worst depth through call_with_room  {1e3 * roomy[0]:7.1f} ms  {roomy[1]:8d}\n"
        f"  thrashes: {worst_faults > 10 * max(median_faults, 1) + calls // 20}"
    )


if __name__ == "__main__":
    main()
