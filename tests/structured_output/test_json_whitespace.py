"""``structured_output.disable_any_whitespace`` (vLLM's name; the default here) makes a JSON
grammar allow no free whitespace, for models that otherwise fill their budget with spaces and
newlines; ``any_whitespace`` (or ``disable_any_whitespace: false``) allows it again."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("xgrammar")

from pagoda_structured_xgrammar.backend import XGrammarBackend  # noqa: E402

from pagoda.config import ConfigError, EngineConfig  # noqa: E402
from pagoda.loader import convert_gguf, default_model_path, load_tokenizer  # noqa: E402
from pagoda.sampling_params import StructuredOutputsParams  # noqa: E402
from pagoda.structured_output.backend import bitmask_width  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(convert_gguf(default_model_path()))


def _whitespace_allowed_after_brace(tokenizer, section) -> bool:
    backend = XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], section)
    matcher = backend.compile(StructuredOutputsParams(json_object=True)).new_matcher()
    (brace,) = tokenizer.encode("{", add_special_tokens=False)
    assert matcher.accept_tokens([brace])
    mask = torch.zeros(1, bitmask_width(len(tokenizer)), dtype=torch.int32)
    matcher.fill_bitmask(mask, 0)
    spaces = [t for t in range(len(tokenizer)) if tokenizer.decode([t]) in (" ", "\n", "  ")]
    assert spaces
    return any(bool((mask[0, t // 32] >> (t % 32)) & 1) for t in spaces)


@pytest.mark.parametrize(
    ("section", "allowed"),
    [
        ({}, False),  # the default: compact JSON
        ({"disable_any_whitespace": True}, False),
        ({"disable_any_whitespace": False}, True),
        ({"any_whitespace": True}, True),
    ],
)
def test_json_grammar_allows_free_whitespace_only_when_asked(
    tokenizer, section: dict, allowed: bool
) -> None:
    config = EngineConfig.load(overrides={"structured_output": section})
    assert _whitespace_allowed_after_brace(tokenizer, config.structured_output) is allowed


def test_contradicting_names_are_refused() -> None:
    with pytest.raises(ConfigError, match="disable_any_whitespace=True contradicts"):
        EngineConfig.load(
            overrides={
                "structured_output": {"disable_any_whitespace": True, "any_whitespace": True}
            }
        )
