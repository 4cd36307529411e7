"""Pooling: what a model's pooling config says (``config``), and the poolers that turn a
prompt's hidden states into embeddings, labels and scores (``ops``).

Features floor: it reads the model's files (``loader``) and the leaves; the engine, the
scheduler and the worker read it.
"""
