"""Fixtures for plugin tests: fake installed distributions with ``pagoda`` entry points.

A fake distribution is a ``NAME-VERSION.dist-info`` folder (METADATA, entry_points.txt) and a
module in a temporary folder put on ``sys.path``: importlib.metadata finds it exactly as it
finds a pip-installed plugin, without installing anything.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagoda.plugins import reload_plugins

PY = sys.executable


class FakeSite:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.modules: list[str] = []

    def add(
        self,
        dist: str,
        module: str,
        source: str,
        *,
        entry: str | None = None,
        version: str = "1.0.0",
        api: int | None = 1,
    ) -> None:
        """Install a fake distribution ``dist`` whose entry point ``entry`` (default: the module
        name) names ``module``, holding ``source`` (``PAGODA_PLUGIN_API = api`` prepended)."""
        header = "import pagoda\nfrom pagoda import hookimpl\n"
        if api is not None:
            header += f"PAGODA_PLUGIN_API = {api}\n"
        (self.root / f"{module}.py").write_text(header + textwrap.dedent(source))
        info = self.root / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[pagoda]\n{entry or module} = {module}\n")
        self.modules.append(module)
        importlib.invalidate_caches()

    def env(self, **extra: str) -> dict[str, str]:
        """The environment for a subprocess that sees these distributions."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PAGODA_PLUGIN")}
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), env.get("PYTHONPATH", "")])
        env.update(extra)
        return env

    def run(self, code: str, **env: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [PY, "-c", textwrap.dedent(code)],
            env=self.env(**env),
            capture_output=True,
            text=True,
            timeout=120,
        )


@pytest.fixture(autouse=True)
def _rediscover_after_test() -> Iterator[None]:
    """Every test leaves the process's plugins as discovery finds them (set up first, so torn
    down last: after monkeypatch has restored the environment)."""
    yield
    reload_plugins()


@pytest.fixture
def fake_site(tmp_path: Path) -> Iterator[FakeSite]:
    root = tmp_path / "site"
    root.mkdir()
    sys.path.insert(0, str(root))
    site = FakeSite(root)
    try:
        yield site
    finally:
        sys.path.remove(str(root))
        for m in site.modules:
            sys.modules.pop(m, None)
        importlib.invalidate_caches()
