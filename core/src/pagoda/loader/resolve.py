"""From the user's `model=` (None, a folder, a .gguf file) to a local Hugging Face folder."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.loader.default_model import DEFAULT_MODEL_NAME, default_model_path
from pagoda.loader.gguf_loader import convert_gguf
from pagoda.loader.weights import safetensors_files

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")
_GENERIC_FAST = ("TokenizersBackend", "PreTrainedTokenizerFast")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


@dataclass(slots=True)
class ResolvedModel:
    name: str  # the served model name
    hf_dir: Path  # config.json, tokenizer files and (unless dummy) safetensors weights
    load_format: str  # "safetensors" | "dummy"
    source: str  # "gguf" | "hf" | "dummy"


def resolve_model(model: str | os.PathLike[str] | None, load_format: str = "auto") -> ResolvedModel:
    """Find or build the Hugging Face folder for `model`; never downloads from the hub."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format {load_format!r} is unknown; use one of {LOAD_FORMATS}")
    dummy = load_format == "dummy"
    if model is None:
        return _from_gguf(DEFAULT_MODEL_NAME, default_model_path(), dummy)
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(
            f"model {str(model)!r} does not exist here; Pagoda does not download from the "
            "Hugging Face hub: give a local model folder (config.json, tokenizer, safetensors) "
            "or a .gguf file, or leave model unset for the default model"
        )
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ValueError(f"{path} is a file but not a .gguf; give a .gguf file or a folder")
        if load_format == "safetensors":
            raise ValueError(f"{path} is a GGUF file; load_format='safetensors' needs a folder")
        return _from_gguf(path.stem, path, dummy)
    if not (path / "config.json").is_file():
        ggufs = sorted(p.name for p in path.glob("*.gguf"))
        hint = f"; pass one of its GGUF files: {', '.join(ggufs)}" if ggufs else ""
        raise FileNotFoundError(f"{path} has no config.json, so it is no model folder{hint}")
    if load_format == "gguf":
        raise ValueError(f"load_format='gguf' needs a .gguf file, and {path} is a folder")
    name = path.resolve().name
    if dummy:
        return ResolvedModel(name, path, "dummy", "dummy")
    safetensors_files(path)  # fail now, with the folder named, when there are no weights
    return ResolvedModel(name, path, "safetensors", "hf")


def _from_gguf(name: str, file: Path, dummy: bool) -> ResolvedModel:
    hf_dir = convert_gguf(file)
    if dummy:
        return ResolvedModel(name, hf_dir, "dummy", "dummy")
    return ResolvedModel(name, hf_dir, "safetensors", "gguf")


def load_hf_config(hf_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The folder's config.json as a dict."""
    file = Path(hf_dir) / "config.json"
    if not file.is_file():
        raise FileNotFoundError(f"{file} does not exist; a model folder needs a config.json")
    return json.loads(file.read_text())


def load_tokenizer(hf_dir_or_name: str | os.PathLike[str], trust_remote_code: bool = False) -> Any:
    """A fast tokenizer from a local folder (or .gguf file); never from the hub."""
    path = Path(hf_dir_or_name).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        path = convert_gguf(path)
    if not path.is_dir():
        raise FileNotFoundError(
            f"tokenizer {str(hf_dir_or_name)!r} is not a local folder; Pagoda does not download "
            "from the Hugging Face hub: give a folder with tokenizer files or a .gguf file"
        )
    if not any((path / f).is_file() for f in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{path} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}); add them "
            "or pass tokenizer= a folder that has them"
        )
    if _generic_fast_tokenizer(path):
        # NOTE: the same class AutoTokenizer would pick, without reading the model's config
        # through transformers' model registry (about 1.5 s of imports on a small CPU).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(path), local_files_only=True)
    # NOTE: transformers is slow to import: only where it is used.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path), trust_remote_code=trust_remote_code, local_files_only=True
    )


def _generic_fast_tokenizer(path: Path) -> bool:
    """Whether the folder's tokenizer is transformers' generic fast tokenizer (as GGUF
    conversion writes), with no class or code of its own."""
    config_file = path / "tokenizer_config.json"
    if not (path / "tokenizer.json").is_file() or not config_file.is_file():
        return False
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return False
    return "auto_map" not in config and config.get("tokenizer_class") in _GENERIC_FAST
