"""The plugin's entry point: registers the parsers by name, importing none of them."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_tool_parsers(register) -> None:
    register("hermes", "pagoda_tool_parsers.hermes:HermesToolParser")
    register("llama3_json", "pagoda_tool_parsers.llama3:Llama3JsonToolParser")
    register("mistral", "pagoda_tool_parsers.mistral:MistralToolParser")
    register("qwen3_coder", "pagoda_tool_parsers.qwen3_coder:Qwen3CoderToolParser")


@hookimpl
def register_reasoning_parsers(register) -> None:
    register("deepseek_r1", "pagoda_tool_parsers.reasoning:DeepSeekR1ReasoningParser")
    register("qwen3", "pagoda_tool_parsers.reasoning:Qwen3ReasoningParser")
