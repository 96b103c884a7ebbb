"""FP8 training side by side: jmp_policy per tensor and per row, Qwix QT, Flax fp8_ops (see the module)."""

from jmp_policy.app.benchmarks.fp8 import main

if __name__ == "__main__":
    raise SystemExit(main())
