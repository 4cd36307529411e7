"""Plugin hooks, discovery and the registries they fill."""

from pagoda.plugins.hookspecs import hookimpl, hookspec
from pagoda.plugins.manager import Registry, get_plugin_manager, get_registry

__all__ = ["hookimpl", "hookspec", "Registry", "get_plugin_manager", "get_registry"]
