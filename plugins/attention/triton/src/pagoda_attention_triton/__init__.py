"""Pagoda attention backend in Triton (``attention.backend: triton``)."""
