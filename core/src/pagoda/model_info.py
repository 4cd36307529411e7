"""Everything derived from the config and the model files once, before any process starts work."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pagoda.config import EngineConfig
from pagoda.loader import load_hf_config, load_tokenizer, resolve_model
from pagoda.loader.synthetic import synthetic_tokenizer
from pagoda.models.impl import select_model_impl
from pagoda.models.shape import ModelShape
from pagoda.pooling.config import PoolerConfig, resolve_pooler
from pagoda.quantization import checkpoint_config, kv_cache_unsupported, resolve_quantization

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelInfo:
    name: str
    hf_dir: str
    tokenizer: str
    load_format: str
    shape: ModelShape  # what the engine reads of the model on one tensor-parallel rank
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int
    model_impl: str = "native"  # the registered model impl that serves it (``model.impl``)
    # What the engine serves (``model.task``): ``generate`` and/or pooling tasks, and how it
    # pools (None: it only generates).
    tasks: tuple[str, ...] = ("generate",)
    pooler: PoolerConfig | None = None
    # The quantization method that serves the model (``model.quantization``, or the
    # checkpoint's; None: full precision) and the checkpoint's ``quantization_config``.
    quantization: str | None = None
    quantization_config: dict[str, Any] = field(default_factory=dict)

    @property
    def bidirectional(self) -> bool:
        """Whether a layer attends bidirectionally (an encoder): a prompt then runs whole in one
        step, with no chunked prefill and no prefix caching (vLLM does the same)."""
        return not all(s.causal for s in self.shape.attention)

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelInfo:
        mc = config.model
        resolved = resolve_model(mc.model, mc.load_format)
        hf_config = load_hf_config(resolved.hf_dir)
        impl_name, impl = select_model_impl(mc.impl, hf_config)
        shape = impl.shape(hf_config, config.parallel.tensor_parallel_size)
        device = _pick_device(mc.device)
        dtype = _pick_dtype(mc.dtype, shape, device)
        quantization = resolve_quantization(mc.quantization, hf_config, device, dtype)
        why = kv_cache_unsupported(config.cache.kv_cache_dtype, device)
        if why is not None:
            raise ValueError(why)
        if quantization is not None and config.lora.enable_lora:
            raise ValueError(
                f"LoRA adapters do not run over quantized linears yet (model.quantization="
                f"{quantization}); turn one of them off"
            )
        # Window layers keep every block of the context and mask: a window does not cap it.
        context = shape.max_position_embeddings
        max_model_len = mc.max_model_len or context
        if max_model_len > context:
            raise ValueError(
                f"model.max_model_len={max_model_len} exceeds the model's context of {context} "
                "tokens (max_position_embeddings)"
            )
        causal = all(s.causal for s in shape.attention)
        tasks, pooler = resolve_pooler(
            mc.task, shape.architecture, resolved.hf_dir, hf_config, shape.hidden_size, causal
        )
        sc = config.scheduler
        chunked = sc.enable_chunked_prefill and causal  # an encoder's prompt runs whole
        budget = sc.max_num_batched_tokens
        if budget is None:
            # A GPU runs 8192 tokens about as fast per token as 2048; a CPU is slower per step.
            base = 8192 if device.type == "cuda" else 2048
            if device.type == "cuda" and ("generate" not in tasks or mc.task not in _GENERATE):
                # An engine for pooling: no decode latency to keep short, and a step's host work
                # (some 40 ms of launches for Qwen3-0.6B on an H200's host) outran the device's
                # 30 ms at 16,384 tokens: at 32,768 the device sets the pace.
                base = 32768
            budget = base if chunked else max(base, max_model_len)
        if not chunked and budget < max_model_len:
            why = "chunked prefill off" if causal else "a bidirectional encoder (prompts run whole)"
            raise ValueError(
                f"scheduler.max_num_batched_tokens={budget} is smaller than max_model_len="
                f"{max_model_len} with {why}: long prompts could never run"
            )
        return cls(
            name=resolved.name,
            hf_dir=str(resolved.hf_dir),
            tokenizer=mc.tokenizer or str(resolved.hf_dir),
            load_format=resolved.load_format,
            shape=shape,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
            model_impl=impl_name,
            tasks=tasks,
            pooler=pooler,
            quantization=quantization,
            quantization_config=checkpoint_config(hf_config) if quantization else {},
        )


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("model.device='cuda' but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _pick_dtype(name: str, shape: ModelShape, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    config_dtype = _DTYPES.get(str(shape.torch_dtype or "").replace("torch.", ""))
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def model_eos_ids(info: ModelInfo) -> set[int]:
    """The model's end-of-sequence ids: its config's and its generation config's."""
    ids: set[int] = set()
    sources: list[Any] = [info.shape.eos_token_id]
    gen_config = Path(info.hf_dir) / "generation_config.json"
    if gen_config.is_file():
        sources.append(json.loads(gen_config.read_text()).get("eos_token_id"))
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def load_model_tokenizer(info: ModelInfo, trust_remote_code: bool) -> Any:
    """The model's tokenizer; a random-weight model without tokenizer files gets a synthetic one."""
    try:
        return load_tokenizer(info.tokenizer, trust_remote_code)
    except FileNotFoundError:
        if info.load_format != "dummy":
            raise
        eos = info.shape.eos_token_id
        return synthetic_tokenizer(info.shape.vocab_size, eos if isinstance(eos, int) else None)


#: ``model.task`` values that ask for generation (``auto``: whatever the model serves).
_GENERATE = ("auto", "generate")
