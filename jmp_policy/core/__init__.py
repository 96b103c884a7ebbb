"""The core: jax, numpy and optax only."""
