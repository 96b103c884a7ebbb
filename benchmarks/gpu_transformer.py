"""The Transformer LM train step sized for an H100/H200: tokens/s and MFU per precision variant.

A thin script: the benchmark is `jmp_policy/app/benchmarks/gpu_transformer.py`
(its docstring says what it measures). On a CPU it runs the tiny size.

Usage::

    python benchmarks/gpu_transformer.py [--size auto|gpu|tiny] [--budget-s S] [--out DIR]
    benchmarks/gpu.sh          # the whole GPU measurement, < 8 minutes
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # this source tree first

from jmp_policy.app.benchmarks.gpu_transformer import main

if __name__ == "__main__":
    sys.exit(main())
