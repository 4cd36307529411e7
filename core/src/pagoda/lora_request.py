"""``LoRARequest``: which adapter a request runs with (vLLM's names).

A leaf: the request, the step message, the engine and the entrypoints all carry it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """An adapter by name, with an id unique among the adapters of one engine (>= 1) and the
    folder of its PEFT files (``adapter_config.json``, ``adapter_model.safetensors``).

    NOTE: the id and the name key the prefix cache (blocks computed with one adapter are never
    another's) and the id keys the adapter's device slot: two requests on one adapter give both
    alike, and an adapter loaded again from other files needs a new id.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(
                f"LoRARequest: lora_name must be a non-empty string, got {self.lora_name!r}"
            )
        lora_id = self.lora_int_id
        if isinstance(lora_id, bool) or not isinstance(lora_id, int) or lora_id < 1:
            raise ValueError(
                f"LoRARequest {self.lora_name!r}: lora_int_id must be an integer >= 1, got "
                f"{self.lora_int_id!r}"
            )
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"LoRARequest {self.lora_name!r}: lora_path must be a folder path")

    # vLLM's short names.
    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def id(self) -> int:
        return self.lora_int_id

    @property
    def path(self) -> str:
        return self.lora_path
