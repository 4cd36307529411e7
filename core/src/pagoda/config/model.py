"""The configuration's sections, one pydantic model per concern; ``EngineConfig``
(``pagoda.config.engine``) holds one of each."""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from pagoda.config import plugin_settings
from pagoda.config.errors import ConfigError as ConfigError  # re-exported


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    # NOTE: the ``plugins`` section's values, handed to every section when the configuration is
    # loaded, so that a plugin given only its family's section (a proposer, a grammar backend,
    # an attention backend) reads its own settings from it.
    _plugin_values: dict[str, dict[str, Any]] = PrivateAttr(default_factory=dict)

    def plugin_settings(self, name: str) -> BaseModel:
        """The settings of plugin ``name``, as ``EngineConfig.plugin_settings`` gives them: its
        registered model (``register_plugin_settings``) with the ``plugins.<name>`` values."""
        return plugin_settings.checker().settings_of(name, self._plugin_values.get(name, {}))


class ModelConfig(_Section):
    model: str | None = Field(
        None, description="Hugging Face model folder, GGUF file, or None for the default model"
    )
    tokenizer: str | None = Field(None, description="tokenizer source; defaults to the model's")
    impl: str = Field(
        "auto",
        min_length=1,
        description="model implementation: auto (the highest priority that accepts the model),"
        " native (the core's Llama family) or a plugin's name (`pagoda plugins` lists them)",
    )
    task: Literal["auto", "generate", "embed", "classify", "score"] = Field(
        "auto",
        description="what the engine serves: auto (from the architecture and the model's"
        " sentence-transformers files), generate, embed (embeddings, and generation too where the"
        " model has an LM head), classify or score (a sequence classification head)",
    )
    load_format: Literal["auto", "safetensors", "gguf", "dummy"] = Field(
        "auto", description="how to read the weights; dummy: random, for benchmarks"
    )
    dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto", description="weights and activations; auto: float32 on CPU, else the model's"
    )
    quantization: str | None = Field(
        None,
        min_length=1,
        description="quantization method by name (`pagoda plugins`): fp8 (FP8 weights and"
        " per-token activations, W8A8; a bf16 checkpoint is quantized as it loads), none, or a"
        " plugin's; None: the checkpoint's own (its quantization_config), else none",
    )
    max_model_len: int | None = Field(None, ge=1, description="context limit; default: model's")
    seed: int = Field(0, description="seed for random weights and unseeded sampling")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available")
    cpu_threads: int | None = Field(
        None,
        ge=1,
        description="torch CPU threads of each engine process; None: OMP_NUM_THREADS or the CPUs"
        " VLLM_CPU_OMP_THREADS_BIND lists, if set, else the CPUs the process may use, shared"
        " among its engine processes (a GPU engine: a quarter)",
    )
    trust_remote_code: bool = Field(False, description="allow the model's own tokenizer code")
    enforce_eager: bool = Field(
        False, description="never replay CUDA graphs (every step runs eagerly)"
    )
    piecewise_graph_max_tokens: int = Field(
        1024,
        ge=0,
        description="on CUDA, steps with prompt tokens of up to this many tokens (prefills, mixed"
        " steps) replay CUDA graphs of the model between its attention calls, which run eagerly;"
        " 0: they run eagerly",
    )
    max_logprobs: int = Field(
        20,
        ge=-1,
        description="most logprobs or prompt_logprobs one request may ask for; -1: no limit",
    )
    fused_ops: bool = Field(
        True,
        description="on CUDA, fused Triton kernels for RMSNorm with the residual add, SiLU times"
        " up, rotary embedding, and the random draw of a step that samples at a temperature alone",
    )
    batch_invariant: bool = Field(
        False,
        description="every request's logits, tokens and logprobs bit-identical whatever batch it"
        " runs in and however its prompt is chunked (fixed-shape matmuls, norms, attention and"
        " sampling; slower); also on with VLLM_BATCH_INVARIANT=1",
    )
    limit_mm_per_prompt: dict[str, int] = Field(
        {"image": 8},
        description="most items of each modality one prompt may bring (vLLM's name); a"
        " modality not named is refused",
    )
    max_image_pixels: int = Field(
        16_777_216, ge=1, description="largest image a prompt may bring, in pixels (width x height)"
    )
    max_image_bytes: int = Field(
        20_000_000, ge=1, description="largest image a prompt may bring, in encoded bytes"
    )

    @field_validator("limit_mm_per_prompt", mode="before")
    @classmethod
    def _mm_limits(cls, value: Any) -> Any:
        """A flag or a variable gives the limits as JSON (``{"image": 2}``) or ``image=2``."""
        if not isinstance(value, str):
            return value
        text = value.strip()
        if text.startswith("{"):
            return json.loads(text)
        pairs = [part.partition("=") for part in text.split(",") if part.strip()]
        return {k.strip(): v.strip() for k, _, v in pairs}


class CacheConfig(_Section):
    block_size: int = Field(16, ge=1, le=1024, description="tokens per KV cache block")
    enable_prefix_caching: bool = Field(True, description="reuse KV blocks of shared prefixes")
    gpu_memory_utilization: float = Field(
        0.9,
        gt=0.0,
        le=1.0,
        description="this engine's share of the GPU's memory (vLLM's meaning: memory others"
        " held before it started is not counted; two engines at 0.45 share one GPU)",
    )
    kv_cache_memory_bytes: int | None = Field(
        None,
        ge=1,
        description="KV cache size; default on a GPU: from gpu_memory_utilization; on a CPU: what"
        " max_num_seqs requests of max_model_len tokens fill, at most cpu_kv_cache_fraction of"
        " the available memory",
    )
    cpu_kv_cache_fraction: float = Field(
        0.25,
        gt=0.0,
        le=1.0,
        description="on a CPU without kv_cache_memory_bytes: the KV cache's limit as a fraction"
        " of the memory available at start-up (pages are committed only as the cache fills)",
    )
    num_gpu_blocks_override: int | None = Field(
        None, ge=2, description="exact number of KV cache blocks (testing)"
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3"] = Field(
        "auto",
        description="how keys and values are stored: auto: the model's dtype; fp8 (fp8_e4m3):"
        " FP8 e4m3 with a scale per layer (half the memory of bf16; needs a backend that reads"
        " it: triton, torch_native)",
    )
    calculate_kv_scales: bool = Field(
        True,
        description="with an FP8 KV cache and no KV scales in the checkpoint: each layer's key"
        " and value scales from the first prompt it computes (false: 1.0)",
    )
    # KV offload (pagoda.kv_offload): prefix-cached blocks the GPU evicts go to a CPU pool.
    cpu_offload_gb: float = Field(
        0.0,
        ge=0.0,
        description="GiB of (pinned) CPU memory that keeps prefix-cached KV blocks evicted from"
        " the device, loaded back on a prefix hit; 0: off; summed over tensor-parallel ranks"
        " (vLLM's kv_offloading_size)",
    )
    offload_policy: str = Field(
        "lru",
        description="which block the full CPU pool drops, by name (`pagoda plugins`): lru, arc",
    )
    offload_store: Literal["evicted", "full"] = Field(
        "evicted",
        description="evicted: copy a cached block to the CPU pool when the device evicts it"
        " (its step and any load into it wait for the copy); full: as soon as it is full and"
        " computed, off the step's path (more copies, but hits never wait for stores)",
    )
    offload_medium: str = Field(
        "cpu",
        description="where offloaded blocks live, by name (`pagoda plugins`); cpu: host memory;"
        " plugins add others (cpu_offload_gb then sizes that pool)",
    )
    offload_overlap: bool = Field(
        False,
        description="meet a long CPU-pool hit from both ends: the device computes its first"
        " blocks, a chunk a step, while the rest loads, so that the bus and the device work at"
        " once (Cake; the computed share is learned); false: load every hit block, the device"
        " waits",
    )


class SchedulerConfig(_Section):
    max_num_seqs: int = Field(256, ge=1, description="requests running at once")
    max_num_batched_tokens: int | None = Field(
        None,
        ge=1,
        description="token budget per step; default 8192 on a GPU (32768 for an engine whose"
        " task is pooling), 2048 on a CPU (or max_model_len if larger and chunked prefill is"
        " off)",
    )
    enable_chunked_prefill: bool = Field(True, description="split long prompts over steps")
    policy: Literal["fcfs", "priority"] = Field(
        "fcfs", description="fcfs: arrival order; priority: lowest priority value first"
    )
    max_waiting_requests: int | None = Field(
        None,
        ge=1,
        description="refuse new requests (HTTP 429) while this many sequences (a request's n"
        " samples each count) wait for the running batch; None: no limit",
    )
    async_scheduling: bool = Field(
        True,
        description="schedule and prepare step N+1 while the device runs step N (a request"
        " that step N ends costs one wasted token)",
    )
    max_num_encoder_input_tokens: int | None = Field(
        None,
        ge=1,
        description="encoder budget per step (multimodal models): the image tokens the vision"
        " encoder may compute in one step; None: max_num_batched_tokens",
    )
    encoder_cache_size: int | None = Field(
        None,
        ge=1,
        description="encoder outputs kept between steps, in tokens (until their placeholders are"
        " prefilled, and for reuse after); None: max_num_encoder_input_tokens",
    )


class AttentionConfig(_Section):
    backend: str = Field(
        "auto", description="attention backend by name (`pagoda plugins`), or auto: the best one"
    )


class ParallelConfig(_Section):
    tensor_parallel_size: int = Field(
        1, ge=1, description="ranks (GPUs, or CPU processes) one model is split over"
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="stages the model's layers are split into, each on its own ranks (tensor"
        " parallel inside a stage)",
    )
    pipeline_layer_partition: list[int] | None = Field(
        None,
        description="decoder layers per pipeline stage, first stage first (`14,16` or [14, 16];"
        " vLLM's VLLM_PP_LAYER_PARTITION); None: an even split",
    )
    data_parallel_size: int = Field(
        1,
        ge=1,
        description="engine cores (replicas, each with its own executor and ranks) behind one"
        " front end, requests routed by load and prefix",
    )
    executor: str = Field(
        "auto",
        description="executor by name (`pagoda plugins`): uniproc, multiproc, ray; auto: uniproc"
        " for one rank, multiproc for more",
    )
    ray_address: str | None = Field(
        None,
        description="Ray cluster the ray executor joins (`auto`, `ray://host:10001`, ...);"
        " None: the one RAY_ADDRESS names, else a local one it starts",
    )

    @field_validator("pipeline_layer_partition", mode="before")
    @classmethod
    def _comma_separated(cls, value: Any) -> Any:
        """A flag or a variable gives the partition as text: ``14,16`` or ``[14, 16]``."""
        if isinstance(value, str):
            return [part.strip() for part in value.strip().strip("[]").split(",") if part.strip()]
        return value


# Drafts a request gets at most when ``speculative.num_speculative_tokens`` is not given.
AUTO_MAX_DRAFTS = 8


class SpeculativeConfig(_Section):
    method: str | None = Field(
        None, description="speculative proposer by name (`pagoda plugins`), e.g. ngram; None: off"
    )
    num_speculative_tokens: int | None = Field(
        None,
        ge=0,
        description="draft tokens proposed per request per step, at most; None: the proposer"
        f" chooses each request's draft length from what it measures, up to {AUTO_MAX_DRAFTS}",
    )
    prompt_lookup_min: int | None = Field(
        None,
        ge=1,
        description="ngram: shortest suffix matched in the prompt and output; default:"
        " prompt_lookup_max; neither set: matches of 1 to 8 tokens, the proposer measuring"
        " from which length drafting pays",
    )
    prompt_lookup_max: int | None = Field(
        None,
        ge=1,
        description="ngram: longest suffix matched in the prompt and output; default:"
        " prompt_lookup_min; neither set: 8, the proposer choosing the shortest",
    )
    model: str | None = Field(
        None,
        description="eagle, eagle3: folder of the draft head's checkpoint (config.json and"
        " safetensors or pytorch_model.bin, the layouts EAGLE and EAGLE-3 publish)",
    )
    adaptive: bool = Field(
        True,
        description="measure tokens/s with drafting on and off for each batch size and draft"
        " only while it pays (a speculation governor); false: draft every step",
    )
    disable_by_batch_size: int | None = Field(
        None,
        ge=1,
        description="vLLM's knob: no drafts while at least this many requests run; None: off",
    )

    @property
    def max_num_drafts(self) -> int:
        """k: the most drafts a request gets in a step (the verification's width); 0: off."""
        if self.method is None:
            return 0
        k = self.num_speculative_tokens
        return AUTO_MAX_DRAFTS if k is None else k

    @property
    def draft_length_given(self) -> bool:
        """Whether the user fixed the draft length (``num_speculative_tokens``); otherwise the
        proposer picks each request's, up to :attr:`max_num_drafts`."""
        return self.num_speculative_tokens is not None

    def check(
        self,
        *,
        tensor_parallel_size: int,
        max_model_len: int | None = None,
        max_num_batched_tokens: int | None = None,
        needs_hidden_states: bool = False,
    ) -> None:
        """Every rule the speculative section must meet, in one place. The configuration checks
        the rules its own keys decide when it is built; the engine core checks them all at start
        (``pagoda.spec_decode.check_speculative``), with the model's length and the step's token
        budget (None: not known yet, their rule waits) and whether the proposer reads the target's
        hidden states. ``tensor_parallel_size`` is ``parallel.tensor_parallel_size`` (the rule
        that involves another section; ``model.batch_invariant`` allows speculation: its
        verification rows are computed as one-token decode rows). Raises ValueError naming the
        keys at fault."""
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(
                f"speculative.prompt_lookup_min={lo} is larger than speculative.prompt_lookup_max"
                f"={hi}"
            )
        if self.method is None:
            return
        k = self.max_num_drafts
        if k < 1:
            raise ValueError(
                "speculative.num_speculative_tokens must be at least 1 when speculative.method "
                f"is set (method={self.method!r}, num_speculative_tokens={k})"
            )
        if max_model_len is not None and max_num_batched_tokens is not None:
            budget = max_num_batched_tokens
            if k + 1 > min(budget, max_model_len):
                which = (
                    f"scheduler.max_num_batched_tokens={budget}"
                    if budget < max_model_len
                    else f"model.max_model_len={max_model_len}"
                )
                raise ValueError(
                    f"speculative.num_speculative_tokens={k} does not fit {which}: a "
                    "verification step scores the drafts and one more token a request"
                )
        tp = tensor_parallel_size
        if needs_hidden_states and tp > 1:
            # NOTE: such a proposer is called where a step's output is read, on the first rank
            # only, while a draft head runs the target's own sharded layers (embedding, LM head),
            # whose collectives every rank must join. One that reads only the token history runs
            # on every rank alike (the scheduler sends its drafts to all of them).
            raise ValueError(
                f"speculative.method {self.method!r} drafts from the target's hidden states, which"
                f" tensor parallelism does not support yet (parallel.tensor_parallel_size={tp}): "
                "run it on one rank, or pick a proposer that reads only the token history (ngram)"
            )


class StructuredOutputConfig(_Section):
    backend: str = Field(
        "auto",
        description="grammar backend by name (`pagoda plugins`), e.g. xgrammar; auto: the best"
        " one installed",
    )
    compile_timeout_s: float = Field(
        30.0,
        gt=0.0,
        description="a request whose grammar takes longer to compile fails alone, with an error",
    )
    compile_threads: int = Field(
        2, ge=1, description="threads that compile grammars, off the engine loop"
    )
    grammar_cache_size: int = Field(
        256, ge=1, description="compiled grammars kept, by their schema, regex or grammar text"
    )
    any_whitespace: bool = Field(
        False,
        description="JSON output may hold any whitespace between tokens; false: compact JSON"
        " (small models otherwise tend to emit whitespace until max_tokens)",
    )
    disable_any_whitespace: bool | None = Field(
        None,
        description="vLLM's name for the opposite of any_whitespace: true: JSON grammars allow no"
        " free whitespace; None: any_whitespace decides",
    )

    @model_validator(mode="before")
    @classmethod
    def _vllm_whitespace(cls, data: Any) -> Any:
        # NOTE: vLLM's disable_any_whitespace sets any_whitespace, which the backends read.
        if not isinstance(data, dict) or data.get("disable_any_whitespace") is None:
            return data
        disable = data["disable_any_whitespace"]
        if not isinstance(disable, bool):
            return data  # its own type error names it
        if "any_whitespace" in data and data["any_whitespace"] is disable:
            raise ValueError(
                f"structured_output.disable_any_whitespace={disable} contradicts "
                f"structured_output.any_whitespace={data['any_whitespace']}; give one of them"
            )
        return {**data, "any_whitespace": not disable}

    matcher_process: bool | Literal["auto"] = Field(
        "auto",
        description="advance the grammar matchers and fill the bitmasks in a process of their"
        " own, off the engine loop's interpreter (on a GPU the device, not the host, waits for"
        " its fill); false: in a thread of the engine's process; auto: a process on a GPU"
        " engine, a thread on a CPU one (benchmarks/README.md has both measured)",
    )


class ServerConfig(_Section):
    host: str = Field("127.0.0.1", description="address `pagoda serve` listens on")
    port: int = Field(8000, ge=0, le=65535, description="port `pagoda serve` listens on")
    api_key: str | None = Field(None, description="bearer token clients must send; None: open")
    served_model_name: str | None = Field(
        None,
        description="the model's one name in the API and the metrics; None: the model folder's"
        " name or the GGUF file's stem",
    )
    trust_request_chat_template: bool = Field(
        False,
        description="accept a chat template in a request (`chat_template`, or in"
        " `chat_template_kwargs`), rendered in a sandbox; off: such a request gets a 400",
    )
    request_chat_template_timeout_s: float = Field(
        2.0, gt=0.0, description="a request's chat template is stopped (400) after this long"
    )
    request_chat_template_max_chars: int = Field(
        4_000_000, ge=1, description="a request's chat template may render at most this much text"
    )
    enable_auto_tool_choice: bool = Field(
        False,
        description="serve `tool_choice: auto` (the default when a chat request has `tools`):"
        " the `tool_call_parser` finds the calls in the output; off: such a request gets a 400",
    )
    tool_call_parser: str | None = Field(
        None,
        description="the tool-call parser (`register_tool_parsers`: hermes, llama3_json,"
        " mistral, qwen3_coder, ...) that `enable_auto_tool_choice` uses",
    )
    tool_call_grammar: bool = Field(
        False,
        description="with `tool_choice: auto`, hold each tool call, once its start is written,"
        " to its tool's schema (an xgrammar structural tag; the parser must give one)",
    )
    reasoning_parser: str | None = Field(
        None,
        description="split the output's reasoning into `reasoning_content`"
        " (`register_reasoning_parsers`: deepseek_r1, qwen3, ...); None: all is content",
    )
    allowed_local_media_path: str | None = Field(
        None,
        description="`image_url` parts may name local files (file:// URLs) under this folder;"
        " None: no local file is read",
    )
    allow_remote_media: bool = Field(
        False,
        description="fetch `image_url` parts' http(s) URLs; off: such a part gets a 400 (data"
        " URIs always work)",
    )
    media_fetch_timeout_s: float = Field(
        10.0, gt=0.0, description="an http(s) image taking longer to fetch gets a 400"
    )
    max_request_body_bytes: int = Field(
        16 << 20, ge=1, description="longer request bodies get a 413 before they are read whole"
    )
    retry_after_s: int = Field(
        1, ge=0, description="`Retry-After` header (seconds) of a 429 for a shed request"
    )
    max_json_depth: int = Field(
        64, ge=2, description="request bodies nesting arrays and objects deeper get a 400"
    )
    max_stop_strings: int = Field(
        64, ge=1, description="most `stop` strings (and `bad_words`) a request may give"
    )
    max_stop_string_chars: int = Field(
        1024, ge=1, description="longest `stop` string (and `bad_words` entry), in characters"
    )
    max_logit_bias: int = Field(
        1024, ge=1, description="most `logit_bias` entries a request may give"
    )
    max_prompts_per_request: int = Field(
        256, ge=1, description="most prompts in one `/v1/completions` request"
    )
    max_messages: int = Field(2048, ge=1, description="most `messages` in one chat request")
    public_metrics: bool = Field(
        False, description="with an api_key: serve /metrics without it (for scrapers)"
    )
    shutdown_grace_s: float = Field(
        10.0,
        ge=0.0,
        description="on SIGTERM or Ctrl-C, requests in flight get this long to finish; then they"
        " end with a 503",
    )
    lora_modules: list[str] = Field(
        [],
        description="LoRA adapters served as models: `name=path` (or vLLM's JSON"
        ' `{"name": ..., "path": ...}`) each; needs lora.enable_lora',
    )
    allow_runtime_lora_updating: bool = Field(
        False,
        description="serve /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's"
        " VLLM_ALLOW_RUNTIME_LORA_UPDATING)",
    )

    @field_validator("lora_modules")
    @classmethod
    def _lora_modules(cls, value: list[str]) -> list[str]:
        for item in value:
            text = item.strip()
            if text.startswith("{"):
                continue  # JSON: checked where the server parses it
            name, sep, path = text.partition("=")
            if not sep or not name.strip() or not path.strip():
                raise ValueError(f"a LoRA module is `name=path`, got {item!r}")
        return value


class LoRAConfig(_Section):
    enable_lora: bool = Field(
        False, description="serve LoRA adapters (LoRARequest, --lora-modules) on the base model"
    )
    max_loras: int = Field(
        1,
        ge=1,
        description="adapters resident on the device at once (slots, least recently used"
        " evicted); no step runs more distinct adapters",
    )
    max_lora_rank: int = Field(
        16, ge=1, le=64, description="the highest adapter rank served (slots are this wide)"
    )
    max_cpu_loras: int | None = Field(
        None,
        ge=1,
        description="adapters kept loaded in host memory (least recently used evicted); None:"
        " max_loras",
    )
    resolvers: list[str] = Field(
        [],
        description="adapter resolvers (`pagoda plugins`), asked in order for a `model` name the"
        " server does not know, e.g. [local]",
    )
    resolver_dir: str | None = Field(
        None,
        description="the `local` resolver's folder: adapter NAME is the PEFT folder NAME in it",
    )

    @model_validator(mode="after")
    def _cpu_holds_slots(self) -> LoRAConfig:
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"lora.max_cpu_loras={self.max_cpu_loras} is below lora.max_loras="
                f"{self.max_loras}: every adapter on the device is also held in host memory"
            )
        return self

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


#: The sections of ``EngineConfig``, in order: its fields are exactly these (a test checks it).
SECTIONS: dict[str, type[_Section]] = {
    "model": ModelConfig,
    "cache": CacheConfig,
    "scheduler": SchedulerConfig,
    "attention": AttentionConfig,
    "parallel": ParallelConfig,
    "speculative": SpeculativeConfig,
    "structured_output": StructuredOutputConfig,
    "server": ServerConfig,
    "lora": LoRAConfig,
}
