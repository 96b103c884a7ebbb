"""The Flax integrations (linen, NNX) and their shared rule engine.

The only place Flax is imported.
"""
