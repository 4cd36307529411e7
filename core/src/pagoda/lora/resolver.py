"""Adapter resolvers: find an adapter by name when a request names one the server does not
know (``lora.resolvers``, asked in order). Plugins register theirs with
``register_lora_resolvers``; the core's ``local`` resolver looks in ``lora.resolver_dir``."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from pagoda.config.model import LoRAConfig
from pagoda.lora.peft import CONFIG_FILE


class LoRAResolver(Protocol):
    """Built once from the ``lora`` section (``Resolver(config)``); ``resolve`` is called per
    unknown name, off the engine loop (it may read files or fetch from an object store)."""

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        """The local folder of adapter ``lora_name`` for ``base_model_name`` (a PEFT folder:
        ``adapter_config.json``, ``adapter_model.safetensors``), or None if this resolver has
        no such adapter."""
        ...


class LocalFolderResolver:
    """Adapter NAME is the folder ``lora.resolver_dir``/NAME, if it holds a PEFT config."""

    def __init__(self, config: LoRAConfig) -> None:
        if config.resolver_dir is None:
            raise ValueError("the local LoRA resolver needs lora.resolver_dir (a folder)")
        self.root = Path(config.resolver_dir)
        if not self.root.is_dir():
            raise ValueError(f"lora.resolver_dir {str(self.root)!r} is not a folder")

    def resolve(self, base_model_name: str, lora_name: str) -> str | None:
        if "/" in lora_name or "\\" in lora_name or lora_name in (".", ".."):
            return None  # a name, never a path out of the folder
        folder = self.root / lora_name
        return str(folder) if (folder / CONFIG_FILE).is_file() else None
