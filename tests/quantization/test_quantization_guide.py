"""The quantization section of the plugin author's guide: its int8 example, taken from the
guide's own code block, passes the quantization kit and serves the tiny Llama through the engine
once registered under its name."""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams, hookimpl
from pagoda.plugins import plugin_registered
from pagoda.testing.quantization import check_linear_method

GUIDE = Path(__file__).resolve().parents[2] / "docs" / "plugins.md"


@pytest.fixture(scope="module")
def example() -> types.ModuleType:
    text = GUIDE.read_text()
    block = re.search(r"```python\n# my_package/int8.py\n(.*?)```", text, re.S)
    assert block is not None, "docs/plugins.md lost its int8 example"
    module = types.ModuleType("guide_int8")
    exec(compile(block.group(1), "docs/plugins.md (int8 example)", "exec"), module.__dict__)
    return module


def test_the_guides_int8_method_passes_the_kit(example) -> None:
    for dtype in (torch.float32, torch.bfloat16):
        assert check_linear_method(example.Int8WeightsMethod, dtype=dtype, tolerance=0.01) < 0.01


def test_the_guides_int8_method_serves_a_model_by_name(example, fp8_folders) -> None:
    class Plugin:
        PAGODA_PLUGIN_API = 1

        @hookimpl
        def register_quantization_methods(self, register):
            register("int8_weights", example.Int8WeightsMethod)

    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt = {"prompt_token_ids": [5, 9, 13, 17, 21, 25, 29]}
    with plugin_registered(Plugin(), "guide-int8"):
        llm = LLM(model=str(fp8_folders["full"]), quantization="int8_weights", max_model_len=64)
        got = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
        layer = llm.engine.engine_core.executor.worker.model_runner.model.model.layers[0]
        assert layer.mlp.down_proj.weight.dtype == torch.int8
    want = (
        LLM(model=str(fp8_folders["full"]), max_model_len=64)
        .generate(prompt, params, use_tqdm=False)[0]
        .outputs[0]
        .token_ids
    )
    assert got == want  # 8-bit weights of this model keep its greedy tokens
