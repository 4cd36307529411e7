"""The Triton backend's settings (``plugins.triton.*``), read when the backend is configured."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TritonSettings(BaseModel):
    ragged_prefill: bool = Field(
        True,
        description="steps of new prompts only (no cached context) attend over the step's own"
        " keys with a flash-attention kernel instead of the paged one; false: the paged one",
    )
