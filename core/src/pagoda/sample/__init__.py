"""Sampling: per-step sampling metadata and state, the sampler, and its operations.

Floor: sample, above config and the leaves and below the plugin kernel. The rejection sampler of
speculative decoding lives here too (``rejection.py``). What it needs of a higher
floor it declares as a Protocol (``metadata.LogitsMask`` for structured output's bitmask).
"""
