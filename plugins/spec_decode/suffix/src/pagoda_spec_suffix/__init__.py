"""Suffix-tree speculative proposer for Pagoda (``speculative.method: suffix``)."""
