"""The engine: the one place that wires everything from the configuration (engine core,
scheduler and its collaborators, executor), the engine-core process and its client, input and
output processing, and ``AsyncLLM``.

Floor: engine, above the executor. Only the faces (entrypoints, bench, testing) import it.
"""
