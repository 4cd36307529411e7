"""What the transformers impl refuses, each by name in one line; weights with no home or left
unset; random weights; the checkpoint format ``save_pretrained`` writes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from pagoda_models_transformers.impl import TransformersModelImpl
from pagoda_models_transformers.probe import build_config
from pagoda_models_transformers.tiny import tiny_config
from safetensors import safe_open
from tf_parity import build_ours, hf_model, save
from transformers import CONFIG_MAPPING

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.attention.backend import AttentionBackend
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.models.impl import named_architecture, select_model_impl
from pagoda.plugins import plugin_registered


def _config(model_type: str, **changes: Any) -> dict[str, Any]:
    cfg = tiny_config(model_type) or CONFIG_MAPPING[model_type]()
    return {**cfg.to_dict(), **changes}


REFUSED = {
    "encoder-decoder": (_config("t5"), "t5 is an encoder-decoder model"),
    "linear attention": (_config("qwen3_next"), "layers of type linear_attention"),
    "multimodal": (_config("llava"), "composite (multimodal) model with text_config"),
    "remote code": (
        {"model_type": "my_model", "auto_map": {"AutoConfig": "x.Y"}},
        "needs remote code (auto_map)",
    ),
    "unknown type": ({"model_type": "no_such_model"}, "unknown to transformers"),
    "no type": ({"architectures": ["GPT2LMHeadModel"]}, "config.json names no model_type"),
    "dynamic rope": (
        _config(
            "llama", rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
        ),  # fmt: skip
        "dynamic RoPE",
    ),
    "bidirectional": (_config("bert"), "attends bidirectionally"),
    "own attention table": (_config("gpt_neo"), "picks its attention from a table of its own"),
}


@pytest.mark.parametrize("case", REFUSED)
def test_refuses_by_name(case: str) -> None:
    hf_config, reason = REFUSED[case]
    got = TransformersModelImpl.supports(hf_config, named_architecture(hf_config))
    assert got is not None and reason in got and "\n" not in got


def test_no_impl_accepting_lists_each_impls_reason_in_one_line() -> None:
    with pytest.raises(ValueError) as info:
        select_model_impl("auto", _config("t5", architectures=["T5ForConditionalGeneration"]))
    msg = str(info.value)
    assert (
        "\n" not in msg and "no model impl accepts architecture T5ForConditionalGeneration" in msg
    )
    assert "native: " in msg and "transformers: t5 is an encoder-decoder model" in msg


def test_infinity_as_transformers_writes_it_builds_the_config() -> None:
    """config.json has no Infinity: transformers writes ``{"__float__": "Infinity"}``."""
    inf = {"__float__": "Infinity"}
    assert build_config(_config("mamba2", time_step_limit=[0.0, inf])).time_step_limit[1] == float(
        "inf"
    )


def test_sub_configs_without_a_model_type_are_parts_not_a_composite() -> None:
    """DBRX's ``attn_config`` and ``ffn_config`` are parts of its own config, not other models."""
    got = TransformersModelImpl.supports(_config("dbrx"), "DbrxForCausalLM")
    assert got is not None and "composite" not in got


def test_the_text_model_of_a_multimodal_type_is_served_by_its_causal_lm() -> None:
    """``Emu3ForCausalLM`` saves an ``emu3_text_model`` config, which no causal LM is mapped to."""
    text = _config("emu3")["text_config"]
    assert TransformersModelImpl.supports(text, "Emu3ForCausalLM") is None
    assert "no causal-LM class" in TransformersModelImpl.supports(text, "Emu3TextModel")


def test_auto_prefers_native_and_takes_transformers_for_the_rest() -> None:
    llama = _config("llama", architectures=["LlamaForCausalLM"])
    assert select_model_impl("auto", llama)[0] == "native"
    gemma = _config("gemma2", architectures=["Gemma2ForCausalLM"])
    assert select_model_impl("auto", gemma) == ("transformers", TransformersModelImpl)


_ENGINE = dict(
    model_impl="transformers", device="cpu", max_model_len=64, kv_cache_memory_bytes=1 << 20
)


class _PlainOnlyBackend(TorchNativeBackend):
    """torch-native that declares only plain causal attention."""

    unsupported = classmethod(AttentionBackend.unsupported.__func__)


class _PlainOnlyPlugin:
    PAGODA_PLUGIN_API = 1

    @hookimpl
    def register_attention_backends(self, register):
        register("plain_only", _PlainOnlyBackend)


def test_a_feature_no_backend_has_is_named_with_its_layers(tmp_path: Path) -> None:
    folder = save(hf_model("gpt_oss"), tmp_path)
    with (
        plugin_registered(_PlainOnlyPlugin(), "plain_only_test"),
        pytest.raises(ValueError, match=r"sinks \(layers 0, 1\)"),
    ):
        LLM(**_ENGINE, model=str(folder), attention_backend="plain_only")


def test_moe_checkpoint_is_per_expert_on_disk_and_loads_fused(tmp_path: Path) -> None:
    hf = hf_model("qwen3_moe")
    folder = save(hf, tmp_path)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in names
    ours = build_ours(folder)
    fused = ours.model.get_parameter("model.layers.0.mlp.experts.gate_up_proj")
    assert torch.equal(fused, hf.get_parameter("model.layers.0.mlp.experts.gate_up_proj"))


def test_a_weight_with_no_home_or_a_parameter_left_unset_is_named(tmp_path: Path) -> None:
    folder = save(hf_model("gemma2"), tmp_path)
    ours = build_ours(folder)
    weights = dict(ours.model.state_dict())
    with pytest.raises(ValueError, match="'model.layers.0.bogus.weight' has no parameter"):
        ours.load_weights([*weights.items(), ("model.layers.0.bogus.weight", torch.zeros(2))])
    weights.pop("model.norm.weight")
    with pytest.raises(ValueError, match="lacks weights for 1 parameters: model.norm.weight"):
        ours.load_weights(weights.items())


def test_random_weights_serve(tmp_path: Path) -> None:
    folder = save(hf_model("gpt_oss"), tmp_path)
    llm = LLM(**_ENGINE, model=str(folder), load_format="dummy")
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}],
        SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True),
    )
    assert len(out[0].outputs[0].token_ids) == 4
