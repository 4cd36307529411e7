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
        "verification rejects unless the target picks it)",
    )
    device_window: int = Field(
        1024,
        ge=16,
        description="known tokens of each history (the most recent) the device lookup reads",
    )
