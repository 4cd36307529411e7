"""The proposer's settings: the configuration's ``plugins.suffix`` section."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class SuffixSettings(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_tree_depth: int = Field(
        32, ge=2, le=256, description="longest substring counted (match plus draft)"
    )
    global_max_tokens: int = Field(
        200_000,
        ge=0,
        description="output tokens of finished requests the global tree holds, oldest dropped"
        " first; 0: no global tree (each request drafts from its own tokens only)",
    )
    # NOTE: 4 (2 before): at batch 1 on a GPU a verification is padded to k + 1 tokens, so a
    # longer draft costs nothing there; the copy set in bf16 took 721 steps against 753 - 759
    # (benchmarks/README.md). Where steps grow with their tokens the governor weighs them.
    max_spec_factor: float = Field(
        4.0,
        gt=0.0,
        description="a draft is at most this many times as long as the suffix it matched",
    )
    min_token_prob: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="a draft stops where its estimated probability (the product of its tokens'"
        " frequencies after the match) falls below this",
    )
