"""Discovery: each plugin loads in isolation, failures are recorded and raised where they matter,
allow/deny lists, duplicate names and overrides, misspelled hooks, the plugin API version."""

from __future__ import annotations

import pytest

from pagoda.plugins import (
    DuplicateNameError,
    PluginAPIVersionError,
    PluginError,
    PluginLoadError,
    UnknownNameError,
    get_registry,
    plugin_records,
    reload_plugins,
)

GOOD = """
@hookimpl
def register_attention_backends(register):
    register("good_attn", "pagoda.attention.torch_native:TorchNativeBackend")

@hookimpl
def register_executors(register):
    register("good_exec", "pagoda.executor.uniproc:UniProcExecutor")
"""

BOOM = """
raise RuntimeError("boom at import")
"""


def _record(name: str):
    return next(r for r in plugin_records() if r.name == name)


def test_a_plugin_that_raises_on_import_is_recorded_and_the_others_load(fake_site) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    fake_site.add("pagoda-boom", "boom_plugin", BOOM, version="2.0.1", entry="boom")
    reload_plugins()
    boom = _record("boom")
    assert (boom.status, boom.distribution, boom.version) == ("failed", "pagoda-boom", "2.0.1")
    assert "RuntimeError: boom at import" in boom.traceback
    assert "boom_plugin.py" in boom.traceback
    assert _record("good_plugin").status == "loaded"
    assert _record("pagoda").status == "loaded"
    assert "good_attn" in get_registry("attention_backends").names()
    assert "torch_native" in get_registry("attention_backends").names()


def test_selecting_what_a_failed_plugin_would_register_raises_its_traceback(fake_site) -> None:
    import torch

    from pagoda.attention.selector import select_attention_backend

    fake_site.add("pagoda-boom", "boom_plugin", BOOM, entry="boom")
    reload_plugins()
    with pytest.raises(UnknownNameError) as info:
        select_attention_backend("boom", torch.device("cpu"), torch.float32, 64)
    msg = str(info.value)
    assert "plugin 'boom' (pagoda-boom 1.0.0) failed to load" in msg
    assert "boom_plugin.py" in msg and "RuntimeError: boom at import" in msg
    assert "available: " in msg and "torch_native" in msg
    assert isinstance(info.value.__cause__, RuntimeError)


def test_plugin_that_fails_after_import_points_its_own_names_at_its_error(fake_site) -> None:
    fake_site.add(
        "pagoda-typo",
        "typo_plugin",
        """
        @hookimpl
        def register_attention_backends(register):
            register("typo_attn", "pagoda.attention.torch_native:TorchNativeBackend")

        @hookimpl
        def on_step_ends(scheduler_output):
            pass
        """,
    )
    reload_plugins()
    rec = _record("typo_plugin")
    assert rec.status == "failed"
    assert "'on_step_ends', which is not a Pagoda hook (did you mean 'on_step_end'?)" in rec.reason
    with pytest.raises(PluginLoadError, match="plugin 'typo_plugin' .* failed to load"):
        get_registry("attention_backends").get("typo_attn")


def test_misspelled_registry_hook_is_an_error_that_names_the_right_hook(fake_site) -> None:
    fake_site.add(
        "pagoda-typo",
        "typo_plugin",
        """
        @hookimpl
        def register_attention_backend(register):
            register("typo_attn", "pagoda.attention.torch_native:TorchNativeBackend")
        """,
    )
    reload_plugins()
    assert "did you mean 'register_attention_backends'" in _record("typo_plugin").reason
    with pytest.raises(PluginLoadError, match="register_attention_backend"):
        get_registry("attention_backends").get("typo_attn")


def test_hook_function_without_the_marker_is_an_error(fake_site) -> None:
    fake_site.add(
        "pagoda-nomark",
        "nomark_plugin",
        """
        def register_executors(register):
            register("nomark", "pagoda.executor.uniproc:UniProcExecutor")
        """,
    )
    reload_plugins()
    assert "register_executors() without @pagoda.hookimpl" in _record("nomark_plugin").reason


def test_hook_with_a_parameter_the_spec_lacks_is_an_error(fake_site) -> None:
    fake_site.add(
        "pagoda-badsig",
        "badsig_plugin",
        """
        @hookimpl
        def register_models(reg):
            reg("X", "x:Y")
        """,
    )
    reload_plugins()
    rec = _record("badsig_plugin")
    assert rec.status == "failed" and "reg" in rec.reason
    assert rec.plugin is not None and not _pm_has(rec.plugin)


def _pm_has(plugin: object) -> bool:
    from pagoda.plugins import get_plugin_manager

    return get_plugin_manager().is_registered(plugin)


@pytest.mark.parametrize(
    ("api", "message"),
    [
        (None, "does not say which plugin API it was written for: add `PAGODA_PLUGIN_API = 1`"),
        (2, "was written for Pagoda plugin API 2, but this pagoda-core provides plugin API 1"),
    ],
)
def test_plugin_api_version_missing_or_different_is_a_clear_error(fake_site, api, message) -> None:
    fake_site.add("pagoda-old", "old_plugin", GOOD, api=api)
    reload_plugins()
    rec = _record("old_plugin")
    assert rec.status == "failed" and isinstance(rec.exception, PluginAPIVersionError)
    assert message in rec.reason
    with pytest.raises(PluginLoadError, match="PAGODA_PLUGIN_API|plugin API"):
        get_registry("executors").get("good_exec")


def test_registry_hook_that_raises_fails_the_whole_plugin(fake_site) -> None:
    fake_site.add(
        "pagoda-half",
        "half_plugin",
        """
        @hookimpl
        def register_attention_backends(register):
            register("half_attn", "pagoda.attention.torch_native:TorchNativeBackend")
            raise ValueError("half way")
        """,
    )
    reload_plugins()
    rec = _record("half_plugin")
    assert rec.status == "failed" and "ValueError: half way" in rec.reason
    assert "half_attn" not in get_registry("attention_backends").names()
    with pytest.raises(PluginLoadError, match="half way"):
        get_registry("attention_backends").get("half_attn")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        ('register("x", "no_colon")', "a lazy target looks like 'package.module:Name'"),
        ('register("", "a:b")', "needs a non-empty attention backend name"),
        ('register("x", 42)', "must be a 'package.module:Name' string or a class or factory"),
    ],
)
def test_bad_registration_fails_the_plugin(fake_site, call, message) -> None:
    fake_site.add(
        "pagoda-bad",
        "bad_plugin",
        f"""
        @hookimpl
        def register_attention_backends(register):
            {call}
        """,
    )
    reload_plugins()
    assert message in _record("bad_plugin").reason


def test_target_that_fails_to_import_raises_naming_the_plugin(fake_site) -> None:
    fake_site.add(
        "pagoda-ghost",
        "ghost_plugin",
        """
        @hookimpl
        def register_attention_backends(register):
            register("ghost", "no_such_module_for_pagoda_tests:Backend")
        """,
    )
    reload_plugins()
    with pytest.raises(PluginLoadError) as info:
        get_registry("attention_backends").get("ghost")
    assert "plugin 'ghost_plugin' (pagoda-ghost 1.0.0) could not be imported" in str(info.value)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_unknown_name_lists_the_known_ones_and_a_close_match() -> None:
    with pytest.raises(UnknownNameError) as info:
        get_registry("attention_backends").get("torch_nativ")
    assert "unknown attention backend 'torch_nativ'; available: " in str(info.value)
    assert "(did you mean 'torch_native'?)" in str(info.value)


# ---- allow and deny lists -----------------------------------------------------------------------


def test_allow_list_loads_only_the_plugins_it_names(fake_site, monkeypatch) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    fake_site.add("pagoda-boom", "boom_plugin", BOOM, entry="boom")
    monkeypatch.setenv("PAGODA_PLUGINS", "good_plugin")
    reload_plugins()
    assert _record("good_plugin").status == "loaded"
    assert (_record("boom").status, _record("boom").reason) == (
        "disabled",
        "not listed in PAGODA_PLUGINS",
    )
    assert _record("pagoda").status == "loaded"  # the core's own plugin always loads
    with pytest.raises(UnknownNameError, match="'boom' .* was not loaded"):
        get_registry("attention_backends").get("boom")


def test_deny_list_matches_a_distribution_name(fake_site, monkeypatch) -> None:
    fake_site.add("pagoda-good", "good_plugin", GOOD)
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "pagoda-good")
    reload_plugins()
    assert _record("good_plugin").reason == "disabled by PAGODA_DISABLE_PLUGINS"
    assert "good_attn" not in get_registry("attention_backends").names()


@pytest.mark.parametrize("var", ["PAGODA_PLUGINS", "PAGODA_DISABLE_PLUGINS"])
def test_allow_or_deny_list_naming_no_installed_plugin_is_an_error(monkeypatch, var) -> None:
    monkeypatch.setenv(var, "no-such-plugin")
    with pytest.raises(PluginError, match=f"{var} names 'no-such-plugin', which matches no"):
        reload_plugins()


def test_the_core_plugin_cannot_be_disabled(monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_DISABLE_PLUGINS", "pagoda")
    with pytest.raises(PluginError, match="the core's own plugin"):
        reload_plugins()


# ---- duplicate names and overrides --------------------------------------------------------------


def _registers(name: str, target: str, override: bool = False) -> str:
    return f"""
        @hookimpl
        def register_attention_backends(register):
            register({name!r}, {target!r}, override={override})
        """


def test_a_name_registered_twice_is_an_error_naming_both_plugins(fake_site) -> None:
    fake_site.add("pagoda-one", "one_plugin", _registers("dup", "a:B"))
    fake_site.add("pagoda-two", "two_plugin", _registers("dup", "c:D"))
    reload_plugins()
    with pytest.raises(DuplicateNameError) as info:
        get_registry("attention_backends").get("dup")
    assert "pagoda-one 1.0.0" in str(info.value) and "pagoda-two 1.0.0" in str(info.value)
    assert "override=True" in str(info.value)
    assert _record("one_plugin").status == _record("two_plugin").status == "loaded"


@pytest.mark.parametrize("module", ["aa_override_plugin", "zz_override_plugin"])
def test_override_replaces_another_plugins_name_whatever_the_load_order(fake_site, module) -> None:
    target = "pagoda.testing.attention:AttentionCase"
    fake_site.add("pagoda-override", module, _registers("torch_native", target, override=True))
    reload_plugins()
    reg = get_registry("attention_backends")
    assert reg.registration("torch_native").plugin.name == module
    assert reg.get("torch_native").__name__ == "AttentionCase"


def test_two_overrides_of_one_name_conflict(fake_site) -> None:
    fake_site.add("pagoda-one", "one_plugin", _registers("torch_native", "a:B", override=True))
    fake_site.add("pagoda-two", "two_plugin", _registers("torch_native", "c:D", override=True))
    reload_plugins()
    with pytest.raises(DuplicateNameError):
        get_registry("attention_backends").get("torch_native")
