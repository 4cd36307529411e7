"""Chat templates in the server: the model's own, and one a request brings only when the operator
opted in (``server.trust_request_chat_template``).

A template is a program. The model's own comes with the model the operator chose; one in a request
comes from anyone who can reach the server (vLLM's CVE-2025-61620: a request template could burn
the server's CPU and memory). So a request's template is refused by default, and with the opt-in it
renders in a sandboxed Jinja environment inside a throw-away process, with a deadline, a memory
limit and a cap on its output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from pagoda.entrypoints.openai.errors import APIError

# Fields that carry a template, as they appear in a request (top level or in chat_template_kwargs).
TEMPLATE_FIELDS = ("chat_template",)

# apply_chat_template's own parameters: the server sets them, a request may not.
_RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)

_WORKER = Path(__file__).with_name("template_worker.py")
_MAX_MEMORY_BYTES = 1 << 30


def request_template(
    top_level: str | None, kwargs: dict[str, Any] | None, trusted: bool
) -> tuple[str | None, dict[str, Any]]:
    """The template a request brings (or None) and the rest of its ``chat_template_kwargs``;
    400 naming the field for a template when the operator did not opt in, or a reserved key."""
    rest = dict(kwargs or {})
    found: list[tuple[str, Any]] = []
    if top_level is not None:
        found.append(("chat_template", top_level))
    for name in TEMPLATE_FIELDS:
        if name in rest:
            found.append((f"chat_template_kwargs.{name}", rest.pop(name)))
    for key in rest:
        if key in _RESERVED_KWARGS:
            raise APIError(
                f"`chat_template_kwargs.{key}` is set by the server and cannot come from a request",
                param=f"chat_template_kwargs.{key}",
            )
    if not found:
        return None, rest
    field, template = found[0]
    if not trusted:
        raise APIError(
            f"`{field}` is refused: this server renders only the model's own chat template. "
            "An operator may allow request templates with --trust-request-chat-template.",
            param=field,
            code="chat_template_not_allowed",
        )
    if len(found) > 1 or not isinstance(template, str):
        raise APIError(f"`{field}` must be one string", param=field)
    return template, rest


class TemplateSandbox:
    """Renders request templates, each in a fresh ``python -I`` process that is killed at the
    deadline; at most ``max_concurrent`` at once (the others wait for a slot)."""

    def __init__(self, timeout_s: float, max_chars: int, max_concurrent: int = 2) -> None:
        self.timeout_s = timeout_s
        self.max_chars = max_chars
        self._slots = threading.BoundedSemaphore(max_concurrent)

    def render(self, template: str, context: dict[str, Any]) -> str:
        """The rendered text (blocking; call it off the event loop). A template that fails, runs
        past the deadline, needs too much memory or writes too much is a 400 naming the field."""
        job = {
            "template": template,
            "context": context,
            "max_chars": self.max_chars,
            "max_memory_bytes": _MAX_MEMORY_BYTES,
        }
        with self._slots:
            proc = subprocess.Popen(
                [sys.executable, "-I", str(_WORKER)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
            )
            try:
                out, _ = proc.communicate(json.dumps(job).encode(), timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                raise _refused(f"rendering took longer than {self.timeout_s:g} s") from None
        try:
            result = json.loads(out)
        except ValueError:
            raise _refused(f"the renderer stopped (exit status {proc.returncode})") from None
        if "error" in result:
            raise _refused(result["error"])
        return result["text"]


def _refused(why: str) -> APIError:
    return APIError(f"the request's chat template was stopped: {why}", param="chat_template")
