"""The ``pagoda plugins`` report: each plugin, where it comes from, what it provides, its status."""

from __future__ import annotations

import json

from pagoda.plugins.manager import load_plugins
from pagoda.plugins.registry import PluginRecord


def _provides(rec: PluginRecord) -> str:
    parts = [f"{kind}: {', '.join(names)}" for kind, names in rec.registers.items()]
    if rec.hooks:
        parts.append(f"hooks: {', '.join(rec.hooks)}")
    return "; ".join(parts) or "-"


def _status(rec: PluginRecord) -> str:
    if rec.status == "loaded":
        return "ok"
    return f"{rec.status}: {rec.reason}"


def conflicts() -> list[str]:
    """One line per name that more than one plugin registered."""
    out = []
    for registry in load_plugins().registries.values():
        for name in registry.conflicts:
            out.append(registry.conflict_message(name))
    return out


def format_plugins(fmt: str = "table") -> str:
    """Every plugin with its distribution, version, what it registers and its status; then the
    traceback of each plugin that failed and each duplicate name."""
    records = load_plugins().records
    if fmt == "json":
        return json.dumps(
            [
                {
                    "name": r.name,
                    "distribution": r.distribution,
                    "version": r.version,
                    "source": r.source,
                    "status": r.status,
                    "reason": r.reason,
                    "registers": r.registers,
                    "hooks": r.hooks,
                    "traceback": r.traceback,
                }
                for r in records
            ],
            indent=2,
        )
    rows = [("PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES")]
    for r in records:
        status = _status(r).splitlines()[0]
        rows.append((r.name, r.distribution or "-", r.version or "-", status, _provides(r)))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4] for row in rows]
    failed = [r for r in records if r.status == "failed"]
    for r in failed:
        lines += ["", f"plugin {r.label} failed to load:", r.traceback or r.reason or ""]
    dup = conflicts()
    if dup:
        lines += ["", *dup]
    return "\n".join(line.rstrip() for line in lines)


def has_problems() -> bool:
    """Whether a plugin failed to load or a name is registered twice."""
    return any(r.status == "failed" for r in load_plugins().records) or bool(conflicts())
