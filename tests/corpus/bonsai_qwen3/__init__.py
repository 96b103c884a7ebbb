"""jax-ml/bonsai's Qwen3 (`bonsai/models/qwen3/modeling.py`), vendored unchanged
as test data under its Apache 2.0 licence (LICENSE, beside it), from commit
36284254cf738d99c1c5d1e3a292d27656a0a365 of https://github.com/jax-ml/bonsai."""
