"""``pagoda plugins``: a table of plugins (distribution, version, what each registers, status),
the traceback of each that failed, duplicate names; ``--check`` and ``--json``."""

from __future__ import annotations

import json

from pagoda.entrypoints.cli import main

GOOD = """
@hookimpl
def register_attention_backends(register):
    register("good_attn", "pagoda.attention.torch_native:TorchNativeBackend")

@hookimpl
def on_step_end(outputs):
    pass
"""


def _plugins(capsys, *args: str) -> tuple[int, str]:
    code = main(["plugins", *args])
    return code, capsys.readouterr().out


def test_plugins_table_shows_each_plugin_and_the_error_of_one_that_failed(
    fake_site, capsys
) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD, version="0.3.1")
    fake_site.add("pagoda-boom", "boom_plugin", "raise ImportError('no libfoo.so')\n", entry="boom")
    code, out = _plugins(capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split() == ["PLUGIN", "DISTRIBUTION", "VERSION", "STATUS", "PROVIDES"]
    good = next(line for line in lines if line.startswith("good_plugin"))
    assert good.split()[:4] == ["good_plugin", "pagoda-good", "0.3.1", "loaded"]
    assert "attention_backends: good_attn; hooks: on_step_end" in good
    core = next(line for line in lines if line.startswith("pagoda "))
    assert "torch_native" in core and "uniproc" in core and "LlamaForCausalLM" in core
    boom = next(line for line in lines if line.startswith("boom "))
    assert "pagoda-boom" in boom and "failed: ImportError: no libfoo.so" in boom
    assert "plugin 'boom' (pagoda-boom 1.0.0) failed to load:" in out
    assert "Traceback (most recent call last):" in out and "boom_plugin.py" in out


def test_plugins_check_exits_1_when_a_plugin_failed(fake_site, capsys) -> None:
    assert _plugins(capsys, "--check")[0] == 0
    fake_site.add("pagoda-boom", "boom_plugin", "raise ImportError('x')\n", entry="boom")
    assert _plugins(capsys, "--check")[0] == 1


def test_plugins_check_exits_1_on_a_duplicate_name(fake_site, capsys) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    fake_site.add("pagoda-again", "again_plugin", GOOD)
    code, out = _plugins(capsys, "--check")
    assert code == 1
    assert "attention backend 'good_attn' is registered by more than one plugin" in out


def test_plugins_json_lists_the_same_records(fake_site, capsys) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    code, out = _plugins(capsys, "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["good_plugin"]["registers"] == {"attention_backends": ["good_attn"]}
    assert rows["good_plugin"]["hooks"] == ["on_step_end"]
    assert rows["pagoda"]["distribution"] == "pagoda-core"


CANNOT_RUN = """
from pagoda.attention.torch_native import TorchNativeBackend

class NeedsGpu(TorchNativeBackend):
    name = "needs_gpu"
    priority = 7
    requires = ("no_such_kernel_lib_xyz",)

    @classmethod
    def supports(cls, device, dtype, head_size):
        return device.type == "cuda"

@hookimpl
def register_attention_backends(register):
    register("needs_gpu", "gpu_only_plugin:NeedsGpu")
"""


def test_plugins_table_says_which_backends_cannot_run_here_and_why(fake_site, capsys) -> None:
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("the backend under test runs where there is CUDA")
    fake_site.add("pagoda-gpu-only", "gpu_only_plugin", CANNOT_RUN)
    code, out = _plugins(capsys)
    assert code == 0
    lines = out.splitlines()
    head = lines.index(next(line for line in lines if line.startswith("ATTENTION BACKEND")))
    assert lines[head].split() == [
        "ATTENTION", "BACKEND", "PLUGIN", "PRIORITY", "RUNS", "HERE", "(cpu,", "float32)"
    ]
    rows = {line.split()[0]: line for line in lines[head + 1 :] if line.strip()}
    assert rows["torch_native"].split()[1:] == ["pagoda", "0", "yes"]
    assert rows["needs_gpu"].split()[1:3] == ["gpu_only_plugin", "7"]
    assert rows["needs_gpu"].endswith(
        "no: no_such_kernel_lib_xyz not installed; supports(cpu, float32) is False"
    )
    code, out = _plugins(capsys, "--json")
    record = next(r for r in json.loads(out) if r["name"] == "gpu_only_plugin")
    assert record["attention_backends"]["needs_gpu"]["runs_here"] is False
    assert "no_such_kernel_lib_xyz" in record["attention_backends"]["needs_gpu"]["reason"]
