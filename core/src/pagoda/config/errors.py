"""The configuration's one error type (a leaf of ``pagoda.config``)."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type or out of range; the message names
    each key and the source it came from."""
