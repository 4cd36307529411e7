"""``pagoda generate`` on the default model: one batch, answers under a separator line naming
their prompt, ``--json`` lines with token counts and finish reasons; ``--version``; a missing
model is one line and exit status 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from pagoda.entrypoints.cli import ANSWER_SEPARATOR, main

SMALL = ["--max-model-len", "256", "--kv-cache-memory-bytes", str(64 << 20), "--max-num-seqs", "4"]
PROMPTS = ["What is the capital of France?", "Write two lines about the sea.", "Say hi."]


@pytest.fixture(scope="module")
def answers(smollm2_gguf) -> dict[str, tuple[int, str, str]]:
    """(exit status, stdout, stderr) of the plain and the --json run, three prompts each."""
    out = {}
    for mode in ("plain", "json"):
        cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "generate", *PROMPTS, *SMALL]
        cmd += ["--max-tokens", "24"] + (["--json"] if mode == "json" else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        out[mode] = (proc.returncode, proc.stdout, proc.stderr)
    return out


def test_several_answers_each_start_with_a_separator_line_naming_the_prompt(answers) -> None:
    code, out, err = answers["plain"]
    assert code == 0, err
    heads = [line for line in out.splitlines() if line.startswith(ANSWER_SEPARATOR)]
    assert heads == [
        f"{ANSWER_SEPARATOR} [{i + 1}/3] {p!r} {ANSWER_SEPARATOR}" for i, p in enumerate(PROMPTS)
    ]
    assert out.startswith(heads[0])
    first = out.split(heads[1])[0]
    assert "Paris" in first
    # The batch shows a progress bar on stderr, and its phases with their times.
    assert "Generating: 100%" in err
    assert "generated " in err and "for 3 prompts in" in err


def test_json_prints_one_line_per_answer_with_counts_and_finish_reason(answers) -> None:
    code, out, err = answers["json"]
    assert code == 0, err
    rows = [json.loads(line) for line in out.splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2]
    assert [r["prompt"] for r in rows] == PROMPTS
    for r in rows:
        assert r["finish_reason"] in ("stop", "length")
        assert 0 < r["completion_tokens"] <= 24 and r["prompt_tokens"] > 5
        assert set(r) >= {"text", "stop_reason"}
    assert "Paris" in rows[0]["text"]
    # Greedy: the same answers as the plain run.
    plain = answers["plain"][1]
    assert all(r["text"] in plain for r in rows)


def test_missing_model_is_one_line_and_exit_status_2(tmp_path) -> None:
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "generate", "--model", str(missing)]
    proc = subprocess.run([*cmd, "--quiet", "Hi"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("pagoda: error: model ") and str(missing) in lines[0]
    assert "Traceback" not in proc.stderr


def test_debug_shows_the_traceback_of_the_same_error(tmp_path, capsys) -> None:
    code = main(["generate", "--debug", "--model", str(tmp_path / "nope"), "Hi"])
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback (most recent call last)" in err and "FileNotFoundError" in err
    assert err.rstrip().splitlines()[-1].startswith("pagoda: error: model ")


def test_an_error_quoting_a_traceback_is_cut_to_its_first_line(monkeypatch, capsys) -> None:
    from pagoda.plugins import PluginLoadError

    def boom(args):
        raise PluginLoadError(
            "backend 'x' failed: ImportError: no\nTraceback (most recent call last):\n  File x"
        )

    monkeypatch.setattr("pagoda.entrypoints.cli._cmd_config", boom)
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    want = "pagoda: error: backend 'x' failed: ImportError: no (--debug shows the traceback)\n"
    assert err == want


def test_version_prints_the_installed_version() -> None:
    from importlib.metadata import version

    proc = subprocess.run(
        [sys.executable, "-m", "pagoda.entrypoints.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0
    assert proc.stdout.strip() == f"pagoda {version('pagoda-core')}"


def test_generate_help_shows_only_its_options_with_defaults(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for server_flag in ("--host", "--port", "--api-key", "--served-model-name"):
        assert server_flag not in out
    assert "tokens to generate at most (default: 128)" in out
    assert "0: greedy (default: 0.0)" in out
    assert "--max-model-len" in out and "--json" in out
    assert "[cache.block_size] (default: 16)" in out  # the configuration's default, not None
    assert "(default: None)" not in out


class _RefuseSecrets:
    """An admission rule: prompts that mention a secret are turned away."""

    PAGODA_PLUGIN_API = 1

    @staticmethod
    def admit_request(request):
        return "no secrets, please" if 1234 in request.prompt_token_ids else None


def test_a_refused_prompt_refuses_the_batch_in_one_line_and_prints_no_answer(
    smollm2_tokenizer, capsys
) -> None:
    from pagoda import hookimpl
    from pagoda.testing import plugin_registered

    class Rule(_RefuseSecrets):
        admit_request = hookimpl(staticmethod(_RefuseSecrets.admit_request))

    secret = smollm2_tokenizer.decode([1234])
    with plugin_registered(Rule(), name="refuse_secrets"):
        code = main(["generate", "Hello", f"Tell me {secret}", "--no-chat", "--quiet", *SMALL])
    out, err = capsys.readouterr()
    assert code == 2
    assert out == ""  # the first prompt was refused along with the batch: no answer at all
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pagoda: error: "), err
    assert "no secrets, please" in lines[0]
