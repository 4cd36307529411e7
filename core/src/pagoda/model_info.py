"""Everything derived from the config and the model files once, before any process starts work."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.config import EngineConfig
from pagoda.distributed import check_tensor_parallel
from pagoda.loader import ModelArchConfig, load_hf_config, resolve_model

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class ModelInfo:
    name: str
    hf_dir: str
    tokenizer: str
    load_format: str
    arch: ModelArchConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    max_num_batched_tokens: int

    @classmethod
    def from_config(cls, config: EngineConfig) -> ModelInfo:
        mc = config.model
        resolved = resolve_model(mc.model, mc.load_format)
        arch = ModelArchConfig.from_hf_config(load_hf_config(resolved.hf_dir))
        check_tensor_parallel(arch, config.parallel.tensor_parallel_size)
        device = _pick_device(mc.device)
        dtype = _pick_dtype(mc.dtype, arch, device)
        # NOTE: sliding-window attention is not implemented, so the context stops at the window.
        context = min(arch.max_position_embeddings, arch.sliding_window or 1 << 62)
        max_model_len = mc.max_model_len or context
        if max_model_len > context:
            raise ValueError(
                f"model.max_model_len={max_model_len} exceeds the model's context of {context} "
                "tokens (max_position_embeddings, or the sliding window)"
            )
        sc = config.scheduler
        budget = sc.max_num_batched_tokens
        if budget is None:
            # A GPU runs 8192 tokens about as fast per token as 2048; a CPU is slower per step.
            base = 8192 if device.type == "cuda" else 2048
            budget = base if sc.enable_chunked_prefill else max(base, max_model_len)
        if not sc.enable_chunked_prefill and budget < max_model_len:
            raise ValueError(
                f"scheduler.max_num_batched_tokens={budget} is smaller than max_model_len="
                f"{max_model_len} with chunked prefill off: long prompts could never run"
            )
        sp = config.speculative
        if sp.method is not None and sp.num_speculative_tokens + 1 > min(budget, max_model_len):
            which = (
                f"scheduler.max_num_batched_tokens={budget}"
                if budget < max_model_len
                else f"model.max_model_len={max_model_len}"
            )
            raise ValueError(
                f"speculative.num_speculative_tokens={sp.num_speculative_tokens} does not fit "
                f"{which}: a verification step scores the drafts and one more token a request"
            )
        return cls(
            name=resolved.name,
            hf_dir=str(resolved.hf_dir),
            tokenizer=mc.tokenizer or str(resolved.hf_dir),
            load_format=resolved.load_format,
            arch=arch,
            device=device,
            dtype=dtype,
            max_model_len=max_model_len,
            max_num_batched_tokens=budget,
        )


def _pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("model.device='cuda' but no CUDA device is available")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(name)


def _pick_dtype(name: str, arch: ModelArchConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    config_dtype = _DTYPES.get(str(arch.torch_dtype or "").replace("torch.", ""))
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16
