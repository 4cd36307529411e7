"""The FlashInfer backend's settings (``plugins.flashinfer.*``), read when the backend is
configured."""

from __future__ import annotations

from pydantic import BaseModel, Field


class FlashInferSettings(BaseModel):
    ragged_prefill: bool = Field(
        True,
        description="steps of new prompts only (no cached context) attend over the step's own"
        " keys with FlashInfer's ragged prefill (FA3 on Hopper) instead of the paged one (on an"
        " H200 an embedding call of 256 x 512 tokens took 260 ms against 274)",
    )
