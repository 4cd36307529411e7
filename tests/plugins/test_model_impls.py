"""Model impls (``register_model_impls``, ``model.impl``): a plugin adds an architecture the
core's ``native`` impl refuses; ``auto`` takes the highest priority that accepts; a refusal
lists every impl's reason; ``pagoda plugins --model`` says which one would serve a folder."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.attention.backend import AttentionBackend
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.config import EngineConfig
from pagoda.entrypoints.cli import main
from pagoda.model_info import ModelInfo
from pagoda.models.impl import ModelImpl, select_model_impl, verdicts
from pagoda.models.native import NativeModelImpl
from pagoda.models.shape import ModelShape
from pagoda.plugins import UnknownNameError, get_registry, plugin_registered

_TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=2,
)
TINY_ARCH = "TinyPluginForCausalLM"


class TinyImpl(ModelImpl):
    """Serves ``TinyPluginForCausalLM`` as a Llama."""

    priority = 10

    @classmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        return None if architecture == TINY_ARCH else f"only {TINY_ARCH}"

    @classmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        # It keeps its own name: the runner builds what model_class says, not a name lookup.
        llama = {**hf_config, "architectures": ["LlamaForCausalLM"]}
        shape = NativeModelImpl.shape(llama, tensor_parallel_size)
        return dataclasses.replace(shape, architecture=TINY_ARCH)

    @classmethod
    def model_class(cls, shape: ModelShape) -> Any:
        from pagoda.models.llama import LlamaForCausalLM

        return LlamaForCausalLM


class HigherImpl(TinyImpl):
    priority = 20


class ModelImplPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_model_impls(self, register):
        register("tiny", TinyImpl)
        register("higher", HigherImpl)
        register("refuses_all", _RefusesAll)


class _RefusesAll(TinyImpl):
    priority = 1000

    @classmethod
    def supports(cls, hf_config: dict[str, Any], architecture: str) -> str | None:
        return "it serves nothing"


@pytest.fixture
def impls() -> Iterator[None]:
    with plugin_registered(ModelImplPlugin(), "model_impls_test"):
        yield


def _model(tmp_path: Path, arch: str = TINY_ARCH) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": [arch], **_TINY}))
    return tmp_path


def _config(arch: str = TINY_ARCH) -> dict[str, Any]:
    return {"architectures": [arch], **_TINY}


def test_native_serves_the_llama_family_and_is_registered_by_the_core() -> None:
    assert get_registry("model_impls").get("native") is NativeModelImpl
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert select_model_impl("auto", _config(arch)) == ("native", NativeModelImpl)


def test_native_refuses_an_unknown_architecture_with_its_reason() -> None:
    reason = NativeModelImpl.supports(_config("GPT2LMHeadModel"), "GPT2LMHeadModel")
    assert reason is not None
    assert "unsupported architecture GPT2LMHeadModel" in reason and "LlamaForCausalLM" in reason
    with pytest.raises(ValueError, match="model.impl='native' cannot serve .*GPT2LMHeadModel"):
        select_model_impl("native", _config("GPT2LMHeadModel"))


def test_auto_takes_the_highest_priority_impl_that_accepts(impls) -> None:
    assert select_model_impl("auto", _config()) == ("higher", HigherImpl)
    # native (priority 100) still wins its own architectures over the plugin's impls.
    assert select_model_impl("auto", _config("LlamaForCausalLM"))[0] == "native"


def test_a_plugin_impl_is_selected_by_name(impls) -> None:
    assert select_model_impl("tiny", _config()) == ("tiny", TinyImpl)
    with pytest.raises(ValueError, match="model.impl='tiny' cannot serve .*: only Tiny"):
        select_model_impl("tiny", _config("LlamaForCausalLM"))
    with pytest.raises(UnknownNameError, match="unknown model impl 'nope'.*native"):
        select_model_impl("nope", _config())


def test_no_impl_accepting_is_one_line_listing_each_impl_and_its_reason(impls) -> None:
    with pytest.raises(ValueError) as info:
        select_model_impl("auto", _config("GPT2LMHeadModel"))
    msg = str(info.value)
    assert "\n" not in msg and "no model impl accepts architecture GPT2LMHeadModel" in msg
    assert "native: unsupported architecture GPT2LMHeadModel" in msg
    assert "refuses_all: it serves nothing" in msg
    assert "tiny: only TinyPluginForCausalLM" in msg and "higher: only" in msg
    names = [n for n, _, _ in verdicts(_config("GPT2LMHeadModel"))]
    assert names == ["higher", "native", "refuses_all", "tiny"]


def test_model_info_records_the_impl_and_its_arch_config(impls, tmp_path) -> None:
    model = str(_model(tmp_path))
    config = EngineConfig.load(overrides={"model": model, "device": "cpu", "load_format": "dummy"})
    info = ModelInfo.from_config(config)
    assert info.model_impl == "higher" and info.shape.hidden_size == 64
    named = EngineConfig.load(
        overrides={"model": model, "device": "cpu", "load_format": "dummy", "model_impl": "tiny"}
    )
    assert ModelInfo.from_config(named).model_impl == "tiny"


def test_an_engine_serves_an_architecture_only_a_plugin_impl_accepts(impls, tmp_path) -> None:
    llm = LLM(
        model=str(_model(tmp_path)),
        load_format="dummy",
        device="cpu",
        model_impl="tiny",
        max_model_len=64,
        kv_cache_memory_bytes=1 << 20,
    )
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True),
    )
    assert llm.engine.info.model_impl == "tiny" and llm.engine.info.shape.architecture == TINY_ARCH
    assert len(out[0].outputs[0].token_ids) == 3


def test_model_impl_key_round_trips_with_its_source(monkeypatch, tmp_path) -> None:
    assert EngineConfig.load().model.impl == "auto"
    by_arg = EngineConfig.load(overrides={"model_impl": "native"})
    assert by_arg.model.impl == "native"
    assert by_arg.source_of("model.impl") == "argument model_impl"
    monkeypatch.setenv("PAGODA_MODEL__IMPL", "tiny")
    by_env = EngineConfig.load()
    assert by_env.model.impl == "tiny" and "PAGODA_MODEL__IMPL" in by_env.source_of("model.impl")


def test_plugins_model_names_the_chosen_impl_and_each_verdict(impls, tmp_path, capsys) -> None:
    code = main(["plugins", "--model", str(_model(tmp_path))])
    out = capsys.readouterr().out
    assert code == 0
    assert "served by model impl 'higher' (auto)" in out
    assert "refuses_all" in out and "refuses: it serves nothing" in out
    assert "accepts (chosen)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "(chosen)" in lines["higher"] and "refuses: unsupported architecture" in lines["native"]


def test_plugins_model_exits_1_when_no_impl_accepts(tmp_path, capsys) -> None:
    code = main(["plugins", "--model", str(_model(tmp_path, "GPT2LMHeadModel"))])
    out = capsys.readouterr().out
    assert code == 1 and "no model impl accepts it" in out


def test_plugins_lists_the_registered_model_impls(impls, capsys) -> None:
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert "MODEL IMPL" in out
    native = next(line for line in out.splitlines() if line.startswith("native "))
    assert "pagoda.models.native:NativeModelImpl" in native


class _PlainOnlyBackend(TorchNativeBackend):
    """torch-native that declares only plain causal attention (the contract's default)."""

    unsupported = classmethod(AttentionBackend.unsupported.__func__)


class _SinksImpl(TinyImpl):
    """Declares a sink logit on every layer (its model class, a Llama, has none of its own)."""

    @classmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        shape = super().shape(hf_config, tensor_parallel_size)
        sinks = tuple(dataclasses.replace(s, sinks=True) for s in shape.attention)
        return dataclasses.replace(shape, attention=sinks)


class _SinksPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_model_impls(self, register):
        register("sinks_impl", _SinksImpl)

    @hookimpl
    def register_attention_backends(self, register):
        register("plain_only", _PlainOnlyBackend)


def test_the_impls_attention_specs_steer_the_backend_selection(tmp_path) -> None:
    """The runner selects the backend with the impl's specs, before the model is built: a
    backend named explicitly that lacks a feature some layer needs stops the engine, naming it
    and the layers (the Llama layers themselves, plain, would have passed)."""
    with plugin_registered(_SinksPlugin(), "sinks_impl_test"):
        kw = dict(model=str(_model(tmp_path)), load_format="dummy", device="cpu")
        kw.update(model_impl="sinks_impl", max_model_len=64, kv_cache_memory_bytes=1 << 20)
        with pytest.raises(ValueError, match=r"sinks \(layers 0, 1\)"):
            LLM(**kw, attention_backend="plain_only")
        # auto passes over it to torch_native; then the built model (a Llama, without sinks)
        # is found to differ from what the impl declared, which the KV cache was laid out from.
        with pytest.raises(
            ValueError, match=r"LlamaForCausalLM built 2 attention layers whose specs differ"
        ):
            LLM(**kw, attention_backend="auto")
