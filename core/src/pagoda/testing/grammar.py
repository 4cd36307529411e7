"""The grammar-backend conformance kit without pytest: cases (a constraint, text it accepts, text
it refuses) and checks that run a backend's matchers against them token by token.

A check raises ``AssertionError`` saying what broke. :class:`GrammarBackendConformance`
(``pagoda.testing``) runs them as pytest tests.
"""

from __future__ import annotations

import concurrent.futures as cf
from dataclasses import dataclass
from typing import Any

import torch

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured_output.backend import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    apply_token_bitmask,
    bitmask_width,
)


@dataclass(frozen=True)
class GrammarCase:
    name: str
    params: StructuredOutputsParams
    accepted: str  # a complete output the constraint accepts
    refused_start: str  # an output start it refuses


def grammar_cases() -> list[GrammarCase]:
    """One case per kind of constraint."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "n": {"type": "integer", "minimum": 0}},
        "required": ["name", "n"],
    }
    S = StructuredOutputsParams
    return [
        GrammarCase("json", S(json=schema), '{"name":"ab","n":12}', '{"n":"x"'),
        GrammarCase("json_object", S(json_object=True), '{"a":"b"}', "[1"),
        GrammarCase("regex", S(regex=r"[0-9]{3}-[a-z]+"), "123-abc", "12a"),
        GrammarCase("choice", S(choice=["yes", "no"]), "no", "maybe"),
        GrammarCase(
            "grammar",
            S(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [0-9]+'),
            "(1+23)",
            "1+",
        ),
    ]


def refusal(backend_cls: type[GrammarBackend], case: GrammarCase) -> str | None:
    """Why the backend refuses ``case``'s kind of constraint through ``validate`` (a backend
    need not support every kind), or None if it accepts it."""
    try:
        backend_cls.validate(case.params)
    except ValueError as e:
        return f"{backend_cls.__name__} refuses {case.name} constraints: {e}"
    return None


BAD_CONSTRAINTS: list[tuple[str, StructuredOutputsParams]] = [
    ("json", StructuredOutputsParams(json={"type": "not-a-type"})),
    ("regex", StructuredOutputsParams(regex="(unclosed")),
    ("grammar", StructuredOutputsParams(grammar="root ::= undefined_rule")),
]


def allowed(bitmask: torch.Tensor, row: int, token: int) -> bool:
    return bool((int(bitmask[row, token // 32]) >> (token % 32)) & 1)


def _tokens(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def _fill(matcher: GrammarMatcher, vocab_size: int) -> torch.Tensor:
    bitmask = torch.zeros(1, bitmask_width(vocab_size), dtype=torch.int32)
    matcher.fill_bitmask(bitmask, 0)
    return bitmask


def check_walk(backend: GrammarBackend, case: GrammarCase, stop_id: int) -> None:
    """Each token of the accepted text is allowed in turn and accepted; then the stop token is
    allowed and ends the grammar; the refused start is refused."""
    tok, vocab = backend.tokenizer, backend.vocab_size
    compiled = backend.compile(case.params)
    assert isinstance(compiled, CompiledGrammar), f"{case.name}: compile gave {compiled!r}"
    assert compiled.backend is type(backend) or issubclass(type(backend), compiled.backend)
    m = compiled.new_matcher()
    for i, t in enumerate(_tokens(tok, case.accepted)):
        assert allowed(_fill(m, vocab), 0, t), f"{case.name}: token {i} ({t}) not allowed"
        assert m.accept_tokens([t]), f"{case.name}: token {i} ({t}) refused"
        assert not m.is_terminated(), f"{case.name}: terminated before its stop token"
    mask = _fill(m, vocab)
    assert allowed(mask, 0, stop_id), f"{case.name}: the stop token is not allowed at the end"
    assert m.accept_tokens([stop_id]) and m.is_terminated(), f"{case.name}: stop did not end it"
    padded = range(len(tok), vocab)
    assert not any(allowed(mask, 0, t) for t in padded), f"{case.name}: a padding id is allowed"
    fresh = compiled.new_matcher()
    refused = _tokens(tok, case.refused_start)
    assert fresh.validate_tokens(refused) < len(refused), f"{case.name}: refused start accepted"


def check_validate_and_rollback(backend: GrammarBackend, case: GrammarCase) -> None:
    """``validate_tokens`` counts the accepted prefix and leaves the state; ``rollback`` undoes
    accepted tokens."""
    tok, vocab = backend.tokenizer, backend.vocab_size
    m = backend.compile(case.params).new_matcher(max_rollback_tokens=8)
    start = _fill(m, vocab)
    good = _tokens(tok, case.accepted)
    bad = _tokens(tok, case.refused_start)
    assert m.validate_tokens(good) == len(good), f"{case.name}: validate_tokens of a valid text"
    assert m.validate_tokens(bad) < len(bad)
    assert torch.equal(_fill(m, vocab), start), f"{case.name}: validate_tokens moved the state"
    k = min(3, len(good))
    assert m.accept_tokens(good[:k])
    m.rollback(k)
    assert torch.equal(_fill(m, vocab), start), f"{case.name}: rollback did not restore the state"
    assert m.accept_tokens(good), f"{case.name}: the text after a rollback"


def check_batch(backend: GrammarBackend, cases: list[GrammarCase]) -> None:
    """``fill_bitmasks`` and ``accept_batch`` give what the matchers give one by one."""
    tok, vocab = backend.tokenizer, backend.vocab_size
    compiled = [backend.compile(c.params) for c in cases]
    one = [c.new_matcher() for c in compiled]
    many = [c.new_matcher() for c in compiled]
    firsts = [_tokens(tok, c.accepted)[0] for c in cases]
    assert type(backend).accept_batch(many, firsts) == [
        m.accept_tokens([t]) for m, t in zip(one, firsts)
    ]
    rows = list(range(len(cases) + 1, 1, -1))[: len(cases)]  # out of order, leaving row 0 alone
    bitmask = torch.full((len(cases) + 2, bitmask_width(vocab)), -1, dtype=torch.int32)
    type(backend).fill_bitmasks(many, bitmask, rows)
    for m, r in zip(one, rows):
        assert torch.equal(bitmask[r : r + 1], _fill(m, vocab)), "fill_bitmasks differs"
    assert bool((bitmask[0] == -1).all()), "fill_bitmasks wrote a row it was not given"


def check_apply(backend_cls: type[GrammarBackend], device: str, vocab_size: int) -> None:
    """``apply_bitmask`` sets exactly what the reference sets to -inf, on the given rows."""
    gen = torch.Generator().manual_seed(0)
    n = 5
    logits = torch.randn(n, vocab_size, generator=gen).to(device)
    words = bitmask_width(vocab_size)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (n, words), generator=gen, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(device)
    for rows in ([1, 3], list(range(n))):
        want, got = logits.clone(), logits.clone()
        apply_token_bitmask(want, bitmask, rows)
        backend_cls.apply_bitmask(got, bitmask, rows)
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"rows {rows}: masks differ"
        assert torch.equal(got[torch.isfinite(got)], want[torch.isfinite(want)])


def check_concurrent_compiles(backend: GrammarBackend, cases: list[GrammarCase]) -> None:
    """The core compiles in several threads at once."""
    with cf.ThreadPoolExecutor(4) as pool:
        done = list(pool.map(backend.compile, [c.params for c in cases] * 2))
    assert all(isinstance(c, CompiledGrammar) for c in done)
