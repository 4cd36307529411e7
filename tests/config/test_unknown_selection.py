"""A name no plugin registers (a speculative method, a grammar backend) fails at start, in one
line naming the available ones, with exit status 2, in every command and in ``LLM(...)``; not in
the engine process with its traceback, nor per request."""

from __future__ import annotations

import pytest

from pagoda.config import ConfigError
from pagoda.entrypoints.cli import main

UNKNOWN = {
    "speculative.method": (
        ["PAGODA_SPECULATIVE__METHOD", "PAGODA_SPECULATIVE__NUM_SPECULATIVE_TOKENS"],
        ["suffx", "2"],
        "unknown spec proposer 'suffx'; available: ",
        "ngram",
    ),
    "structured_output.backend": (
        ["PAGODA_STRUCTURED_OUTPUT__BACKEND"],
        ["llguidanse"],
        "unknown grammar backend 'llguidanse'; available: ",
        "xgrammar",
    ),
}
COMMANDS = {
    "config": ["config"],
    "generate": ["generate", "--max-tokens", "2", "Hello"],
    "serve": ["serve", "--port", "0"],
}


@pytest.mark.parametrize("key", UNKNOWN)
@pytest.mark.parametrize("command", COMMANDS)
def test_unknown_name_is_one_line_and_exit_2_in_every_command(
    monkeypatch, capsys, key: str, command: str
) -> None:
    names, values, message, known = UNKNOWN[key]
    for name, value in zip(names, values):
        monkeypatch.setenv(name, value)
    assert main(COMMANDS[command]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1, err
    assert "Traceback" not in captured.err + captured.out
    assert f"{key}: {message}" in err and known in err
    assert f"[from environment {names[0]}]" in err


@pytest.mark.parametrize("key", UNKNOWN)
def test_unknown_name_fails_llm_construction(monkeypatch, key: str) -> None:
    from pagoda import LLM

    section, field = key.split(".")
    overrides = {section: {field: "nothing-registers-this"}}
    if section == "speculative":
        overrides[section]["num_speculative_tokens"] = 2
    with pytest.raises(ConfigError) as info:
        LLM(**overrides)
    assert f"{key}: unknown " in str(info.value) and UNKNOWN[key][3] in str(info.value)
