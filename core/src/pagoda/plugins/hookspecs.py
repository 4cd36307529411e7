"""Hook specifications: everything a Pagoda plugin may implement.

A plugin is a module (or any object) whose functions are marked with ``@pagoda.hookimpl`` and named
after the hooks below; it declares ``PAGODA_PLUGIN_API = 1`` (:data:`PLUGIN_API_VERSION`) and is
found through the ``pagoda`` entry-point group. Hooks come in two groups:

- Registries, called once per process when plugins load. Each is a collector: the plugin calls
  ``register(name, target, override=False)`` for every thing it provides. ``target`` is a lazy
  ``"package.module:Name"`` string (imported only when a user selects ``name``) or the object
  itself. Discovery must import no kernel library and touch no GPU, so prefer strings.
- Seams, at the scheduler, the KV cache manager, the model runner and the engine core. They fire
  once per request or once per step, never per layer or per token; a seam that no plugin implements
  costs nothing (the engine binds it once and skips it).

A hook implementation may accept any subset of a hook's parameters, so parameters added later do
not break a plugin. The plugin author's guide (``docs/plugins.md``) shows each hook in use.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import pluggy

if TYPE_CHECKING:
    import torch

    from pagoda.config import EngineConfig
    from pagoda.request import Request
    from pagoda.sample.metadata import SamplingMetadata
    from pagoda.step import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput

PROJECT = "pagoda"
#: The plugin API this Pagoda provides; a plugin declares the one it was written for as
#: ``PAGODA_PLUGIN_API`` and is refused (with a clear error) when they differ.
PLUGIN_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    """The ``register`` callable that registry hooks receive."""

    def __call__(self, name: str, target: str | Callable[..., Any], override: bool = False) -> None:
        """Register ``target`` under ``name``; ``override=True`` replaces another plugin's
        registration of the same name instead of being a duplicate-name error."""


class KVCacheLoad(Protocol):
    """What an admission hook reads of the KV cache manager."""

    @property
    def usage(self) -> float:
        """The share of KV blocks in use, 0.0 to 1.0."""
        ...


class SchedulerView(Protocol):
    """What a seam hook may read of the scheduler (read only): its load and its limit."""

    max_waiting_requests: int | None

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_running(self) -> int: ...

    @property
    def kv_cache_manager(self) -> KVCacheLoad: ...


# ---- registries: called once per process, when plugins load -------------------------------------


@hookspec
def register_attention_backends(register: Register) -> None:
    """Register attention backends by name.

    :param register: call ``register(name, "pkg.mod:BackendClass")`` for each backend; the class
        implements :class:`pagoda.attention.backend.AttentionBackend`.

    Called once per process, when plugins load. Every implementation is called; a name registered
    twice is an error unless one registration passes ``override=True``. Users select a backend by
    name (``attention.backend``), or ``auto`` picks the highest ``priority`` among those whose
    ``supports(device, dtype, head_size)`` is true.
    """


@hookspec
def register_executors(register: Register) -> None:
    """Register executors by name.

    :param register: call ``register(name, "pkg.mod:ExecutorClass")`` for each executor; the class
        implements :class:`pagoda.executor.base.Executor`.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``parallel.executor``.
    """


@hookspec
def register_spec_proposers(register: Register) -> None:
    """Register speculative-decoding proposers by method name (``ngram``, ``eagle``, ...).

    :param register: call ``register(method, "pkg.mod:ProposerClass")`` for each proposer; the
        class implements :class:`pagoda.spec_decode.SpeculativeProposer` (the contract: what
        ``propose`` receives each step and returns, in ``docs/plugins.md``).

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``speculative.method``.
    """


@hookspec
def register_grammar_backends(register: Register) -> None:
    """Register structured-output grammar backends by name (``xgrammar``, ...).

    :param register: call ``register(name, "pkg.mod:GrammarBackendClass")`` for each backend.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``structured_output.backend``, or ``auto`` picks the highest ``priority``.
    """


@hookspec
def register_models(register: Register) -> None:
    """Register model architectures by the ``architectures`` name of a model's config.json.

    :param register: call ``register("LlamaForCausalLM", "pkg.mod:ModelClass")``; the class is
        built as ``ModelClass(arch_config, attention_backend)`` and loads its own weights
        (a native architecture: the model impl ``native`` serves it).

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. The engine picks the class whose name
    is the model's architecture.
    """


@hookspec
def register_model_impls(register: Register) -> None:
    """Register model implementations by name (``native``, ``transformers``, ...).

    :param register: call ``register(name, "pkg.mod:ImplClass")`` for each impl; the class
        implements :class:`pagoda.models.impl.ModelImpl`: ``supports(hf_config, architecture)``
        (None when it can serve that config.json, else its reason), ``priority``,
        ``shape(hf_config, tensor_parallel_size)`` (the :class:`pagoda.models.shape.ModelShape`
        the engine reads: sizes, context, EOS ids, one attention spec per layer) and
        ``model_class(shape)``.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with ``model.impl``
    (``model_impl``), or ``auto`` picks the highest ``priority`` among those that accept the
    model; ``pagoda plugins --model PATH`` shows each one's verdict. The core's ``native`` impl
    (the Llama family) is registered through this hook.
    """


@hookspec
def register_plugin_settings(register: Register) -> None:
    """Register a plugin's settings: a pydantic model, under the plugin's name.

    :param register: call ``register(plugin_name, "pkg.mod:SettingsModel")``; the class is a
        pydantic ``BaseModel`` whose fields (each with a default) are the plugin's settings.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users set the values in the
    configuration's ``plugins.<name>`` section (a file, ``PAGODA_PLUGINS__<NAME>__<KEY>``,
    ``--plugin-setting NAME.KEY=VALUE``, ``LLM(plugins={...})``), validated by the model: an
    unknown key is an error that names it. The plugin reads them with
    ``config.plugin_settings(name)`` in any hook that receives the configuration.
    """


@hookspec
def register_offload_policies(register: Register) -> None:
    """Register eviction policies of the KV offload CPU pool by name (``lru``, ``arc``, ...).

    :param register: call ``register(name, "pkg.mod:PolicyClass")`` for each policy; the class
        implements :class:`pagoda.kv_offload.OffloadPolicy` and is built as
        ``PolicyClass(capacity)``, ``capacity`` being the pool's size in blocks.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``cache.offload_policy``.
    """


@hookspec
def register_offload_mediums(register: Register) -> None:
    """Register KV offload mediums by name (``cpu``, ...): where offloaded blocks live.

    :param register: call ``register(name, "pkg.mod:MediumClass")`` for each medium; the class
        implements :class:`pagoda.kv_offload.OffloadMedium` and is built in each worker as
        ``MediumClass(kv_caches, block_dim, num_blocks)`` once its KV cache is allocated.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``cache.offload_medium``.
    """


@hookspec
def register_tool_parsers(register: Register) -> None:
    """Register tool-call parsers by name (``hermes``, ``llama3_json``, ...).

    :param register: call ``register(name, "pkg.mod:ParserClass")`` for each parser; the class
        implements :class:`pagoda.parsers.ToolParser` and is built per request as
        ``ParserClass(tools)``.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``server.tool_call_parser`` (``--tool-call-parser``); with ``--enable-auto-tool-choice`` it
    serves ``tool_choice: auto``.
    """


@hookspec
def register_reasoning_parsers(register: Register) -> None:
    """Register reasoning parsers by name (``deepseek_r1``, ``qwen3``, ...).

    :param register: call ``register(name, "pkg.mod:ParserClass")`` for each parser; the class
        implements :class:`pagoda.parsers.ReasoningParser` and is built per output as
        ``ParserClass()``.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``server.reasoning_parser`` (``--reasoning-parser``); it fills ``reasoning_content``.
    """


@hookspec
def register_lora_resolvers(register: Register) -> None:
    """Register LoRA adapter resolvers by name (``local``, an object store, a hub, ...).

    :param register: call ``register(name, "pkg.mod:ResolverClass")`` for each resolver; the
        class implements :class:`pagoda.lora.resolver.LoRAResolver`: it is built once per
        server as ``ResolverClass(lora_config)`` (the ``lora`` section) and its
        ``resolve(base_model_name, lora_name)`` returns the local folder of the adapter in
        PEFT's layout, or None when it has no such adapter.

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users list the resolvers to ask,
    in order, in ``lora.resolvers``; the server asks them (off its event loop) when a request's
    ``model`` names no model or adapter it serves, and serves the first adapter found under
    that name from then on. The core's ``local`` resolver looks in ``lora.resolver_dir``.
    """


@hookspec
def register_quantization_methods(register: Register) -> None:
    """Register quantization methods by name (``fp8``, ``awq``, ``gptq``, ...).

    :param register: call ``register(name, "pkg.mod:MethodClass")`` for each method; the class
        implements :class:`pagoda.quantization.QuantizationMethod`: ``unsupported(checkpoint
        config, device, dtype)`` (None when it serves them, else what is missing), the
        ``checkpoint_formats`` it reads, and, built in each worker as
        ``MethodClass(checkpoint_config)``, ``linear_method(prefixes)``: a
        :class:`pagoda.quantization.LinearMethod` per linear layer (its weights created, loaded
        and applied).

    Called once per process, when plugins load. Every implementation is called; duplicate names
    follow the rule of :func:`register_attention_backends`. Users select one with
    ``model.quantization`` (``--quantization``); left unset, a checkpoint whose
    ``quantization_config`` names a ``quant_method`` selects the method that lists it. The
    core's ``fp8`` is registered through this hook.
    """


# ---- seams: once per request or once per step ---------------------------------------------------


@hookspec(firstresult=True)
def admit_request(request: Request, scheduler: SchedulerView) -> str | None:
    """Decide whether the scheduler accepts a new request (quotas, load shedding, policy).

    :param request: the request, already validated (non-empty prompt that fits the context);
        its ``prompt_token_ids``, ``sampling_params`` and ``priority`` may be read, not changed.
    :param scheduler: the scheduler, for its load (``num_waiting``, ``num_running``,
        ``kv_cache_manager.usage``, ``max_waiting_requests``); read only.

    Called once per request, when the scheduler receives it and before it is queued. Return a
    reason (a string) to reject it, which raises :class:`pagoda.plugins.RequestRejectedError`
    with that reason to whoever submitted it (the HTTP server answers 429); return None to let
    it in. The first non-None result wins, and later implementations are not called. The core's
    own rule, ``scheduler.max_waiting_requests``, is an implementation of this hook.
    """


@hookspec
def on_blocks_evicted(block_ids: list[int], block_hashes: list[bytes]) -> None:
    """Learn which prefix-cached KV blocks were just evicted (for offloading or metrics).

    :param block_ids: the evicted blocks' ids, now handed to another request.
    :param block_hashes: the content hashes those blocks were cached under, in the same order.

    Called by the KV cache manager while it schedules, once per allocation that evicted cached
    blocks, before the step that overwrites them runs: a plugin may still copy their contents
    out. Every implementation is called; results are ignored. The engine process's serving
    statistics (``pagoda:prefix_cache_evicted_blocks``) are an implementation of this hook.
    """


@hookspec
def logits_processors(
    config: EngineConfig, vocab_size: int, device: torch.device
) -> Iterable[LogitsProcessor] | None:
    """Build logits processors, applied to every step's logits before sampling.

    :param config: the engine configuration.
    :param vocab_size: the number of columns of the logits.
    :param device: the device the logits live on.

    Called once per model runner (in each worker process), when it is built. Return processors
    (see :class:`LogitsProcessor`) or None. Every implementation is called; the processors of all
    plugins are applied in turn, each to the previous one's result, every step that samples,
    after the request's own settings (allowed tokens, bias, penalties) and before temperature,
    top-k/top-p and the draw (greedy requests see them too).
    """


@hookspec
def on_step_end(
    scheduler_output: SchedulerOutput,
    runner_output: ModelRunnerOutput,
    outputs: list[EngineCoreOutput],
) -> None:
    """Observe one engine step once its results are in (metrics, tracing, logging).

    :param scheduler_output: what the scheduler decided for this step.
    :param runner_output: the tokens the model runner sampled.
    :param outputs: the per-request outputs the engine core returns (new tokens, finish reasons).

    Called by the engine core at the end of every step that went to the executor, after the
    scheduler has taken the results in. Every implementation is called; results are ignored.
    Keep it cheap: it runs between steps. The engine process's serving statistics
    (``pagoda:iteration_tokens_total``) are an implementation of this hook.
    """


class LogitsProcessor(Protocol):
    """What :func:`logits_processors` builds: a callable applied to each step's logits."""

    def __call__(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Return the logits to sample from, ``[num_rows, vocab_size]`` float32 (it may change
        ``logits`` in place). ``md.req_ids`` names the request of each row; the rest of ``md``
        is the step's sampling metadata (``pagoda.sample.metadata``)."""


REGISTRY_HOOKS: dict[str, str] = {
    "attention_backends": "register_attention_backends",
    "executors": "register_executors",
    "spec_proposers": "register_spec_proposers",
    "grammar_backends": "register_grammar_backends",
    "models": "register_models",
    "model_impls": "register_model_impls",
    "plugin_settings": "register_plugin_settings",
    "offload_policies": "register_offload_policies",
    "offload_mediums": "register_offload_mediums",
    "tool_parsers": "register_tool_parsers",
    "reasoning_parsers": "register_reasoning_parsers",
    "lora_resolvers": "register_lora_resolvers",
    "quantization_methods": "register_quantization_methods",
}
"""Registry kind -> the hook that fills it."""

SEAM_HOOKS: tuple[str, ...] = (
    "admit_request",
    "on_blocks_evicted",
    "logits_processors",
    "on_step_end",
)
