"""What the core itself provides, registered through the same hooks as any outside plugin."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagoda.plugins.hookspecs import Register, SchedulerView, hookimpl

if TYPE_CHECKING:
    from pagoda.request import Request

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
    # Pooling models (embeddings, classification, scores): headless and classifier bodies of the
    # Llama family, and BERT-style encoders.
    for arch in (
        "LlamaModel",
        "MistralModel",
        "Qwen2Model",
        "Qwen3Model",
        "LlamaForSequenceClassification",
        "Qwen2ForSequenceClassification",
        "Qwen3ForSequenceClassification",
    ):
        register(arch, "pagoda.models.llama_pooling:LlamaPoolingModel")
    for arch in (
        "BertModel",
        "BertForSequenceClassification",
        "XLMRobertaModel",
        "XLMRobertaForSequenceClassification",
        "RobertaModel",
        "RobertaForSequenceClassification",
    ):
        register(arch, "pagoda.models.bert:BertEncoderModel")


@hookimpl
def register_model_impls(register: Register) -> None:
    register("native", "pagoda.models.native:NativeModelImpl")


@hookimpl
def register_lora_resolvers(register: Register) -> None:
    register("local", "pagoda.lora.resolver:LocalFolderResolver")


@hookimpl
def register_quantization_methods(register: Register) -> None:
    register("fp8", "pagoda.quantization.fp8:Fp8Method")


@hookimpl
def register_offload_policies(register: Register) -> None:
    register("lru", "pagoda.kv_offload.policy:LRUPolicy")
    register("arc", "pagoda.kv_offload.arc:ARCPolicy")


@hookimpl
def register_offload_mediums(register: Register) -> None:
    register("cpu", "pagoda.kv_offload.cpu:CPUMedium")


@hookimpl
def admit_request(request: Request, scheduler: SchedulerView) -> str | None:
    """Load shedding: ``scheduler.max_waiting_requests``. The samples of a request with n > 1
    after the first come in with it (they name it as their ``prefill_leader``)."""
    limit = scheduler.max_waiting_requests
    if limit is None or request.prefill_leader is not None or scheduler.num_waiting < limit:
        return None
    return (
        f"{scheduler.num_waiting} requests are already waiting for the running batch "
        f"(scheduler.max_waiting_requests={limit}); retry later"
    )
