"""The reasoning parser contract: a model's output -> its reasoning (``reasoning_content``) and
its answer (``content``), whole or streamed.

One instance serves one output: :meth:`ReasoningParser.parse` once, or :meth:`ReasoningParser.feed`
for each streamed piece then :meth:`ReasoningParser.finish`. The streamed deltas concatenate to
what ``parse`` returns for the whole text. Content goes on to the tool parser, if any.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

from pagoda.plugins.manager import get_registry


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""


class ReasoningParser(ABC):
    """Splits an output into reasoning and content; registered through
    ``register_reasoning_parsers``."""

    @abstractmethod
    def parse(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None for a part that is absent."""

    @abstractmethod
    def feed(self, delta: str) -> ReasoningDelta:
        """Read the next piece of a streamed output; return what can be sent now."""

    @abstractmethod
    def finish(self) -> ReasoningDelta:
        """The stream has ended: return what was held back."""


def _held(text: str, marker: str) -> int:
    """Characters at the end of ``text`` that may begin ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ThinkTagsParser(ReasoningParser):
    """Reasoning between :attr:`start` and :attr:`end` tags at the start of the output.

    :attr:`starts_inside`: the chat template already wrote the start tag (DeepSeek-R1), so an
    output without the end tag is all reasoning; otherwise (Qwen3) an output that does not open
    with the start tag is all content.
    """

    start: ClassVar[str] = "<think>"
    end: ClassVar[str] = "</think>"
    starts_inside: ClassVar[bool] = False

    def __init__(self) -> None:
        self._text = ""
        self._sent = ReasoningDelta()  # lengths sent, as strings' lengths

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        """(reasoning, content) decidable from ``text`` so far."""
        lead = text.lstrip()
        body = text
        if not final and self.start.startswith(lead):
            return "", ""  # may still become the start tag
        if lead.startswith(self.start):
            body = lead[len(self.start) :]
        elif not self.starts_inside:
            return "", text
        end = body.find(self.end)
        if end >= 0:
            return body[:end], body[end + len(self.end) :]
        if final:
            return (body, "") if body or self.starts_inside else ("", "")
        return body[: len(body) - _held(body, self.end)], ""

    def parse(self, text: str) -> tuple[str | None, str | None]:
        reasoning, content = self._split(text, final=True)
        return reasoning or None, content or None

    def _delta(self, final: bool) -> ReasoningDelta:
        reasoning, content = self._split(self._text, final)
        out = ReasoningDelta(
            reasoning[len(self._sent.reasoning) :], content[len(self._sent.content) :]
        )
        self._sent = ReasoningDelta(reasoning, content)
        return out

    def feed(self, delta: str) -> ReasoningDelta:
        self._text += delta
        return self._delta(final=False)

    def finish(self) -> ReasoningDelta:
        return self._delta(final=True)


def reasoning_parser_class(name: str) -> type[ReasoningParser]:
    """The reasoning parser registered as ``name``; an error naming the available ones if none
    is."""
    return get_registry("reasoning_parsers").get(name)
