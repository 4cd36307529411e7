"""The model-impl kit (``pagoda.testing.ModelImplSuite``) on the MoE families as ``native``
serves them: chunked prompts and decodes match one step, packed requests match each alone, the
attention specs are the declared ones, and an unfit tensor-parallel size is refused by name."""

from __future__ import annotations

from moe_tiny import configs

from pagoda.testing import ModelImplSuite


def _config(name: str) -> dict:
    cfg = configs()[name]
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM",
            "qwen3_moe": "Qwen3MoeForCausalLM", "olmoe": "OlmoeForCausalLM"}[name]  # fmt: skip
    return {**cfg.to_dict(), "architectures": [arch]}


class TestMoEFamiliesInTheKit(ModelImplSuite):
    impl_name = "native"
    configs = {name: _config(name) for name in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")}
