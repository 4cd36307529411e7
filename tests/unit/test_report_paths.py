"""``pagoda.bench.report.report_text``: a benchmark report names paths of the machine it ran on
relative to the working folder (the repository's root) or the home folder, never as they were
there."""

from __future__ import annotations

from pathlib import Path

from pagoda.bench.report import report_text


def test_paths_under_the_working_folder_and_the_home_are_made_portable(
    tmp_path: Path, monkeypatch
) -> None:
    home, repo = tmp_path / "home", tmp_path / "srv" / "repo"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    repo.mkdir(parents=True)
    monkeypatch.chdir(repo)
    text = report_text(
        {
            "command": f"python {repo}/benchmarks/spec_decode.py --device cuda",
            "weights": f"{home}/.cache/pagoda/random-weights/qwen3-0.6b-seed0",
            "elsewhere": "/data/model",
        }
    )
    assert '"python benchmarks/spec_decode.py --device cuda"' in text
    assert '"~/.cache/pagoda/random-weights/qwen3-0.6b-seed0"' in text
    assert '"/data/model"' in text and str(tmp_path) not in text
