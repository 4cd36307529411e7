"""Model impls (``register_model_impls``, ``model.impl``): a plugin adds an architecture the
core's ``native`` impl refuses; ``auto`` takes the highest priority that accepts; a refusal
lists every impl's reason; ``pagoda plugins --model`` says which one would serve a folder."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import Attention
from pagoda.attention.spec import AttentionSpec
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


def test_auto_asks_no_impl_below_the_first_that_accepts(impls, monkeypatch) -> None:
    """Impls are asked from the highest priority down and the first that accepts is chosen: an
    impl below it is never asked (the transformers impl's probe imports transformers' modeling
    code, seconds of every engine start, to lose to native)."""
    asked: list[str] = []
    for impl in (TinyImpl, _RefusesAll, NativeModelImpl):  # (HigherImpl: TinyImpl's, as cls)
        original = impl.__dict__["supports"].__func__

        def spy(cls, hf_config, architecture, original=original):
            asked.append(cls.__name__)
            return original(cls, hf_config, architecture)

        monkeypatch.setattr(impl, "supports", classmethod(spy))
    assert select_model_impl("auto", _config("LlamaForCausalLM"))[0] == "native"
    assert [a for a in asked if a != "TinyImpl"] == ["_RefusesAll", "NativeModelImpl"]
    assert "TinyImpl" not in asked and "HigherImpl" not in asked
    asked.clear()
    assert select_model_impl("auto", _config())[0] == "higher"
    assert asked == ["_RefusesAll", "NativeModelImpl", "HigherImpl"]


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
    ours = ["higher", "native", "refuses_all", "tiny"]  # installed plugins may add others
    assert [n for n in names if n in ours] == ours and names == sorted(names)


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


class _MixedModel(torch.nn.Module):
    """Two attention layers of different layouts: 4 query heads over 2 KV heads of 16, then 2
    over 1 of 32 with a window of 5 keys. Residual attention only (no MLP), enough to put each
    layer's cache and mask on the path from the prompt to the next token."""

    def __init__(self, shape: ModelShape, backend: type[AttentionBackend]) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.qkv = torch.nn.ModuleList()
        self.o = torch.nn.ModuleList()
        self.attn = torch.nn.ModuleList()
        for i, s in enumerate(shape.attention):
            width = (s.num_heads + 2 * s.num_kv_heads) * s.head_size
            self.qkv.append(torch.nn.Linear(shape.hidden_size, width, bias=False))
            self.o.append(torch.nn.Linear(s.num_heads * s.head_size, shape.hidden_size))
            self.attn.append(Attention(backend, s.num_heads, s.head_size, s.scale,
                                       s.num_kv_heads, i, s))  # fmt: skip
        self.lm_head = torch.nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def _split(self, i: int, x: torch.Tensor) -> list[torch.Tensor]:
        s = self.attn[i].spec
        return list(self.qkv[i](x).split(
            [s.num_heads * s.head_size, s.num_kv_heads * s.head_size,
             s.num_kv_heads * s.head_size], dim=-1))  # fmt: skip

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        for i in range(len(self.attn)):
            x = x + self.o[i](self.attn[i](*self._split(i, x)))
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def dense_logits(self, tokens: list[int]) -> torch.Tensor:
        """The same model over the whole sequence at once, masks built here: the reference."""
        x = self.embed(torch.tensor(tokens))
        n = len(tokens)
        pos = torch.arange(n)
        for i in range(len(self.attn)):
            s = self.attn[i].spec
            q, k, v = (t.view(n, -1, s.head_size).transpose(0, 1) for t in self._split(i, x))
            rep = s.num_heads // s.num_kv_heads
            k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
            seen = pos[:, None] >= pos[None, :]
            if s.sliding_window is not None:
                seen &= pos[:, None] - pos[None, :] < s.sliding_window
            logits = (q @ k.transpose(1, 2)) * s.scale
            out = logits.masked_fill(~seen, float("-inf")).softmax(-1) @ v
            x = x + self.o[i](out.transpose(0, 1).reshape(n, -1))
        return self.compute_logits(x)


class _MixedImpl(TinyImpl):
    @classmethod
    def shape(cls, hf_config: dict[str, Any], tensor_parallel_size: int) -> ModelShape:
        specs = (AttentionSpec(4, 2, 16, 0.25), AttentionSpec(2, 1, 32, 0.5, sliding_window=5))
        return ModelShape(TINY_ARCH, 128, 64, 2, 256, specs, config=None, eos_token_id=2)

    @classmethod
    def model_class(cls, shape: ModelShape) -> Any:
        return lambda config, backend: _MixedModel(shape, backend)


def test_each_layer_gets_a_cache_of_its_own_layout_and_window_layers_see_the_whole_context(
    tmp_path,
) -> None:
    """The KV cache follows the declared specs layer by layer (heads and head sizes differ), and
    a window layer keeps every block: greedy tokens through the paged cache (blocks of 4,
    chunked prefill of 8 tokens, a prefix-cache hit on the second run) are the dense model's."""
    with plugin_registered(_mixed_plugin(_MixedImpl), "mixed_impl_test"):
        llm = LLM(
            model=str(_model(tmp_path)), load_format="dummy", device="cpu", model_impl="mixed",
            block_size=4, max_num_batched_tokens=8, enable_prefix_caching=True,
            max_model_len=64, kv_cache_memory_bytes=1 << 20,
        )  # fmt: skip
        runner = llm.engine.engine_core.executor.worker.model_runner
        model = runner.model
        assert [tuple(c.shape) for c in runner.kv_caches] == [
            TorchNativeBackend.get_kv_cache_shape(c.shape[1], 4, heads, size)
            for c, (heads, size) in zip(runner.kv_caches, [(2, 16), (1, 32)])
        ]
        assert runner.kv_cache_block_bytes() == 4 * (2 * 2 * 16 + 2 * 1 * 32) * 4
        torch.manual_seed(0)
        with torch.no_grad():  # unit-scale weights, a weak embedding: the window decides 11 of
            for param in model.parameters():  # the 12 tokens (dropping it changes them)
                param.copy_(torch.randn_like(param) * param.shape[-1] ** -0.5)
            model.embed.weight.mul_(0.3)
        prompt = [5, 9, 17, 33, 65, 7, 11, 13, 19, 23, 29, 31, 37]
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        tokens = list(prompt)
        with torch.inference_mode():
            for _ in range(12):
                tokens.append(int(model.dense_logits(tokens)[-1].argmax()))
        for _ in range(2):  # the second run hits the prefix cache
            out = llm.generate([{"prompt_token_ids": prompt}], params)
            assert list(out[0].outputs[0].token_ids) == tokens[len(prompt) :]


def _mixed_plugin(impl: type[ModelImpl]) -> Any:
    class _Plugin:
        PAGODA_PLUGIN_API = 1

        @hookimpl
        def register_model_impls(self, register):
            register("mixed", impl)

    return _Plugin()


def test_choosing_native_imports_no_modeling_code_of_transformers() -> None:
    """In a fresh process, choosing the impl of a Llama (``auto``) resolves every installed impl
    to read its priority, and asks none below native: transformers' modeling code, which the
    transformers impl's probe imports (seconds of an engine's start), stays unimported."""
    code = (
        "import sys\n"
        "from pagoda.models.impl import select_model_impl\n"
        f"config = {_config('LlamaForCausalLM')!r}\n"
        "print(select_model_impl('auto', config)[0])\n"
        "print(sorted(m for m in sys.modules if m.startswith('transformers.modeling')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout.splitlines()
    assert out == ["native", "[]"]
