"""The plugin kernel: hooks, discovery and the registries they fill. See ``docs/plugins.md``.

Its hook specs name only lower floors (config, the leaves, sample) and Protocols; importing it
installs the check of plugin settings into the configuration (``pagoda.plugins.settings``).
"""

from pagoda.config import plugin_settings
from pagoda.plugins.errors import (
    DuplicateNameError,
    PluginAPIVersionError,
    PluginError,
    PluginLoadError,
    PluginSelectionError,
    RequestRejectedError,
    UnknownNameError,
)
from pagoda.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl, hookspec
from pagoda.plugins.local import plugin_registered, register_plugin, unregister_plugin
from pagoda.plugins.manager import (
    get_plugin_manager,
    get_registry,
    load_plugins,
    plugin_records,
    reload_plugins,
)
from pagoda.plugins.registry import PluginRecord, Registry
from pagoda.plugins.selection import select
from pagoda.plugins.settings import RegistrySettings

# NOTE: the configuration checks plugin settings through this; it never imports the registry.
plugin_settings.install_checker(RegistrySettings())

__all__ = [
    "PLUGIN_API_VERSION",
    "DuplicateNameError",
    "PluginAPIVersionError",
    "PluginError",
    "PluginLoadError",
    "PluginRecord",
    "PluginSelectionError",
    "Registry",
    "RequestRejectedError",
    "UnknownNameError",
    "get_plugin_manager",
    "get_registry",
    "hookimpl",
    "hookspec",
    "load_plugins",
    "plugin_records",
    "plugin_registered",
    "register_plugin",
    "reload_plugins",
    "select",
    "unregister_plugin",
]
