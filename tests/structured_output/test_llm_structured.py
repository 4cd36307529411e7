"""Structured output end to end on SmolLM2-135M-Instruct (CPU) through ``LLM``: JSON schemas,
regexes, choices and an EBNF grammar, greedy and sampled; mixed batches; bad constraints."""

from __future__ import annotations

import ast
import json
import re

import jsonschema
import pytest
from schemas import SCHEMAS

from pagoda import LLM, SamplingParams
from pagoda.sampling_params import StructuredOutputsParams

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(max_model_len=384, kv_cache_memory_bytes=64 << 20, max_num_seqs=64)


def _ask(what: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": what}]


def _params(temperature: float, max_tokens: int = 80, **constraint: object) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        seed=11 if temperature else None,
        structured_outputs=StructuredOutputsParams(**constraint),
    )


def test_every_output_of_varied_json_schemas_validates_greedy_and_sampled(llm: LLM) -> None:
    assert len(SCHEMAS) >= 20
    cases = [(name, t) for name in SCHEMAS for t in (0.0, 1.0)]
    outs = llm.chat(
        [_ask(f"Reply with JSON describing: {name.replace('_', ' ')}.") for name, _ in cases],
        [_params(t, json=SCHEMAS[name]) for name, t in cases],
        use_tqdm=False,
    )
    for (name, t), out in zip(cases, outs):
        c = out.outputs[0]
        assert c.finish_reason == "stop", (name, t, c.text)
        jsonschema.validate(json.loads(c.text), SCHEMAS[name])


REGEXES = [
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no), because [a-z ]{1,20}\.",
    r"[A-Z][a-z]{2,8} [A-Z][a-z]{2,8}",
    r"#[0-9a-f]{6}",
]
CHOICES = ["positive", "negative", "neutral"]
# Arithmetic with at most three operators and nesting two deep: every sentence ends.
GRAMMAR = r"""
root ::= expr
expr ::= term (op term){0,3}
term ::= num | "(" inner ")"
inner ::= num (op num){0,2}
op ::= "+" | "-" | "*"
num ::= [1-9] [0-9]{0,2}
"""


def _is_arithmetic(text: str) -> bool:
    tree = ast.parse(text, mode="eval")
    allowed = (ast.Expression, ast.BinOp, ast.Constant, ast.Add, ast.Sub, ast.Mult)
    return all(isinstance(node, allowed) for node in ast.walk(tree))


def test_regex_choice_and_grammar_outputs_match(llm: LLM) -> None:
    convs, params, checks = [], [], []
    for t in (0.0, 1.0):
        for rx in REGEXES:
            convs.append(_ask(f"Answer in the format {rx}."))
            params.append(_params(t, regex=rx))
            checks.append(lambda s, rx=rx: re.fullmatch(rx, s) is not None)
        convs.append(_ask("Is this review happy? 'Great food, slow service.'"))
        params.append(_params(t, choice=CHOICES))
        checks.append(lambda s: s in CHOICES)
        convs.append(_ask("Write an arithmetic expression."))
        params.append(_params(t, grammar=GRAMMAR))
        checks.append(_is_arithmetic)
    outs = llm.chat(convs, params, use_tqdm=False)
    for out, p, check in zip(outs, params, checks):
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), (p.structured_outputs, c.text)


def test_mixed_batch_gives_each_request_its_own_and_constrained_greedy_equals_alone(
    llm: LLM,
) -> None:
    schema = SCHEMAS["nested_address"]
    constrained = _params(0.0, json=schema)
    free = SamplingParams(max_tokens=24, temperature=0.0)
    sampled_n2 = SamplingParams(
        n=2,
        max_tokens=30,
        temperature=1.0,
        seed=3,
        structured_outputs=StructuredOutputsParams(regex=r"[a-z]{2,6}( [a-z]{2,6}){1,3}"),
    )
    prompts = [
        _ask("Give a person with an address as JSON."),
        _ask("Tell me about the sea."),
        _ask("Say a few words."),
        _ask("Pick a day."),
    ]
    choice = _params(1.0, choice=["mon", "tue", "wed"])
    together = llm.chat(prompts, [constrained, free, sampled_n2, choice], use_tqdm=False)
    alone_c = llm.chat(prompts[0], constrained, use_tqdm=False)[0].outputs[0]
    alone_f = llm.chat(prompts[1], free, use_tqdm=False)[0].outputs[0]
    assert together[0].outputs[0].token_ids == alone_c.token_ids
    jsonschema.validate(json.loads(alone_c.text), schema)
    assert together[1].outputs[0].token_ids == alone_f.token_ids
    assert len(together[2].outputs) == 2
    for c in together[2].outputs:
        assert re.fullmatch(r"[a-z]{2,6}( [a-z]{2,6}){1,3}", c.text), c.text
    assert together[3].outputs[0].text in ("mon", "tue", "wed")


@pytest.mark.parametrize(
    ("constraint", "problem"),
    [
        ({"json": {"type": "objekt"}}, "JSON schema"),
        ({"json": '{"type": "object", '}, "not valid JSON"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "root ::= undefined_rule"}, "EBNF grammar"),
    ],
)
def test_bad_constraint_is_refused_naming_it_and_the_engine_keeps_serving(
    llm: LLM, constraint: dict, problem: str
) -> None:
    with pytest.raises(ValueError, match=problem):
        llm.generate(
            ["Hi", "Hello"],
            [
                SamplingParams(max_tokens=4),
                SamplingParams(max_tokens=4, structured_outputs=constraint),
            ],
            use_tqdm=False,
        )
    out = llm.generate(["Hi"], _params(0.0, max_tokens=8, choice=["a", "b"]), use_tqdm=False)
    assert out[0].outputs[0].text in ("a", "b")
