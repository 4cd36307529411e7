"""Steps over a cached context, run once at start-up so that their kernels load before a request
needs them.

Attention kernels that compile on first use (Triton's) compile a variant for each launch
configuration a step's shape selects: the rows a program holds follow the step's longest query,
and split-KV launches follow its context. The profiling pass and the graphs' capture run fresh
prompts, decodes and verifications; steps whose queries continue a cached context (a prompt
whose prefix the cache held, a prompt chunk, a verification past the largest graph) reach other
variants, and the first request to meet one waited for its compile: about 0.5 s on an H200, in
a benchmark of 18 prompts on SmolLM2 twice (a prompt sharing a prefix with an earlier one, its
uncached part 5 and later 21 tokens long).

Each step here is one request of ``q`` new tokens over a context, through the model and the
engine's own KV cache (the blocks are free at start-up; a request's blocks are written before
they are read), for ``q`` in :data:`QUERY_LENS` and two contexts: one block, and the longest the
model and the cache allow (a backend that splits long contexts splits there). A backend whose
kernels do not compile on first use runs them once more, some milliseconds a step.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend
from pagoda.attention.layer import set_forward_context
from pagoda.worker.profile import laid_out_step
from pagoda.worker.step_buffers import StepBuffers

# Query lengths, one in each launch class of the kernels there are: up to 16 (verification steps,
# short uncached prompt tails), Triton's programs hold a query's heads times the queries in 16,
# 32 or 64 rows (``next_power_of_2(q * group)``: for any group of 1 to 16 query heads a KV head,
# these lengths meet each class) and may split the context; longer queries are not split, and
# from 128 tokens a prompt chunk runs 128-row programs.
QUERY_LENS = (1, 2, 3, 4, 6, 8, 16, 32, 128)


@torch.inference_mode()
def warm_context_steps(
    model: torch.nn.Module,
    attn_backend: type[AttentionBackend],
    buffers: StepBuffers,
    max_model_len: int,
    num_blocks: int,
) -> tuple[int, float]:
    """Run the steps the module note describes through ``model`` (its attention layers hold
    their KV caches of ``num_blocks`` blocks); returns the number of steps run and their
    seconds."""
    start = time.perf_counter()
    dev, bs = buffers.device, buffers.block_size
    # Block 0 is the pool's null block: a request's blocks are 1 on.
    longest = min(max_model_len, (num_blocks - 1) * bs, buffers.block_table.shape[1] * bs)
    steps = 0
    for q in QUERY_LENS:
        if q > buffers.max_num_tokens:
            break
        for context in dict.fromkeys((bs, longest - q)):
            if context < 1 or context + q > longest:  # (a small cache: the blocks it has)
                continue
            common = laid_out_step(buffers, np.array([q]), np.array([context + q]))
            with set_forward_context(attn_backend.build_metadata(common)):
                model(buffers.input_ids[:q], buffers.positions[:q])
            steps += 1
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    buffers.block_table.zero_()
    return steps, time.perf_counter() - start


# The most arithmetic spent warming the LM head's row counts (``warm_logits_rows``): about
# 0.3 s on an H200; SmolLM2's every row count up to 2,304 fits, an 8B model's up to some 480.
LOGITS_WARM_FLOPS = 2.5e14


def logits_rows(max_num_reqs: int, max_num_tokens: int, num_spec_tokens: int = 0) -> int:
    """The most rows one step scores through the LM head outside a graph: one a request, or
    with speculation each request's drafts and the token after them (``k + 1``), within the
    step's token budget."""
    return min(max_num_tokens, max_num_reqs * (num_spec_tokens + 1))


@torch.inference_mode()
def warm_logits_rows(
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    hidden_size: int,
    vocab_size: int,
    max_rows: int,
    dtype: torch.dtype,
    device: torch.device,
    max_flops: float = LOGITS_WARM_FLOPS,
) -> tuple[int, float]:
    """Score every row count from 1 up through ``compute_logits`` once, so that the GEMM of each
    is set up now and not inside a request's step; returns the largest count warmed and the
    seconds taken.

    The first product of a row count the process has not met stalls the host until the device
    has drained its queue (the library choosing and preparing that shape's kernel): 2 - 4 ms on
    an H200, in eager verification steps whose rows vary with the drafts (random prompts at
    batch 64: some eight such stalls in a 0.35 s batch). Met once per count and process, then
    cached; here, on an idle device, each costs about 0.3 ms. Counts are warmed in increasing
    order while their arithmetic (``2 * rows * hidden_size * vocab_size`` each, the same on
    every tensor-parallel rank, whose collectives must match) stays within ``max_flops``."""
    start = time.perf_counter()
    x = torch.zeros(max_rows, hidden_size, dtype=dtype, device=device)
    per_row = 2.0 * hidden_size * vocab_size
    spent, warmed = 0.0, 0
    for rows in range(1, max_rows + 1):
        spent += rows * per_row
        if spent > max_flops:
            break
        compute_logits(x[:rows])
        warmed = rows
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return warmed, time.perf_counter() - start
