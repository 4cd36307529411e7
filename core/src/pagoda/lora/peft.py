"""Adapters in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors``.

``check_adapter`` reads the config and the tensors' shapes (not their data) and refuses what
the engine cannot serve with a one-line error naming the adapter and the problem: a missing
folder or file, a malformed config, a rank above ``lora.max_lora_rank``, a target module the
model lacks or that LoRA here does not cover, a tensor whose shape is not the model's.
``load_adapter`` then reads the tensors, with the scaling (``lora_alpha / r``, or
``lora_alpha / sqrt(r)`` with rsLoRA) to fold into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from pagoda.lora_request import LoRARequest

#: The projections LoRA covers, by the names of Hugging Face's Llama family.
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def target_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
    """Each target projection's (in_features, out_features), unsplit, of a Llama-family config
    (``pagoda.loader.arch.ModelArchConfig``)."""
    q = cfg.num_attention_heads * cfg.head_dim
    kv = cfg.num_key_value_heads * cfg.head_dim
    h, i = cfg.hidden_size, cfg.intermediate_size
    return {
        "q_proj": (h, q),
        "k_proj": (h, kv),
        "v_proj": (h, kv),
        "o_proj": (q, h),
        "gate_proj": (h, i),
        "up_proj": (h, i),
        "down_proj": (i, h),
    }


@dataclass
class AdapterInfo:
    """What ``check_adapter`` found: the rank, the scaling and the tensors by (layer, module)."""

    rank: int
    scaling: float
    modules: set[tuple[int, str]] = field(default_factory=set)


@dataclass
class AdapterWeights:
    """An adapter read into host memory: (layer, module) -> (A [r, in], B [out, r] * scaling)."""

    lora: LoRARequest
    rank: int
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def _fail(lora: LoRARequest, what: str) -> ValueError:
    return ValueError(f"LoRA adapter {lora.lora_name!r} ({lora.lora_path}): {what}")


def _read_config(lora: LoRARequest) -> dict[str, Any]:
    folder = Path(lora.lora_path)
    if not folder.is_dir():
        raise _fail(lora, "no such folder")
    path = folder / CONFIG_FILE
    if not path.is_file():
        raise _fail(lora, f"no {CONFIG_FILE} (not a PEFT adapter folder)")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _fail(lora, f"{CONFIG_FILE} is not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise _fail(lora, f"{CONFIG_FILE} is not a JSON object")
    if not (folder / WEIGHTS_FILE).is_file():
        raise _fail(lora, f"no {WEIGHTS_FILE}")
    return cfg


def _scaling(lora: LoRARequest, cfg: dict[str, Any], max_rank: int) -> tuple[int, float]:
    peft_type = cfg.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise _fail(lora, f"peft_type {peft_type!r} is not LORA")
    r = cfg.get("r")
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise _fail(lora, f"{CONFIG_FILE}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise _fail(lora, f"rank {r} is above lora.max_lora_rank={max_rank}")
    alpha = cfg.get("lora_alpha", r)
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise _fail(lora, f"{CONFIG_FILE}: lora_alpha must be a number, got {alpha!r}")
    for key, unsupported in (
        ("use_dora", lambda v: bool(v)),
        ("fan_in_fan_out", lambda v: bool(v)),
        ("modules_to_save", lambda v: bool(v)),
        ("rank_pattern", lambda v: bool(v)),
        ("alpha_pattern", lambda v: bool(v)),
        ("bias", lambda v: v not in (None, "none")),
    ):
        if unsupported(cfg.get(key)):
            raise _fail(lora, f"{CONFIG_FILE}: {key}={cfg[key]!r} is not supported")
    scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
    return r, float(scaling)


def _check_targets(lora: LoRARequest, cfg: dict[str, Any], shapes: dict) -> None:
    targets = cfg.get("target_modules")
    if targets is None or isinstance(targets, str):
        return  # a regular expression or all-linear: the tensors say what it targets
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets):
        raise _fail(lora, f"{CONFIG_FILE}: target_modules must be a list of names")
    lacking = sorted({t.rsplit(".", 1)[-1] for t in targets} - set(shapes))
    if lacking:
        raise _fail(
            lora,
            f"target modules the model lacks or LoRA does not cover: {lacking} (served: "
            f"{', '.join(TARGETS)})",
        )


def check_adapter(
    lora: LoRARequest, cfg: Any, max_rank: int, num_layers: int | None = None
) -> AdapterInfo:
    """Check adapter ``lora`` against the model config ``cfg`` without reading its tensors'
    data; raises ValueError naming the adapter and the problem."""
    shapes = target_shapes(cfg)
    layers = cfg.num_hidden_layers if num_layers is None else num_layers
    conf = _read_config(lora)
    rank, scaling = _scaling(lora, conf, max_rank)
    _check_targets(lora, conf, shapes)
    info = AdapterInfo(rank, scaling)
    seen: dict[tuple[int, str], set[str]] = {}
    try:
        with safe_open(str(Path(lora.lora_path) / WEIGHTS_FILE), framework="pt") as f:
            for key in f.keys():
                m = _KEY.search(key)
                if m is None:
                    raise _fail(
                        lora, f"tensor {key!r} is not a LoRA A or B of a layer's projection"
                    )
                layer, module, ab = int(m.group(1)), m.group(2), m.group(3)
                if module not in shapes:
                    raise _fail(
                        lora, f"targets {module!r}, which the model lacks or LoRA does not cover"
                    )
                if layer >= layers:
                    raise _fail(lora, f"tensor {key!r}: the model has {layers} layers")
                fan_in, fan_out = shapes[module]
                want = (rank, fan_in) if ab == "A" else (fan_out, rank)
                got = tuple(f.get_slice(key).get_shape())
                if got != want:
                    raise _fail(
                        lora, f"tensor {key!r} has shape {list(got)}, expected {list(want)}"
                    )
                seen.setdefault((layer, module), set()).add(ab)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - a corrupt file: say so in one line
        raise _fail(lora, f"{WEIGHTS_FILE} cannot be read ({type(e).__name__}: {e})") from None
    half = sorted(f"layers.{i}.{m}" for (i, m), ab in seen.items() if ab != {"A", "B"})
    if half:
        raise _fail(lora, f"lora_A without lora_B or the reverse: {half[:4]}")
    if not seen:
        raise _fail(lora, f"{WEIGHTS_FILE} holds no LoRA tensors")
    info.modules = set(seen)
    return info


def load_adapter(lora: LoRARequest, cfg: Any, max_rank: int) -> AdapterWeights:
    """Check, then read adapter ``lora`` into host memory (float32, B scaled)."""
    info = check_adapter(lora, cfg, max_rank)
    weights: dict[tuple[int, str], list[torch.Tensor | None]] = {}
    with safe_open(str(Path(lora.lora_path) / WEIGHTS_FILE), framework="pt") as f:
        for key in f.keys():
            m = _KEY.search(key)
            if m is None:
                continue  # (check_adapter refused such a key)
            pair = weights.setdefault((int(m.group(1)), m.group(2)), [None, None])
            t = f.get_tensor(key).float()
            pair[0 if m.group(3) == "A" else 1] = t if m.group(3) == "A" else t * info.scaling
    return AdapterWeights(
        lora, info.rank, {k: (a, b) for k, (a, b) in weights.items()}  # type: ignore[misc]
    )
