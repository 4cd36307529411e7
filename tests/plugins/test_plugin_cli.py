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
    assert good.split()[:4] == ["good_plugin", "pagoda-good", "0.3.1", "ok"]
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
