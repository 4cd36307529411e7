"""Structured output: constraints (JSON schema, regex, choice, grammar) compiled by a grammar
backend plugin, applied to the logits as one token bitmask per step.

- :mod:`~pagoda.structured_output.backend`: the contract a grammar backend implements.
- :mod:`~pagoda.structured_output.manager`: compiling off the engine loop, the grammar cache.
- :mod:`~pagoda.structured_output.mask`: one step's bitmask, a ``sample.metadata.LogitsMask``.
- :mod:`~pagoda.structured_output.remote`: the matchers in a process of their own.
- :mod:`~pagoda.structured_output.runner`: the runner's matchers and each step's bitmask.

Floor: contracts and features. Imports the plugin kernel, sample, derived model info, config and
the leaves; the scheduler and the worker each hold what they need of it.
"""
