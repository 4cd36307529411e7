"""What the xgrammar backend adds to the contract: errors that name the problem without
xgrammar's source locations, compact JSON unless any_whitespace, and discovery by name."""

from __future__ import annotations

import pytest

pytest.importorskip("xgrammar")

from pagoda.config import StructuredOutputConfig  # noqa: E402
from pagoda.plugins import get_registry  # noqa: E402
from pagoda.sampling_params import StructuredOutputsParams as S  # noqa: E402
from pagoda.structured_output.manager import select_grammar_backend  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    from pagoda.loader import convert_gguf, default_model_path, load_tokenizer

    return load_tokenizer(convert_gguf(default_model_path()))


def test_registered_by_name_and_chosen_by_auto() -> None:
    cls = get_registry("grammar_backends").get("xgrammar")
    assert cls.__name__ == "XGrammarBackend"
    assert select_grammar_backend("auto") is cls


@pytest.mark.parametrize(
    ("params", "words"),
    [
        (S(regex="a{2,1}"), ["invalid or unsupported regex"]),
        (
            S(json={"type": "object", "properties": {"a": {"type": "strng"}}}),
            ["JSON schema", "strng"],
        ),
        (S(grammar="root ::= [a-"), ["invalid EBNF grammar"]),
    ],
)
def test_errors_name_the_problem_without_source_locations(params: S, words: list[str]) -> None:
    cls = get_registry("grammar_backends").get("xgrammar")
    with pytest.raises(ValueError) as info:
        cls.validate(params)
    message = str(info.value)
    assert all(w in message for w in words), message
    assert ".cc:" not in message and "Check failed" not in message, message


def test_json_is_compact_unless_any_whitespace(tokenizer) -> None:
    cls = get_registry("grammar_backends").get("xgrammar")
    schema = S(json={"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})
    spaced = tokenizer.encode('{ "a": 1}', add_special_tokens=False)
    for any_ws, accepted in ((False, False), (True, True)):
        backend = cls(
            tokenizer,
            len(tokenizer),
            [tokenizer.eos_token_id],
            StructuredOutputConfig(any_whitespace=any_ws),
        )
        matcher = backend.compile(schema).new_matcher()
        assert matcher.accept_tokens(spaced) is accepted
