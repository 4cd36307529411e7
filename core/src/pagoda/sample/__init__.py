"""Sampling: per-step sampling metadata and state, the sampler, and its operations.

Floor: sample, above config and the leaves and below the plugin kernel. What it needs of a higher
floor it declares as a Protocol (``metadata.LogitsMask`` for structured output's bitmask).
"""
