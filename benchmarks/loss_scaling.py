"""Step time of `loss_scaled` against plain optax and the alternatives (see the module)."""

from jmp_policy.app.benchmarks.loss_scaling import main

if __name__ == "__main__":
    raise SystemExit(main())
