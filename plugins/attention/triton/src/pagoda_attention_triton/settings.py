"""The Triton backend's settings (``plugins.triton.*``), read when the backend is configured."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TritonSettings(BaseModel):
    ragged_prefill: bool = Field(
        True,
        description="steps of new prompts only (no cached context) attend over the step's own"
        " keys with a flash-attention kernel instead of the paged one; false: the paged one",
    )
    fp8_transposed_values: bool = Field(
        True,
        description="an FP8 KV cache stores each value page transposed ([heads, head_dim,"
        " block_size]), so that decode reads values in vectors where one-byte values in token"
        " rows reach the p.v dot a byte at a time; the dots then run in float16",
    )
