"""What the core itself provides, registered through the same hooks as any outside plugin."""

from __future__ import annotations

from pagoda.plugins.hookspecs import Register, hookimpl

PAGODA_PLUGIN_API = 1


@hookimpl
def register_attention_backends(register: Register) -> None:
    register("torch_native", "pagoda.attention.torch_native:TorchNativeBackend")


@hookimpl
def register_executors(register: Register) -> None:
    register("uniproc", "pagoda.executor.uniproc:UniProcExecutor")


@hookimpl
def register_models(register: Register) -> None:
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        register(arch, "pagoda.models.llama:LlamaForCausalLM")
