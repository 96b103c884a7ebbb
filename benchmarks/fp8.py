"""FP8 and FP4 training side by side: jmp_policy, Qwix QT, Flax fp8_ops (see the module)."""

from jmp_policy.app.benchmarks.fp8 import main

if __name__ == "__main__":
    raise SystemExit(main())
