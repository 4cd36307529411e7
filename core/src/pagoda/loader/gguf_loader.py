"""GGUF -> Hugging Face folder (config.json, safetensors, tokenizer), converted once and cached.

Tensors come out under Hugging Face names and layouts (llama.cpp's Q/K row permutation undone),
dequantized to float32 (F16/BF16 tensors keep their exact dtype), so the model code needs no
GGUF knowledge.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

_CACHE_VERSION = 1  # bump when the conversion's output changes
_SHARD_BYTES = 2 << 30
_STALE_TEMP_SECONDS = 6 * 3600

# GGUF architecture -> (Hugging Face architecture, model_type)
_GGUF_ARCHS: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}
_PERMUTED_MODEL_TYPES = {"llama"}  # llama.cpp permutes Q/K rows of its "llama" architecture only

_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_SKIPPED = {"rope_freqs.weight"}  # llama3 rope factors, folded into config.json's rope_scaling
_BULKY_FIELDS = {f"tokenizer.ggml.{k}" for k in ("tokens", "token_type", "merges", "scores")}
_BLOCK_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


def cache_dir() -> Path:
    """Pagoda's cache: `$PAGODA_CACHE_DIR`, else `~/.cache/pagoda`."""
    env = os.environ.get("PAGODA_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagoda"


def convert_gguf(path: str | os.PathLike[str]) -> Path:
    """Hugging Face folder for a GGUF file; converted on the first call, then read from cache."""
    src = Path(path).expanduser().resolve()
    if not src.is_file():
        raise FileNotFoundError(f"GGUF file {src} does not exist")
    target = _cache_folder(src)
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temps(target)
    logger.info("converting %s to a Hugging Face folder in %s; this happens once", src, target)
    start = time.perf_counter()
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _write_hf_folder(src, tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not target.is_dir():  # not another process that won the race: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", src.name, time.perf_counter() - start)
    return target


def _cache_folder(src: Path) -> Path:
    st = src.stat()
    key = f"{_CACHE_VERSION}|{src}|{st.st_size}|{st.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "gguf" / f"{src.stem}-{digest}"


def _remove_stale_temps(target: Path) -> None:
    """Temp folders that a killed conversion left behind (a live one is younger)."""
    for tmp in target.parent.glob(f".{target.name}.tmp-*"):
        if time.time() - tmp.stat().st_mtime > _STALE_TEMP_SECONDS:
            shutil.rmtree(tmp, ignore_errors=True)


def _write_hf_folder(src: Path, out: Path) -> None:
    # NOTE: gguf loads only where a GGUF file is read.
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    try:
        reader = GGUFReader(src)
    except (ValueError, OSError) as e:
        raise ValueError(f"{src} is not a readable GGUF file: {e}") from e
    config = hf_config_from_gguf(reader)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_safetensors(reader, config, out)
    tokenizer = AutoTokenizer.from_pretrained(
        str(src.parent), gguf_file=src.name, local_files_only=True
    )
    tokenizer.save_pretrained(str(out))


def write_safetensors(reader: Any, config: dict[str, Any], out: Path) -> None:
    """The GGUF's tensors as safetensors files in `out`, sharded (with an index) when large."""
    # NOTE: safetensors loads only where weights are read.
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    shards = _plan_shards(reader)
    names = (
        ["model.safetensors"] if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    index: dict[str, str] = {}
    tensors = iter_hf_tensors(reader, config)
    with tqdm(total=sum(shards), desc="converting", unit="tensor") as bar:
        for file, count in zip(names, shards, strict=True):
            shard = {}
            for _ in range(count):
                name, tensor = next(tensors)
                shard[name] = tensor
                bar.update(1)
            save_file(shard, str(out / file), metadata={"format": "pt"})
            index.update(dict.fromkeys(shard, file))
    if len(names) > 1:
        body = {"metadata": {}, "weight_map": index}
        (out / "model.safetensors.index.json").write_text(json.dumps(body, indent=2) + "\n")


def _plan_shards(reader: Any) -> list[int]:
    """Tensor counts per shard, in file order, each shard at most _SHARD_BYTES (or one tensor)."""
    counts, size = [0], 0
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        nbytes = int(t.n_elements) * _out_dtype(t.tensor_type).itemsize
        if counts[-1] and size + nbytes > _SHARD_BYTES:
            counts.append(0)
            size = 0
        counts[-1] += 1
        size += nbytes
    return counts


def _out_dtype(qtype: Any) -> torch.dtype:
    # NOTE: gguf loads only where a GGUF file is read.
    from gguf import GGMLQuantizationType as Q

    return {Q.F16: torch.float16, Q.BF16: torch.bfloat16}.get(qtype, torch.float32)


def hf_config_from_gguf(reader: Any) -> dict[str, Any]:
    """A config.json dict (transformers 4 key style, which 5 also reads) from GGUF metadata."""
    fields = {k: _field_value(f) for k, f in reader.fields.items() if k not in _BULKY_FIELDS}
    gguf_arch = fields.get("general.architecture")
    if gguf_arch not in _GGUF_ARCHS:
        raise ValueError(
            f"GGUF architecture {gguf_arch!r} is not supported; supported: {', '.join(_GGUF_ARCHS)}"
        )
    hf_arch, model_type = _GGUF_ARCHS[gguf_arch]

    def meta(key: str, default: Any = None) -> Any:
        return fields.get(f"{gguf_arch}.{key}", default)

    hidden = meta("embedding_length")
    heads = meta("attention.head_count")
    if hidden is None or heads is None or meta("block_count") is None:
        raise ValueError(f"GGUF file lacks {gguf_arch}.embedding_length/head_count/block_count")
    kv_heads = meta("attention.head_count_kv", heads)
    if isinstance(kv_heads, list):
        raise ValueError("GGUF files with a per-layer KV head count are not supported")
    head_dim = meta("attention.key_length") or (
        meta("rope.dimension_count") if gguf_arch == "llama" else None
    ) or hidden // heads
    tensor_names = {t.name for t in reader.tensors}
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    vocab = meta("vocab_size") or (len(tokens.data) if tokens is not None else None)
    if vocab is None:
        raise ValueError(f"GGUF file has neither {gguf_arch}.vocab_size nor a token list")
    theta = float(meta("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": meta("feed_forward_length"),
        "num_hidden_layers": meta("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rms_norm_eps": meta("attention.layer_norm_rms_epsilon", 1e-6),
        "rope_theta": theta,
        "rope_scaling": _rope_scaling(reader, meta, head_dim, theta),
        "max_position_embeddings": meta("context_length", 2048),
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "hidden_act": "silu",
        "torch_dtype": "float32",
    }
    if gguf_arch == "qwen3":
        config["attention_bias"] = "blk.0.attn_q.bias" in tensor_names
    for key in ("bos", "eos", "padding"):
        value = fields.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            config["pad_token_id" if key == "padding" else f"{key}_token_id"] = value
    return config


def _field_value(field: Any) -> Any:
    try:
        return field.contents()
    except Exception:  # a malformed or exotic field we do not read anyway
        return None


def _rope_scaling(reader: Any, meta: Any, head_dim: int, theta: float) -> dict[str, Any] | None:
    kind = meta("rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling: dict[str, Any] = {"rope_type": kind, "factor": float(meta("rope.scaling.factor"))}
        if (orig := meta("rope.scaling.original_context_length")) is not None:
            scaling["original_max_position_embeddings"] = orig
        return scaling
    if kind not in (None, "none"):
        raise ValueError(f"GGUF rope scaling type {kind!r} is not supported")
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is None:
        return None
    return _llama3_from_rope_freqs(np.asarray(freqs.data, np.float32), head_dim, theta)


def _llama3_from_rope_freqs(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any]:
    """llama.cpp stores Llama-3 rope scaling as per-frequency factors; recover the parameters."""
    scaling = {
        "rope_type": "llama3", "factor": float(factors.max()), "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
    }
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    old, low, high, f = 8192, 1.0, 4.0, scaling["factor"]
    smooth = (old / wavelen - low) / (high - low)
    expected = np.where(
        wavelen < old / high, 1.0, np.where(wavelen > old / low, f, 1 / ((1 - smooth) / f + smooth))
    )
    if expected.shape != factors.shape or not np.allclose(expected, factors, rtol=1e-4):
        raise ValueError(
            "GGUF rope_freqs.weight does not match Llama-3 rope scaling with the usual "
            "low/high frequency factors (1, 4) and 8192 original positions; convert the "
            "original Hugging Face folder instead"
        )
    return scaling


def hf_name(gguf_name: str) -> str:
    """Hugging Face parameter name of a GGUF tensor name."""
    if (m := _BLOCK_RE.fullmatch(gguf_name)) and m[2] in _BLOCK_NAMES:
        return f"model.layers.{m[1]}.{_BLOCK_NAMES[m[2]]}.{m[3]}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[base]}.{suffix}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in the Llama family; "
        "this file's architecture is not supported"
    )


def iter_hf_tensors(reader: Any, config: dict[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor in Hugging Face layout) for every GGUF tensor, in file order."""
    # NOTE: gguf loads only where a GGUF file is read.
    from gguf.quants import dequantize

    permuted = config["model_type"] in _PERMUTED_MODEL_TYPES
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    for t in reader.tensors:
        if t.name in _SKIPPED:
            continue
        name = hf_name(t.name)
        try:
            w = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from e
        if permuted and ".q_proj." in name:
            w = _unpermute(w, heads)
        elif permuted and ".k_proj." in name:
            w = _unpermute(w, kv_heads)
        yield name, torch.from_numpy(np.array(w, np.float32)).to(_out_dtype(t.tensor_type))


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `w.reshape(n_head, 2, d // n_head // 2, *rest).swapaxes(1, 2)`."""
    rest = w.shape[1:]
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *rest).swapaxes(1, 2).reshape(w.shape)
