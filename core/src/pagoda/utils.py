"""Small helpers used across the engine."""

from __future__ import annotations

import importlib
from typing import Any


def resolve_target(target: Any) -> Any:
    """Resolve a lazy target: ``"package.module:Attr"`` is imported; anything else is returned."""
    if not isinstance(target, str):
        return target
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"lazy target {target!r} must look like 'package.module:Name'")
    obj: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def cdiv(a: int, b: int) -> int:
    return -(-a // b)
