"""Renders one chat template that a request brought, in a process of its own.

Run as a script (``python -I template_worker.py``), never imported by the server: it reads
``{"template", "context", "max_chars", "max_memory_bytes"}`` as JSON on stdin and writes
``{"text": ...}`` or ``{"error": ...}`` on stdout. Jinja's immutable sandbox keeps the template
away from Python's internals; the address-space limit and the output limit here, and the parent's
deadline (it kills this process), bound what the template can make the machine do.
"""

from __future__ import annotations

import json
import resource
import sys
from datetime import datetime
from typing import Any


def render(template: str, context: dict[str, Any], max_chars: int) -> str:
    # NOTE: jinja2 loads only in the template worker.
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, **kw: Any) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    parts: list[str] = []
    size = 0
    for part in env.from_string(template).generate(**context):
        size += len(part)
        if size > max_chars:
            raise OverflowError(f"the rendered prompt exceeds {max_chars} characters")
        parts.append(part)
    return "".join(parts)


def main() -> None:
    job = json.load(sys.stdin)
    limit = int(job["max_memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    try:
        out: dict[str, str] = {"text": render(job["template"], job["context"], job["max_chars"])}
    except MemoryError:
        out = {"error": f"rendering needs more than {limit >> 20} MiB of memory"}
    except Exception as e:  # the template's own error, shown to the client
        out = {"error": f"{type(e).__name__}: {e}"}
    json.dump(out, sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()
