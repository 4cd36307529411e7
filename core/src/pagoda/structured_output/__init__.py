"""Structured output: constraints (JSON schema, regex, choice, grammar) compiled by a grammar
backend plugin, applied to the logits as one token bitmask per step.

- :mod:`~pagoda.structured_output.backend`: the contract a grammar backend implements.
- :mod:`~pagoda.structured_output.manager`: compiling off the engine loop, the grammar cache.
- :mod:`~pagoda.structured_output.runner`: the runner's matchers and each step's bitmask.
"""
