"""Backends whose kernels compile on first use: ``auto`` starts on a ready backend and compiles the
better one in the background (a later start picks it); a named one compiles before the first step;
the log says what compiled and how long it took; no compile outlives the engine's process."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

import pytest
import torch

from pagoda import hookimpl
from pagoda.attention import jit
from pagoda.attention.selector import select_attention_backend
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.plugins import plugin_registered

CPU = torch.device("cpu")
# The compile: wait a little (a compiler at work), then leave the "built" file it was given.
BUILD = (
    "import pathlib, sys, time; time.sleep(float(sys.argv[2])); "
    "pathlib.Path(sys.argv[1]).write_text('ok'); print('slowjit: built attn_kernel in 0.2 s')"
)
# A compile that starts a compiler of its own (as ninja starts nvcc), notes its pid, and waits.
SPAWNS = (
    "import pathlib, subprocess, sys, time; p = subprocess.Popen(['sleep', '120']); "
    "pathlib.Path(sys.argv[1] + '.child').write_text(str(p.pid)); time.sleep(120)"
)
FAIL = "import sys; print('nvcc: error'); sys.exit(int(sys.argv[3]))"


class SlowJitBackend(TorchNativeBackend):
    name = "slowjit"
    priority = 200
    built: Path = Path("/nonexistent")
    seconds = 0.2
    exit_code = 0
    code = ""

    @classmethod
    def is_compiled(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return cls.built.exists()

    @classmethod
    def compile_command(cls, device, dtype, head_size) -> list[str]:
        code = cls.code or (BUILD if cls.exit_code == 0 else FAIL)
        return [sys.executable, "-c", code, str(cls.built), str(cls.seconds), str(cls.exit_code)]


class JitPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("slowjit", SlowJitBackend)


@pytest.fixture
def slowjit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    monkeypatch.setattr(SlowJitBackend, "built", tmp_path / "built")
    monkeypatch.setattr(jit, "_started", {})
    caplog.set_level(logging.INFO, logger="pagoda.attention")
    with plugin_registered(JitPlugin(), "jit"):
        yield SlowJitBackend


def test_auto_starts_on_a_ready_backend_and_compiles_the_best_in_the_background(
    slowjit, caplog
) -> None:
    assert select_attention_backend("auto", CPU, torch.float32, 64) is TorchNativeBackend
    assert not slowjit.built.exists()  # not waited for
    assert "slowjit's kernels for float32, head size 64, on cpu are not compiled yet" in caplog.text
    assert "starting on torch" in caplog.text
    # The same selection again (another layer, another engine in this process) starts no second
    # compile: it gets the running one's watcher.
    select_attention_backend("auto", CPU, torch.float32, 64)
    assert len(jit._started) == 1
    (watcher,) = jit._started.values()
    watcher.join(timeout=30)
    assert slowjit.built.read_text() == "ok"
    assert "compiled in the background in" in caplog.text
    assert "the next engine start uses slowjit" in caplog.text
    # The next start finds the kernels ready and picks the best backend.
    assert select_attention_backend("auto", CPU, torch.float32, 64) is slowjit


def test_waiting_for_background_compiles_lets_the_next_start_pick_the_best(
    slowjit, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not jit.wait_for_background_compiles()  # none started: nothing to wait for
    monkeypatch.setattr(SlowJitBackend, "seconds", 1.0)
    assert select_attention_backend("auto", CPU, torch.float32, 64) is TorchNativeBackend
    assert not slowjit.built.exists()
    assert jit.wait_for_background_compiles(timeout=30)
    assert slowjit.built.read_text() == "ok"  # the compile had ended when the wait returned
    assert select_attention_backend("auto", CPU, torch.float32, 64) is slowjit


def test_a_named_backend_compiles_before_the_first_step_and_says_how_long(slowjit, caplog) -> None:
    assert select_attention_backend("slowjit", CPU, torch.float32, 64) is slowjit
    assert slowjit.built.read_text() == "ok"  # done before selection returned
    what = "slowjit's kernels for float32, head size 64, on cpu"
    assert f"compiling {what} before the first step" in caplog.text
    assert f"{what} compiled in" in caplog.text
    assert "attention: slowjit: built attn_kernel in 0.2 s" in caplog.text  # what it built
    assert not jit._started


def test_a_failed_compile_is_logged_with_its_output_and_the_backend_still_runs(
    slowjit, caplog, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(SlowJitBackend, "exit_code", 3)
    assert select_attention_backend("slowjit", CPU, torch.float32, 64) is slowjit
    assert "failed after" in caplog.text and "(exit 3)" in caplog.text
    assert "nvcc: error" in caplog.text  # the compiler's own words


def test_no_background_compile_outlives_the_engine_process(slowjit, monkeypatch) -> None:
    monkeypatch.setattr(SlowJitBackend, "seconds", 120)
    select_attention_backend("auto", CPU, torch.float32, 64)
    (proc,) = jit._running
    assert proc.poll() is None
    jit.stop_background_compiles()  # what exit runs
    assert proc.wait(timeout=10) is not None
    (watcher,) = jit._started.values()
    watcher.join(timeout=10)
    assert not jit._running and not slowjit.built.exists()


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has stopped


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_a_stopped_background_compile_stops_the_compilers_it_started(
    slowjit, monkeypatch, caplog
) -> None:
    """A compiler left running after its compile was stopped finishes writing into the cache
    after the next compile recorded it: the next load finds that out of date and rebuilds."""
    monkeypatch.setattr(SlowJitBackend, "code", SPAWNS)
    select_attention_backend("auto", CPU, torch.float32, 64)
    pid_file = Path(str(slowjit.built) + ".child")
    deadline = time.monotonic() + 30
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    child = int(pid_file.read_text())
    assert _alive(child)
    jit.stop_background_compiles()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)
    assert "background compiles and their compilers stopped in" in caplog.text
