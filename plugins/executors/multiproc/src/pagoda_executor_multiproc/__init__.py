"""Pagoda's multiprocess executor (``parallel.executor: multiproc``)."""
