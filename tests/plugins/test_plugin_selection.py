"""Selection: ``auto`` picks the best backend that supports the model; a name is checked; the same
rules for executors, speculative proposers and grammar backends."""

from __future__ import annotations

import pytest
import torch

from pagoda import hookimpl
from pagoda.attention.selector import select_attention_backend
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.plugins import (
    PluginLoadError,
    PluginSelectionError,
    UnknownNameError,
    plugin_registered,
    reload_plugins,
    select,
)

CPU = torch.device("cpu")


class Head64Backend(TorchNativeBackend):
    name = "head64"
    priority = 10

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return head_size == 64


class NeedsLibraryBackend(TorchNativeBackend):
    """The best backend for every model, were its kernel library installed (it imports that
    only when it runs, as FlashInfer's does)."""

    name = "needs_library"
    priority = 1000
    requires = ("no_such_kernel_library_for_pagoda_tests",)

    @classmethod
    def is_compiled(cls, device, dtype, head_size) -> bool:
        raise AssertionError("asked whether a backend whose library is missing is compiled")


class SelectionPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("head64", Head64Backend)
        register("needs_library", NeedsLibraryBackend)
        register("broken", "no_such_module_for_pagoda_tests:Backend")
        register("not_a_backend", "pagoda.testing.attention:AttentionCase")

    @hookimpl
    def register_spec_proposers(self, register):
        register("fake_ngram", "pagoda.testing.attention:AttentionCase")


@pytest.fixture
def selection_plugin():
    with plugin_registered(SelectionPlugin(), "selection") as rec:
        yield rec


def test_auto_picks_the_highest_priority_backend_that_supports_the_model(selection_plugin) -> None:
    assert select_attention_backend("auto", CPU, torch.float32, 64) is Head64Backend
    assert select_attention_backend("auto", CPU, torch.float32, 128) is TorchNativeBackend


def test_a_named_backend_that_does_not_support_the_model_says_which_do(selection_plugin) -> None:
    with pytest.raises(PluginSelectionError) as info:
        select_attention_backend("head64", CPU, torch.float32, 128)
    msg = str(info.value)
    assert "'head64' does not support device=cpu, dtype=float32, head_size=128" in msg
    assert "ones that do: " in msg and "torch_native" in msg


def test_auto_passes_over_a_backend_whose_library_is_missing(selection_plugin) -> None:
    assert select_attention_backend("auto", CPU, torch.float32, 64) is Head64Backend


def test_a_named_backend_whose_library_is_missing_says_so(selection_plugin) -> None:
    with pytest.raises(PluginSelectionError) as info:
        select_attention_backend("needs_library", CPU, torch.float32, 64)
    message = str(info.value)
    assert "'no_such_kernel_library_for_pagoda_tests', which is not installed" in message
    assert "head64" in message


def test_a_named_backend_that_fails_to_import_raises_with_its_cause(selection_plugin) -> None:
    with pytest.raises(PluginLoadError, match="plugin 'selection'") as info:
        select_attention_backend("broken", CPU, torch.float32, 64)
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_a_named_target_that_is_not_an_attention_backend_is_an_error(selection_plugin) -> None:
    with pytest.raises(PluginLoadError, match="not a subclass of .*AttentionBackend"):
        select_attention_backend("not_a_backend", CPU, torch.float32, 64)


def test_auto_with_no_supporting_backend_explains_each_one(selection_plugin) -> None:
    with pytest.raises(PluginSelectionError) as info:
        select_attention_backend("auto", CPU, torch.int8, 128)
    msg = str(info.value)
    assert "no attention backend supports device=cpu, dtype=int8, head_size=128" in msg
    assert "broken: " in msg and "could not be imported" in msg
    assert "torch_native: does not support it" in msg


def test_unknown_executor_proposer_and_grammar_names_list_the_known_ones(selection_plugin) -> None:
    with pytest.raises(UnknownNameError, match="unknown executor 'mp'; available: .*uniproc"):
        select("executors", "mp")
    with pytest.raises(UnknownNameError, match="unknown spec proposer 'medusa'; .*fake_ngram"):
        select("spec_proposers", "medusa")
    assert select("spec_proposers", "fake_ngram").__name__ == "AttentionCase"


def test_auto_grammar_backend_with_none_installed_says_to_install_one(monkeypatch) -> None:
    # Only the core loads: it ships no grammar backend, whatever this environment has installed.
    monkeypatch.setenv("PAGODA_PLUGINS", "pagoda")
    reload_plugins()
    try:
        with pytest.raises(PluginSelectionError, match="no grammar backend .* install a plugin"):
            select("grammar_backends", "auto")
    finally:
        monkeypatch.delenv("PAGODA_PLUGINS")
        reload_plugins()
