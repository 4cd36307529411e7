"""FlashInfer's compile record: which JIT modules a run loads (and whether it built them), and
``is_compiled`` true only while every recorded module would load without building: a partial or
out-of-date cache sends ``auto`` back to another backend and a background compile, never to a
compile inside the engine's start. FlashInfer itself is replaced by a stand-in (no CUDA here);
ninja is the real one."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from pagoda_attention_flashinfer import modules, warm

needs_ninja = pytest.mark.skipif(shutil.which("ninja") is None, reason="needs ninja")

NINJA = """rule cp
  command = cp $in $out
build {lib}: cp {src}
default {lib}
"""


class FakeSpec:
    """What FlashInfer's JitSpecNvcc offers: a name, a library, a ninja file, build()."""

    def __init__(self, root: Path, name: str) -> None:
        self.name = name
        self.dir = root / name
        self.dir.mkdir(parents=True, exist_ok=True)
        self.source = self.dir / "kernel.cu"
        if not self.source.exists():
            self.source.write_text(f"// {name}\n")
        self.ninja_path = self.dir / "build.ninja"
        self.ninja_path.write_text(NINJA.format(lib=self.library, src=self.source))
        self.is_aot = False

    @property
    def library(self) -> Path:
        return self.dir / f"{self.name}.so"

    def get_library_path(self) -> Path:
        return self.library

    def build(self, need_lock: bool = False) -> None:
        if shutil.which("ninja"):
            import subprocess

            argv = ["ninja", "-C", str(self.dir), "-f", str(self.ninja_path)]
            subprocess.run(argv, check=True, capture_output=True)
        else:
            shutil.copy(self.source, self.library)

    def build_and_load(self) -> str:  # FlashInfer's: build if needed, then load
        self.build()
        return f"loaded {self.name}"


@pytest.fixture
def fake_flashinfer(monkeypatch: pytest.MonkeyPatch):
    """A stand-in ``flashinfer.jit.core.JitSpec``, and the recorder's state reset around it."""
    core = types.ModuleType("flashinfer.jit.core")
    core.JitSpec = FakeSpec
    original = FakeSpec.build_and_load
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit", types.ModuleType("flashinfer.jit"))
    monkeypatch.setitem(sys.modules, "flashinfer.jit.core", core)
    monkeypatch.setattr(modules, "_original", None)
    monkeypatch.setattr(modules, "_listeners", [])
    monkeypatch.setattr(modules, "_engine_log", False)
    yield FakeSpec
    FakeSpec.build_and_load = original


def test_recording_names_each_module_loaded_and_whether_the_load_built_it(
    fake_flashinfer, tmp_path: Path
) -> None:
    spec = fake_flashinfer(tmp_path, "batch_prefill_bf16_h128_sm90")
    with modules.recording() as loaded:
        assert spec.build_and_load() == "loaded batch_prefill_bf16_h128_sm90"
    time.sleep(0.01)
    with modules.recording() as again:
        spec.build_and_load()
    (first,) = loaded
    assert first.name == spec.name and first.built
    assert first.library == str(spec.library) and first.build_file == str(spec.ninja_path)
    assert not again[0].built  # built already: the second load only loaded it


def test_discovery_notes_what_flashinfer_asks_for_without_building_it(
    fake_flashinfer, tmp_path: Path
) -> None:
    a, b = fake_flashinfer(tmp_path, "a"), fake_flashinfer(tmp_path, "b")
    with modules.discovering() as asked:
        for spec in (a, b):
            with pytest.raises(modules.Discovered):
                spec.build_and_load()
    assert [s.name for s in asked] == ["a", "b"]
    assert not a.library.exists() and not b.library.exists()
    lines: list[str] = []
    built = modules.build_all([a, b, a], lines.append)
    assert [m.name for m in built] == ["a", "b"] and all(m.built for m in built)
    assert a.library.exists() and b.library.exists()
    assert any(line.startswith("flashinfer: compiled a in ") for line in lines)


def _older(path: Path, than: Path) -> None:
    then = than.stat().st_mtime - 10
    os.utime(path, (then, then))


@needs_ninja
def test_a_module_is_stale_when_its_library_is_gone_or_ninja_would_rebuild_it(
    fake_flashinfer, tmp_path: Path
) -> None:
    spec = fake_flashinfer(tmp_path, "m")
    spec.build()
    module = modules.Module("m", str(spec.library), str(spec.ninja_path))
    assert modules.why_stale(module) is None
    # An input written after the library was built (a compiler that kept running after its
    # build was stopped): the next load rebuilds.
    _older(spec.library, spec.source)
    assert "ninja would build" in modules.why_stale(module)
    spec.build()
    assert modules.why_stale(module) is None
    spec.library.unlink()
    assert "is missing" in modules.why_stale(module)
    # A prebuilt module has no build file: present is enough.
    spec.build()
    assert modules.why_stale(dataclasses.replace(module, build_file=None)) is None


@pytest.fixture
def record(fake_flashinfer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A finished compile of two modules, recorded where ``is_compiled`` looks."""
    marker = tmp_path / "record.json"
    monkeypatch.setattr(warm, "marker_path", lambda *a: marker)
    specs = [fake_flashinfer(tmp_path, n) for n in ("prefill_sm90", "prefill_fa2")]
    for spec in specs:
        spec.build()
    marker.write_text(
        json.dumps(
            {
                "fingerprint": warm.fingerprint(),
                "env": warm.build_env(),
                "modules": [
                    dataclasses.asdict(
                        modules.Module(s.name, str(s.library), str(s.ninja_path), 1.0, True)
                    )
                    for s in specs
                ],
            }
        )
    )
    return marker, specs


CUDA0, BF16 = torch.device("cuda", 0), torch.bfloat16


def test_is_compiled_when_every_recorded_module_is_built(record) -> None:
    assert warm.is_compiled(CUDA0, BF16, 128)


def test_a_partial_cache_is_not_compiled_and_the_log_names_the_missing_module(
    record, caplog: pytest.LogCaptureFixture
) -> None:
    _, specs = record
    specs[1].library.unlink()
    with caplog.at_level(logging.INFO, logger="pagoda.attention.flashinfer"):
        assert not warm.is_compiled(CUDA0, BF16, 128)
    assert "prefill_fa2" in caplog.text and "is missing" in caplog.text


@needs_ninja
def test_an_out_of_date_module_is_not_compiled(record) -> None:
    _, specs = record
    _older(specs[0].library, specs[0].source)
    assert not warm.is_compiled(CUDA0, BF16, 128)


def test_a_record_from_other_backend_code_or_another_build_environment_is_not_trusted(
    record, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    marker, _ = record
    caplog.set_level(logging.INFO, logger="pagoda.attention.flashinfer")
    data = json.loads(marker.read_text())
    marker.write_text(json.dumps({**data, "fingerprint": "0" * 16}))
    assert not warm.is_compiled(CUDA0, BF16, 128)
    assert "other code" in caplog.text
    marker.write_text(json.dumps(data))
    assert warm.is_compiled(CUDA0, BF16, 128)
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", "9.0a")
    assert not warm.is_compiled(CUDA0, BF16, 128)
    assert "FLASHINFER_CUDA_ARCH_LIST" in caplog.text


def test_no_record_or_an_unreadable_one_is_not_compiled(record) -> None:
    marker, _ = record
    marker.write_text('{"fingerprint": ')
    assert not warm.is_compiled(CUDA0, BF16, 128)
    marker.unlink()
    assert not warm.is_compiled(CUDA0, BF16, 128)


def test_the_engine_log_says_when_a_module_compiled_at_first_use(
    fake_flashinfer, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    modules.log_engine_builds()
    spec = fake_flashinfer(tmp_path, "decode_fa2")
    with caplog.at_level(logging.DEBUG, logger="pagoda.attention.flashinfer"):
        spec.build_and_load()
        time.sleep(0.01)
        spec.build_and_load()
        with modules.recording():  # the compile command's own loads are its to report
            spec.library.unlink()
            spec.build_and_load()
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "flashinfer compiled decode_fa2 in" in warnings[0].getMessage()
    assert "at first use" in warnings[0].getMessage()
    assert "loaded decode_fa2" in caplog.text


class FakeWrapper:
    """FlashInfer's wrappers as the backend uses them: plan() loads the modules its kind needs
    (FA3 prefill on Hopper, FA2 for decode with tensor cores), run() attends (here: zeros)."""

    root: Path
    needs = {"prefill": ["prefill_fa3"], "decode": ["prefill_fa2", "decode_extra"]}
    loaded: dict[str, str] = {}

    def __init__(self, workspace, layout, **kwargs) -> None:
        self.kind = "decode" if "use_tensor_cores" in kwargs else "prefill"

    def plan(self, *args, **kwargs) -> None:
        for name in self.needs[self.kind]:
            if name not in self.loaded:  # FlashInfer caches a loaded module per process
                self.loaded[name] = FakeSpec(self.root, name).build_and_load()

    def run(self, q: torch.Tensor, kv, out=None) -> torch.Tensor:
        return torch.zeros_like(q) if out is None else out.zero_()


@pytest.fixture
def fake_wrappers(fake_flashinfer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    from pagoda_attention_flashinfer import backend

    fi = sys.modules["flashinfer"]
    fi.BatchPrefillWithPagedKVCacheWrapper = FakeWrapper
    fi.BatchDecodeWithPagedKVCacheWrapper = FakeWrapper
    monkeypatch.setattr(FakeWrapper, "root", tmp_path / "cached_ops", raising=False)
    monkeypatch.setattr(FakeWrapper, "loaded", {})
    monkeypatch.setattr(backend, "_wrappers", {})
    monkeypatch.setattr(backend, "_workspaces", {})
    monkeypatch.setattr(backend, "_WORKSPACE_BYTES", 1024)
    marker = tmp_path / "record.json"
    monkeypatch.setattr(warm, "marker_path", lambda *a: marker)
    return marker


def test_the_warm_builds_and_records_exactly_the_modules_the_steps_load(fake_wrappers) -> None:
    lines: list[str] = []
    warm.compile_kernels(torch.device("cpu"), torch.float32, 64, say=lines.append)
    record = json.loads(fake_wrappers.read_text())
    assert [m["name"] for m in record["modules"]] == ["prefill_fa3", "prefill_fa2", "decode_extra"]
    assert record["steps"] == ["prefill", "decode", "decode graph", "verification graph"]
    # The first module each kind asks for is built up front, together; one that a kind asks for
    # only after another (decode_extra) is built when the steps run; each line says its time.
    assert any(ln.startswith("flashinfer: compiled prefill_fa3 in ") for ln in lines)
    assert any(ln.startswith("flashinfer: compiled prefill_fa2 in ") for ln in lines)
    assert any(ln.startswith("flashinfer: compiled decode_extra in ") for ln in lines)
    assert lines[-1].startswith(
        "flashinfer: 3 modules (3 compiled) for float32, head size 64 ready in "
    )
    assert all(m["built"] for m in record["modules"])
    # Run again (another process) on a built cache: nothing compiles, and the record says so.
    lines.clear()
    FakeWrapper.loaded.clear()
    warm.compile_kernels(torch.device("cpu"), torch.float32, 64, say=lines.append)
    assert not any("compiled prefill" in ln or "compiled decode" in ln for ln in lines)
    assert "(0 compiled)" in lines[-1]
    assert warm.is_compiled(torch.device("cpu"), torch.float32, 64)
    Path(record["modules"][2]["library"]).unlink()  # a partial cache
    assert not warm.is_compiled(torch.device("cpu"), torch.float32, 64)
