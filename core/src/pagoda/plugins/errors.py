"""What goes wrong with plugins, as exceptions a user can act on."""

from __future__ import annotations


class PluginError(Exception):
    """Base of every plugin error."""


class PluginLoadError(PluginError):
    """A plugin failed to load, or what it registered failed to import, and a user asked for it.

    The original exception is the ``__cause__``; its traceback is also in the message.
    """


class UnknownNameError(PluginError, LookupError):
    """A name that no loaded plugin registered. The message lists the known names."""


class DuplicateNameError(PluginError):
    """Two plugins registered the same name and neither (or both) said it overrides."""


class PluginAPIVersionError(PluginError):
    """A plugin was written for another plugin API version than this Pagoda provides."""


class PluginSelectionError(PluginError, ValueError):
    """Nothing registered supports what was asked (device, dtype, head size, ...)."""


class RequestRejectedError(ValueError):
    """An ``admit_request`` hook turned a request away; the message is the plugin's reason."""
