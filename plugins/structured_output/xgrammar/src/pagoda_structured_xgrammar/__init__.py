"""Pagoda's xgrammar grammar backend (``structured_output.backend: xgrammar``)."""
