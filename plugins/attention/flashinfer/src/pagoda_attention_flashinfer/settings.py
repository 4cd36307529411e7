"""The FlashInfer backend's settings (``plugins.flashinfer.*``), read when the backend is
configured."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FlashInferSettings(BaseModel):
    ragged_prefill: bool = Field(
        False,
        description="steps of new prompts only (no cached context) attend over the step's own"
        " keys with FlashInfer's ragged prefill (FA3 on Hopper) instead of the paged one",
    )
