"""The reference table of every configuration key, as ``docs/configuration.md`` shows it (a test
keeps the two equal; regenerate with ``python -m pagoda.config.reference``)."""

from __future__ import annotations

import json
import typing
from typing import Any

from pagoda.config.loader import ENV_DELIMITER, ENV_PREFIX, flat_names, sections


def _type_name(annotation: Any) -> str:
    args = typing.get_args(annotation)
    literals = [a for a in args if isinstance(a, str)]
    if typing.get_origin(annotation) is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in literals)
    if typing.get_origin(annotation) is list:
        return f"list of {_type_name(args[0])}"
    if typing.get_origin(annotation) is dict:
        return f"map of {_type_name(args[0])} to {_type_name(args[1])}"
    if args:
        return " \\| ".join(_type_name(a) for a in args)
    return "null" if annotation is type(None) else annotation.__name__


def _range(field: Any) -> str:
    marks = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
    out = []
    for m in field.metadata:
        for attr, sign in marks.items():
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
    return f", {' and '.join(out)}" if out else ""


def reference_table() -> str:
    flags = {v: k for k, v in flat_names().items()}
    rows = [
        "| key | type | default | environment | flag | meaning |",
        "|---|---|---|---|---|---|",
    ]
    for section, model in sections().items():
        for key, field in model.model_fields.items():
            env = f"{ENV_PREFIX}{section}{ENV_DELIMITER}{key}".upper()
            flag = "--" + flags[(section, key)].replace("_", "-")
            rows.append(
                f"| `{section}.{key}` | {_type_name(field.annotation)}{_range(field)} | "
                f"`{json.dumps(field.get_default(call_default_factory=True))}` | `{env}` | "
                f"`{flag}` | {field.description or ''} |"
            )
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())
