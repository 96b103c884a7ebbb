"""`jmp-policy bench`: runs the benchmarks shipped in `jmp_policy.app.benchmarks`.

Each benchmark runs in its own process (`python -m`), so one benchmark's
compiled programs and memory do not skew the next one's timings.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from collections.abc import Sequence

from jmp_policy.app import benchmarks

PROG = "jmp-policy"


def benchmark_names() -> list[str]:
    """The names of the benchmark modules, sorted."""
    return sorted(
        m.name for m in pkgutil.iter_modules(benchmarks.__path__) if not m.name.startswith("_")
    )


def run(names: Sequence[str], *, quick: bool = False) -> int:
    """Runs the named benchmarks one after the other; returns 0 if all succeeded, else 1."""
    failed = []
    for name in names:
        flag = ["--quick"] if quick else []
        print(f"== {name}{' --quick' if quick else ''} ==", flush=True)
        rc = subprocess.call([sys.executable, "-m", f"{benchmarks.__name__}.{name}", *flag])
        if rc:
            failed.append(f"{name} (exit {rc})")
        print(flush=True)
    if failed:
        print(f"{PROG} bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    print(f"{PROG} bench: {len(names)} benchmark(s) ran: {', '.join(names)}")
    return 0
