"""The plugin's settings (``plugins.moe`` in the engine's configuration)."""

from __future__ import annotations

from pydantic import BaseModel, Field


class MoESettings(BaseModel):
    expert_parallel: bool = Field(
        False,
        description="with several ranks, each holds whole experts (E / ranks of them) and tokens"
        " travel to their experts and back by all-to-all; off: each rank holds a slice of every"
        " expert's intermediate dimension and the partial outputs are summed (tensor parallel)",
    )
