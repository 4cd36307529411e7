"""Pagoda's version: a leaf, so that the plugin kernel can report it without the package face."""

__version__ = "0.1.0"
