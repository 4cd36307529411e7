"""Pagoda's Ray executor (``parallel.executor: ray``)."""
