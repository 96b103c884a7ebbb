"""How long the train step takes to lower, relative to Flax's hand-written bf16 model (see the module)."""

from jmp_policy.app.benchmarks.lowering import main

if __name__ == "__main__":
    raise SystemExit(main())
