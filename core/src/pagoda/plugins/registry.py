"""Registries: names to lazy targets, for one kind of thing, and what each plugin's loading did."""

from __future__ import annotations

import difflib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pluggy

from pagoda.plugins.errors import (
    DuplicateNameError,
    PluginError,
    PluginLoadError,
    UnknownNameError,
)
from pagoda.utils import resolve_target


@dataclass
class PluginRecord:
    """One plugin as discovery saw it: where it comes from, what it provides, how it went."""

    name: str  # the entry-point name (``pagoda`` for the core's own plugin)
    distribution: str | None  # the installed distribution that declares it, if any
    version: str | None
    source: str  # the entry point's value or the module's name
    status: str = "pending"  # loaded | failed | disabled
    reason: str | None = None  # why it is disabled or failed, one line
    exception: BaseException | None = None
    traceback: str | None = None
    plugin: Any = None
    registers: dict[str, list[str]] = field(default_factory=dict)  # kind -> names
    hooks: list[str] = field(default_factory=list)  # seam hooks it implements

    @property
    def label(self) -> str:
        """``name (distribution version)``, for messages."""
        if self.distribution is None:
            return f"{self.name!r} (module {self.source})"
        return f"{self.name!r} ({self.distribution} {self.version})"

    def fail(self, exc: BaseException, reason: str | None = None) -> None:
        self.status = "failed"
        self.exception = exc
        self.reason = reason or f"{type(exc).__name__}: {exc}"
        self.traceback = "".join(traceback.format_exception(exc)).rstrip()


@dataclass(frozen=True)
class Registration:
    kind: str
    name: str
    target: str | Callable[..., Any]
    plugin: PluginRecord
    override: bool = False


def _noun(kind: str) -> str:
    """``attention_backends`` -> ``attention backend``, ``offload_policies`` -> ``offload
    policy``."""
    noun = kind.replace("_", " ")
    return noun[:-3] + "y" if noun.endswith("ies") else noun.removesuffix("s")


class Registry:
    """The names of one kind (``attention_backends``, ``executors``, ...) and their targets.

    ``get(name)`` imports and returns the target, or raises an error that says why not: the name
    is unknown (the message lists the known ones and any plugin that failed to load), two plugins
    registered it, or the plugin that registered it failed (the message holds its traceback).
    """

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.noun = _noun(kind)
        self.entries: dict[str, Registration] = {}
        self.conflicts: dict[str, list[Registration]] = {}
        # Names that plugins which failed after import would have registered.
        self.failed_names: dict[str, PluginRecord] = {}
        # Every plugin that failed or is disabled: it may have provided an unknown name.
        self.unavailable: list[PluginRecord] = []

    @classmethod
    def build(
        cls,
        kind: str,
        registrations: list[Registration],
        failed_names: dict[str, PluginRecord],
        unavailable: list[PluginRecord],
    ) -> Registry:
        reg = cls(kind)
        by_name: dict[str, list[Registration]] = {}
        for r in registrations:
            by_name.setdefault(r.name, []).append(r)
        for name, regs in by_name.items():
            overriders = [r for r in regs if r.override]
            if len(regs) == 1:
                reg.entries[name] = regs[0]
            elif len(overriders) == 1:
                reg.entries[name] = overriders[0]
            else:
                reg.conflicts[name] = regs
        reg.failed_names = dict(failed_names)
        reg.unavailable = list(unavailable)
        return reg

    def names(self) -> list[str]:
        """The names that can be selected."""
        return sorted(self.entries)

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def registration(self, name: str) -> Registration:
        """Who registered ``name`` and with what target; raises like :meth:`get`."""
        entry = self.entries.get(name)
        if entry is not None:
            return entry
        if name in self.conflicts:
            raise DuplicateNameError(self.conflict_message(name))
        record = self.failed_names.get(name)
        if record is not None:
            raise PluginLoadError(
                f"{self.noun} {name!r} is unavailable: plugin {record.label} failed to load: "
                f"{record.reason}\n{record.traceback}"
            ) from record.exception
        raise self._unknown(name)

    def get(self, name: str) -> Any:
        """Import and return the target registered as ``name``."""
        entry = self.registration(name)
        try:
            return resolve_target(entry.target)
        except Exception as e:
            tb = "".join(traceback.format_exception(e)).rstrip()
            raise PluginLoadError(
                f"{self.noun} {name!r} from plugin {entry.plugin.label} could not be imported "
                f"from {entry.target!r}: {type(e).__name__}: {e}\n{tb}"
            ) from e

    def conflict_message(self, name: str) -> str:
        who = ", ".join(r.plugin.label for r in self.conflicts[name])
        return (
            f"{self.noun} {name!r} is registered by more than one plugin: {who}. Uninstall one, "
            "disable one with PAGODA_DISABLE_PLUGINS, or have the one that should win pass "
            "register(..., override=True)"
        )

    def _unknown(self, name: str) -> PluginError:
        known = ", ".join(self.names()) or "none"
        msg = f"unknown {self.noun} {name!r}; available: {known}"
        close = difflib.get_close_matches(name, self.names(), n=1)
        if close:
            msg += f" (did you mean {close[0]!r}?)"
        # A plugin named like the thing asked for is the likely provider: put it first.
        records = sorted(self.unavailable, key=lambda r: r.name != name)
        failed = [r for r in records if r.status == "failed"]
        disabled = [r for r in records if r.status == "disabled"]
        for r in disabled:
            msg += f"\nplugin {r.label} was not loaded ({r.reason}) and may provide it"
        for r in failed:
            msg += (
                f"\nplugin {r.label} failed to load and may provide it: {r.reason}\n{r.traceback}"
            )
        err = UnknownNameError(msg)
        if failed:
            err.__cause__ = failed[0].exception
        return err


@dataclass
class PluginState:
    """A process's loaded plugins: the plugin manager, a record per plugin, the registries."""

    pm: pluggy.PluginManager
    records: list[PluginRecord]
    registries: dict[str, Registry]
    # Objects registered in this process (not modules): a reload registers them again.
    local: list[tuple[Any, str]] = field(default_factory=list)
