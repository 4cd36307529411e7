"""``<think>`` reasoning: DeepSeek-R1 (its template opens the tag in the prompt) and Qwen3 (the
model opens it; ``enable_thinking: false`` in ``chat_template_kwargs`` has the template close an
empty one, and the output is all content)."""

from __future__ import annotations

from pagoda.parsers import ThinkTagsParser


class DeepSeekR1ReasoningParser(ThinkTagsParser):
    starts_inside = True


class Qwen3ReasoningParser(ThinkTagsParser):
    starts_inside = False
