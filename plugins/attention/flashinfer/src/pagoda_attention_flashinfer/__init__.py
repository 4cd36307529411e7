"""Pagoda attention backend on FlashInfer (``attention.backend: flashinfer``)."""
