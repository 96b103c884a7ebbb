"""What the CPU form of half-precision products costs (see the module)."""

from jmp_policy.app.benchmarks.cpu_dot import main

if __name__ == "__main__":
    raise SystemExit(main())
