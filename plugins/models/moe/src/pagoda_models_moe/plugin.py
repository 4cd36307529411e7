"""Entry point of the plugin: registers the architectures and the settings, importing nothing
heavy (the model module is named, not imported)."""

from __future__ import annotations

from pagoda import hookimpl

PAGODA_PLUGIN_API = 1

ARCHITECTURES = (
    "MixtralForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "OlmoeForCausalLM",
)


@hookimpl
def register_models(register) -> None:
    for arch in ARCHITECTURES:
        register(arch, "pagoda_models_moe.model:MoEForCausalLM")


@hookimpl
def register_plugin_settings(register) -> None:
    register("moe", "pagoda_models_moe.settings:MoESettings")


@hookimpl
def logits_processors(config, vocab_size, device):
    """Each worker calls this with the configuration once, when its model runner is built and
    before the model is: the one place a worker's model learns ``plugins.moe``. No processor."""
    # NOTE: the parallel module imports torch: only in a worker, not at discovery.
    from pagoda_models_moe.parallel import set_expert_parallel

    set_expert_parallel(config.plugin_settings("moe").expert_parallel)
    return None
