"""The ``pagoda plugins`` report: each plugin, where it comes from, what it provides, its status."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

from pagoda.plugins.manager import load_plugins
from pagoda.plugins.registry import PluginRecord

# The head size the "runs here" check asks about (most models' 64 or 128: ask for both).
_HEAD_SIZES = (64, 128)


@dataclass
class BackendCheck:
    """Whether an attention backend can run on this machine, and why not."""

    name: str
    plugin: str
    priority: int | None
    runs_here: bool
    reason: str  # "" when it runs; else the missing libraries and its ``supports`` answer


def _machine() -> tuple[object, object]:
    """The device and dtype an engine on this machine would use by default."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    if torch.cuda.is_available():
        return torch.device("cuda", 0), torch.bfloat16
    return torch.device("cpu"), torch.float32


def check_attention_backends() -> list[BackendCheck]:
    """Each registered attention backend, asked whether it runs here: its ``supports`` answer
    for this machine's device and default dtype, and the libraries of its ``requires`` that are
    not installed."""
    state = load_plugins()
    registry = state.registries.get("attention_backends")
    if registry is None:
        return []
    device, dtype = _machine()
    where = f"{device.type}, {str(dtype).removeprefix('torch.')}"
    out = []
    for name in registry.names():
        plugin = registry.registration(name).plugin.name
        try:
            cls = registry.get(name)
        except Exception as e:
            first = str(e).splitlines()[0] if str(e) else type(e).__name__
            out.append(BackendCheck(name, plugin, None, False, f"cannot import: {first}"))
            continue
        reasons = []
        missing = [m for m in getattr(cls, "requires", ()) if importlib.util.find_spec(m) is None]
        if missing:
            reasons.append(f"{', '.join(missing)} not installed")
        try:
            ok = any(cls.supports(device, dtype, h) for h in _HEAD_SIZES)
        except Exception as e:
            ok = False
            reasons.append(f"supports() raised {type(e).__name__}: {e}")
        else:
            if not ok:
                reasons.append(f"supports({where}) is False")
        runs = ok and not missing
        out.append(
            BackendCheck(name, plugin, getattr(cls, "priority", None), runs, "; ".join(reasons))
        )
    return out


def format_backends(checks: list[BackendCheck]) -> list[str]:
    """The table of attention backends: priority, and whether each runs on this machine."""
    device, dtype = _machine()
    where = f"{device.type}, {str(dtype).removeprefix('torch.')}"
    rows = [("ATTENTION BACKEND", "PLUGIN", "PRIORITY", f"RUNS HERE ({where})")]
    for c in checks:
        verdict = "yes" if c.runs_here else f"no: {c.reason}"
        prio = "-" if c.priority is None else str(c.priority)
        rows.append((c.name, c.plugin, prio, verdict))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:3], widths)) + "  " + row[3] for row in rows]


def format_model_impls() -> list[str]:
    """The table of registered model impls and who registers them (imports none of them)."""
    registry = load_plugins().registries.get("model_impls")
    if registry is None or not registry.names():
        return []
    rows = [("MODEL IMPL", "PLUGIN", "TARGET")]
    for name in registry.names():
        entry = registry.registration(name)
        target = entry.target if isinstance(entry.target, str) else repr(entry.target)
        rows.append((name, entry.plugin.name, target))
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    return ["  ".join(c.ljust(w) for c, w in zip(row[:2], widths)) + "  " + row[2] for row in rows]


def _provides(rec: PluginRecord) -> str:
    parts = [f"{kind}: {', '.join(names)}" for kind, names in rec.registers.items()]
    if rec.hooks:
        parts.append(f"hooks: {', '.join(rec.hooks)}")
    return "; ".join(parts) or "-"


def _status(rec: PluginRecord) -> str:
    """``loaded``, ``failed: <reason>`` or ``disabled: <reason>`` (``PluginRecord.status``)."""
    if rec.status == "loaded" or not rec.reason:
        return rec.status
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
    checks = check_attention_backends()
    if fmt == "json":
        runs = {c.name: {"runs_here": c.runs_here, "reason": c.reason or None} for c in checks}
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
                    "attention_backends": {
                        n: runs[n] for n in r.registers.get("attention_backends", []) if n in runs
                    },
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
    if checks:
        lines += ["", *format_backends(checks)]
    impls = format_model_impls()
    if impls:
        lines += ["", *impls]
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
