"""Per-request sampling settings, with vLLM's names and meanings."""

from __future__ import annotations

import dataclasses
import json as _json
from dataclasses import dataclass, field
from typing import Any

_GREEDY_EPS = 1e-5


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, with vLLM's names: exactly one of

    - ``json``: a JSON schema (a dict, or its JSON text); the output is one JSON value it accepts;
    - ``regex``: the output fully matches this regular expression;
    - ``choice``: the output is one of these strings;
    - ``grammar``: an EBNF grammar (GBNF style, root rule ``root``) the output is a sentence of;
    - ``json_object=True``: the output is any JSON object;
    - ``structural_tag``: an xgrammar structural tag (its JSON text): free text, except that
      what follows a trigger (a tool call's start) is held to its tag's schema.

    A grammar backend (``structured_output.backend``) compiles it; the engine masks every
    token the constraint does not allow, and the request ends when the constraint is complete.
    Invalid values raise ``ValueError`` naming the field.
    """

    json: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        set_ = [k for k in _CONSTRAINTS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(
                "StructuredOutputsParams: give exactly one of json, regex, choice, grammar, "
                f"json_object=True, structural_tag; got {', '.join(set_) or 'none'}"
            )
        if isinstance(self.json, str):
            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"StructuredOutputsParams.json: not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError(
                "StructuredOutputsParams.json: a JSON schema is an object; got "
                f"{type(self.json).__name__}"
            )
        if self.choice is not None:
            self.choice = [str(c) for c in self.choice]
            if not self.choice:
                raise ValueError("StructuredOutputsParams.choice: give at least one choice")
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"StructuredOutputsParams.{name}: must be a non-empty string")

    @property
    def kind(self) -> str:
        """Which constraint is set: json, regex, choice, grammar or json_object."""
        return next(k for k in _CONSTRAINTS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal for equal constraints; compiled grammars are cached by
        it."""
        kind = self.kind
        value = getattr(self, kind)
        if kind in ("json", "choice"):
            return kind, _json.dumps(value, sort_keys=True, separators=(",", ":"))
        return kind, "" if kind == "json_object" else value


_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class SamplingParams:
    """How to sample the output of one prompt.

    Field names and meanings follow vLLM (and, through it, the OpenAI API). Invalid values raise
    ``ValueError`` naming the field at construction.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputsParams | None = None
    # Filled in by the engine (``resolve``): every id that stops the request (the model's EOS ids
    # unless ``ignore_eos``, and ``stop_token_ids``), and ``bad_words`` as token ids.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k is None or self.top_k == -1:
            self.top_k = 0  # vLLM spells "no top-k" both as 0 and -1
        if self.logit_bias is not None:
            # JSON bodies give the keys as strings.
            self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        self._verify()
        self.all_stop_token_ids = set(self.stop_token_ids)

    def _verify(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"SamplingParams.{name}={getattr(self, name)!r}: {why}")

        if self.n < 1:
            bad("n", "must be at least 1")
        if self.temperature < 0.0:
            bad("temperature", "must be non-negative")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be at least 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be non-negative")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must not exceed max_tokens={self.max_tokens}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", "must be in [-2, 2]")
        if self.repetition_penalty <= 0.0:
            bad("repetition_penalty", "must be positive")
        if self.logprobs is not None and self.logprobs < 0:
            bad("logprobs", "must be non-negative")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            bad("prompt_logprobs", "must be non-negative")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "must not be empty (leave it None to allow every token)")
        if self.bad_words is not None and any(not w.strip() for w in self.bad_words):
            bad("bad_words", "bad words must be non-empty")
        so = self.structured_outputs
        if so is not None and not isinstance(so, StructuredOutputsParams):
            bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")

    def resolve(self, tokenizer: Any, vocab_size: int, eos_token_ids: set[int]) -> SamplingParams:
        """A copy with what only the engine knows filled in: the ids that stop the request and
        ``bad_words`` as token ids. Raises ``ValueError`` naming the field for a token id outside
        ``[0, vocab_size)``."""
        out = dataclasses.replace(self)
        out.all_stop_token_ids = set(self.stop_token_ids)
        # A grammar ends only with EOS, so a constrained request stops there despite ignore_eos.
        if not self.ignore_eos or self.structured_outputs is not None:
            out.all_stop_token_ids |= eos_token_ids
        out.bad_words_token_ids = _bad_words_token_ids(self.bad_words or [], tokenizer)

        def check(name: str, ids: Any) -> None:
            wrong = sorted({t for t in ids if not 0 <= t < vocab_size})
            if wrong:
                raise ValueError(
                    f"SamplingParams.{name}: token ids {wrong[:5]} are outside the vocabulary "
                    f"[0, {vocab_size})"
                )

        check("allowed_token_ids", self.allowed_token_ids or ())
        check("logit_bias", self.logit_bias or ())
        check("stop_token_ids", self.stop_token_ids)
        check("bad_words", [t for w in out.bad_words_token_ids for t in w])
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and k > vocab_size:
                raise ValueError(f"SamplingParams.{name}={k}: more than the {vocab_size} tokens")
        return out

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS


def _bad_words_token_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """Each bad word as token ids, as vLLM does: as written, and with a leading space when that
    tokenizes to a different first token of the same length (the word inside a text)."""
    out: list[list[int]] = []
    for word in words:
        plain = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        out.append(plain)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != plain[0] and len(spaced) == len(plain):
            out.append(spaced)
    return out
