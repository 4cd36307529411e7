"""From logits to the next token of each request: vLLM's sampling pipeline, batched on the
model's device, with no Python loop over requests or tokens.

    1. logprobs of the model's own distribution (raw logits), when some row asked
    2. logits in float32; the grammar bitmask of constrained rows (structured output)
    3. allowed_token_ids; 4. bad words and min_tokens (-inf); 5. logit_bias
    6. penalties: repetition, frequency, presence
       -> ``Sampler.logits_processors`` run here: the place for grammar masks and plugins
    7. greedy rows: argmax; random rows: temperature, min_p, top-k/top-p, one draw
       (a step of temperature alone, on CUDA: one kernel from the logits to the tokens)
    8. the chosen tokens' logprobs and ranks, and the top k

Speculative verification (a rejection sampler) enters through ``process_logits`` and ``probs``
on the target logits of every draft position, not through ``forward``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagoda import ops
from pagoda.ops.batch_invariant import batch_invariant_enabled
from pagoda.ops.batch_invariant import log_softmax as invariant_log_softmax
from pagoda.sample.batch_invariant import sample_in_fixed_rows
from pagoda.sample.metadata import SamplerOutput, SamplingMetadata
from pagoda.sample.ops import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    gather_logprobs,
    sample_from_probs,
)

# Takes [num_rows, vocab] float32 logits and the step's metadata (``md.req_ids`` names the rows);
# returns the logits to sample from (it may work in place).
LogitsProcessor = Callable[[torch.Tensor, SamplingMetadata], torch.Tensor]


class Sampler(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.logits_processors: list[LogitsProcessor] = []

    def forward(self, logits: torch.Tensor, md: SamplingMetadata) -> SamplerOutput:
        """``logits``: [num_rows, vocab], consumed (changed in place when float32)."""
        if md.all_random and self.plain(md) and ops.fused_draw_applies(logits):
            # Temperature alone: one kernel from the logits to the tokens (batch 256 over Qwen3's
            # vocabulary on an H200: 81 us where the separate passes took 545, fused_draw.py).
            return SamplerOutput(ops.sample_from_logits(logits, md.temperature, md.uniform), None)
        raw_logprobs = None
        if md.max_num_logprobs is not None:
            if batch_invariant_enabled():
                raw_logprobs = invariant_log_softmax(logits)
            else:
                raw_logprobs = logits.float().log_softmax(dim=-1)
        logits = self.process_logits(logits, md)
        sampled = self.sample(logits, md)
        if raw_logprobs is None:
            return SamplerOutput(sampled, None)
        return SamplerOutput(sampled, gather_logprobs(raw_logprobs, md.max_num_logprobs, sampled))

    def plain(self, md: SamplingMetadata) -> bool:
        """Whether the rows of ``md`` draw from the model's logits as they are: no setting acts
        on them (``SamplingMetadata.plain``) and no logits processor runs."""
        return md.plain and not self.logits_processors

    def process_logits(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Steps 2-6 and the logits processors: what greedy and random rows both see."""
        logits = logits.float()
        if md.grammar is not None:  # structured output: tokens the grammar refuses get -inf
            logits = md.grammar.apply(logits)
        if md.allowed_mask is not None:
            logits.masked_fill_(md.allowed_mask, float("-inf"))
        if md.banned is not None:
            logits.index_put_(md.banned, logits.new_tensor(float("-inf")))
        if md.logit_bias is not None:
            rows, ids, bias = md.logit_bias
            logits.index_put_((rows, ids), bias, accumulate=True)
        if md.penalties is not None:
            logits = apply_penalties(logits, md.penalties)
        for processor in self.logits_processors:
            logits = processor(logits, md)
        return logits

    def sample(self, logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """Step 7 on processed logits: [num_rows] int64 token ids."""
        if md.all_greedy:
            return logits.argmax(dim=-1)
        greedy = None if md.all_random else logits.argmax(dim=-1)
        if batch_invariant_enabled():
            sampled = sample_in_fixed_rows(logits, md, self.probs)
        else:
            sampled = sample_from_probs(self.probs(logits, md), md.uniform)
        return sampled if greedy is None else torch.where(md.greedy_mask, greedy, sampled)

    @staticmethod
    def probs(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        """The distribution a random row draws from: processed logits over the temperature,
        filtered by min_p, then top-k and top-p, through softmax (vLLM's order)."""
        logits = logits.div_(md.temperature.unsqueeze(1))
        if md.min_p is not None:
            logits = apply_min_p(logits, md.min_p)
        logits = apply_top_k_top_p(logits, md.top_k, md.max_top_k, md.top_p)
        return logits.softmax(dim=-1)
