"""The Flax integrations (linen, NNX) and their shared rule engine: the only place Flax is imported."""
