"""The example Transformer's train step under several precision set-ups (see the module)."""

from jmp_policy.app.benchmarks.transformer import main

if __name__ == "__main__":
    raise SystemExit(main())
