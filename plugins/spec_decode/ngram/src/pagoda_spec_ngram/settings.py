"""The n-gram proposer's settings (``plugins.ngram.*``), read when the proposer is built."""

from __future__ import annotations

from pydantic import BaseModel, Field


class NgramSettings(BaseModel):
    device_drafts: bool = Field(
        False,
        description="after each verification, look the next drafts up on the device "
        "(pagoda_spec_ngram.device) so that the next verification launches before the step in "
        "flight is read; needs verification graphs that replay as captured (the Triton "
        "backend), k drafts a request (a match's missing drafts are filled with token 0, which "
        "verification rejects unless the target picks it). Off by default: no request pauses "
        "and every verification takes k drafts, which on an H200 ran slower than the host's "
        "adaptive drafts in bfloat16 (0.99x against 1.54x) and alike in float32",
    )
    device_window: int = Field(
        1024,
        ge=16,
        description="known tokens of each history (the most recent) the device lookup reads",
    )
