"""Pagoda's built-in tool-call and reasoning parsers, registered by name."""
