"""Acceptance, as a user meets it: in a fresh virtual environment, install the core and the example
plugin; `pagoda plugins` lists it; a YAML config that selects it generates the same greedy text as
the reference backend; uninstall it, and the same config fails with the available backends.

The fresh environment sees this environment's third-party packages (torch, transformers, ...)
through a folder of links, without any Pagoda distribution: the core and the plugin are installed
into it with pip, offline (--no-index --no-deps --no-build-isolation).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "pagoda-counting-attention"
# Our own distributions and editable installs stay out of the fresh environment.
_OURS = re.compile(r"^(__editable__|pagoda)", re.IGNORECASE)

pytestmark = pytest.mark.slow


def _shared_site(tmp_path: Path) -> Path:
    shared = tmp_path / "shared-site"
    shared.mkdir()
    for entry in Path(sysconfig.get_paths()["purelib"]).iterdir():
        if not _OURS.match(entry.name) and entry.name != "__pycache__":
            (shared / entry.name).symlink_to(entry)
    return shared


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("fresh")
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    purelib = subprocess.run(
        [py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    shared = _shared_site(tmp)
    Path(purelib, "_shared_site.pth").write_text(f"import site; site.addsitedir({str(shared)!r})\n")
    _pip(venv, "install", "-e", str(ROOT / "core"), "-e", str(EXAMPLE))
    return venv


def _env(**extra: str) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k != "PYTHONPATH"
        and not (k.startswith("PAGODA_") and ("__" in k or k.startswith("PAGODA_PLUGIN")))
    }
    env.update(HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", **extra)
    return env


def _pip(venv: Path, *args: str) -> None:
    cmd = [str(venv / "bin" / "python"), "-m", "pip", "-q", "--disable-pip-version-check", *args]
    if args[0] == "install":
        cmd += ["--no-index", "--no-deps", "--no-build-isolation"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def _pagoda(venv: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(venv / "bin" / "pagoda"), *args],
        capture_output=True,
        text=True,
        env=_env(**env),
        timeout=600,
        cwd=venv.parent,
    )


def test_example_plugin_from_install_to_config_to_uninstall(fresh_venv: Path) -> None:
    venv = fresh_venv
    listed = _pagoda(venv, "plugins")
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith("counting "))
    assert row.split()[:4] == ["counting", "pagoda-counting-attention", "0.1.0", "loaded"]

    config = venv.parent / "engine.yaml"
    config.write_text("model:\n  max_model_len: 256\nattention:\n  backend: counting\n")
    report = venv.parent / "counts.json"
    prompt = ["--max-tokens", "8", "--no-chat", "The capital of France is"]
    counted = _pagoda(
        venv, "generate", "--config", str(config), *prompt, PAGODA_COUNTING_REPORT=str(report)
    )
    assert counted.returncode == 0, counted.stderr
    counts = json.loads(report.read_text())
    # One metadata build per step, one attention call per layer per step.
    assert counts["steps"] >= 8 and counts["forward"] % counts["steps"] == 0
    assert counts["forward"] > counts["steps"]

    reference = _pagoda(
        venv, "generate", "--config", str(config), "--attention-backend", "torch_native", *prompt
    )
    assert reference.returncode == 0, reference.stderr
    assert counted.stdout == reference.stdout and counted.stdout.strip()

    _pip(venv, "uninstall", "-y", "pagoda-counting-attention")
    assert "counting" not in _pagoda(venv, "plugins").stdout
    failed = _pagoda(venv, "generate", "--config", str(config), *prompt)
    assert failed.returncode == 2
    assert "unknown attention backend 'counting'; available: " in failed.stderr
    assert "torch_native" in failed.stderr.split("available: ")[1]
