"""The profiling pass that sizes the KV cache on a GPU.

The largest step the scheduler can send (``max_num_batched_tokens`` prompt tokens spread over
up to ``max_num_seqs`` requests) runs once through the model over a throwaway cache, and its
logits through the costliest sampling path (a full-vocabulary softmax and sort, as top-p takes)
and the random draw. The peak of device memory above what was allocated before, less the throwaway
cache, is what every step may need besides the weights and the KV cache.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pagoda.attention.backend import AttentionBackend, CommonAttentionMetadata
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.distributed import is_last_stage
from pagoda.ops import fused_draw_applies, sample_from_logits
from pagoda.sample.ops import sample_from_probs
from pagoda.utils import cdiv
from pagoda.worker.step_buffers import StepBuffers

LONG_PROMPT = 512  # tokens of the profiled step's longest prompt, where the limits allow


def _profile_batch(max_num_tokens: int, max_num_reqs: int, max_model_len: int) -> np.ndarray:
    """Prompt lengths of the profiled step: as many tokens as one step may hold, over as many
    requests as may run, none longer than the model's limit."""
    n_tok = min(max_num_tokens, max_num_reqs * max_model_len)
    n_req = min(max_num_reqs, n_tok)
    lens = np.full(n_req, n_tok // n_req, dtype=np.int64)
    lens[: n_tok % n_req] += 1
    # One long prompt among them: attention kernels launch long prefill chunks their own way
    # (the Triton backend's 128-row tiles from 128 query tokens), which then compiles here, not
    # inside the first long prompt's step (0.9 s of a 6 s benchmark on an H200).
    long = min(max_model_len, n_tok - (n_req - 1), LONG_PROMPT)
    if n_req > 1 and long > lens[0]:
        rest = n_tok - long
        lens[1:] = rest // (n_req - 1)
        lens[1 : 1 + rest % (n_req - 1)] += 1
        lens[0] = long
    return lens


@torch.inference_mode()
def profile_peak_activations(
    model: torch.nn.Module,
    attn_backend: type[AttentionBackend],
    buffers: StepBuffers,
    kv_layouts: Sequence[tuple[int, int]],
    dtype: torch.dtype,
    max_model_len: int,
) -> int:
    """Bytes of device memory the largest step the ``buffers`` hold takes beyond the weights of
    ``model`` (CUDA only); ``kv_layouts[i]`` is layer ``i``'s (KV heads, head size)."""
    dev, bs = buffers.device, buffers.block_size
    lens = _profile_batch(buffers.max_num_tokens, buffers.max_num_reqs, max_model_len)
    n_req, n_tok = len(lens), int(lens.sum())
    blocks_per_req = cdiv(lens, bs)
    layers = [m for m in model.modules() if isinstance(m, Attention)]

    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    # One throwaway cache per layout, shared by its layers: the pass needs somewhere to write,
    # not a faithful cache; block 0 stays unused as in the real one.
    caches: dict[tuple[int, int], torch.Tensor] = {}
    for m, layout in zip(layers, kv_layouts):
        if layout not in caches:
            shape = attn_backend.get_kv_cache_shape(int(blocks_per_req.sum()) + 1, bs, *layout)
            caches[layout] = torch.zeros(shape, dtype=dtype, device=dev)
        m.kv_cache = caches[layout]

    common = laid_out_step(buffers, lens, lens)
    with set_forward_context(attn_backend.build_metadata(common)):
        hidden = model(buffers.input_ids[:n_tok], buffers.positions[:n_tok])
    raw = logits = probs = None
    # A pooling model has no LM head to sample; nor has a pipeline stage before the last.
    if not getattr(model, "pooling_only", False) and is_last_stage():
        last = torch.from_numpy(common.query_start_loc_cpu[1:] - 1).to(dev)
        raw = model.compute_logits(hidden[last])  # the model's dtype
        # NOTE: the sampler's general path works on a float32 copy: its peak is the one to
        # measure.
        logits = raw.float()
        probs = logits.softmax(dim=-1)
        torch.sort(probs, dim=-1, descending=True)
        # The random draw's kernels, loaded here: on first use each costs tens of milliseconds,
        # and the first sampled step of a workload would pay about 150 ms for them (and about
        # 0.4 s more for compiling the one-kernel draw).
        uniform = torch.rand(n_req, dtype=torch.float64, device=dev)
        sample_from_probs(probs, uniform)
        if fused_draw_applies(raw):  # and the one-kernel draw's compile, for the logits' dtype
            sample_from_logits(raw, torch.ones(n_req, device=dev), uniform)
    torch.cuda.synchronize(dev)
    cache_bytes = sum(c.numel() * c.element_size() for c in caches.values())
    peak = torch.cuda.max_memory_allocated(dev) - base - cache_bytes

    del hidden, raw, logits, probs, caches
    for m in layers:
        m.kv_cache = torch.empty(0)
    buffers.block_table.zero_()
    torch.cuda.empty_cache()
    return max(int(peak), 0)


def laid_out_step(
    buffers: StepBuffers, q_lens: np.ndarray, seq_lens: np.ndarray
) -> CommonAttentionMetadata:
    """A step written into ``buffers`` for passes that are not a request's (the profiling pass,
    the start-up's steps): request ``i`` computes the last ``q_lens[i]`` of its ``seq_lens[i]``
    tokens (ids 0), and the requests' blocks lie one after another from block 1 (block 0 is the
    pool's null block). Returns the step's metadata over the buffers."""
    bs = buffers.block_size
    n_req, n_tok = len(q_lens), int(q_lens.sum())
    blocks_per_req = cdiv(seq_lens, bs)
    qsl = np.zeros(n_req + 1, dtype=np.int64)
    np.cumsum(q_lens, out=qsl[1:])
    first_block = 1 + np.concatenate([[0], np.cumsum(blocks_per_req)[:-1]])
    positions = np.arange(n_tok) - np.repeat(qsl[:-1] - (seq_lens - q_lens), q_lens)
    slots = (np.repeat(first_block, q_lens) + positions // bs) * bs + positions % bs
    width = int(blocks_per_req.max())
    table = first_block[:, None] + np.arange(width)[None, :]
    table = np.where(np.arange(width)[None, :] < blocks_per_req[:, None], table, 0)

    buffers.input_ids[:n_tok].zero_()
    buffers.positions[:n_tok].copy_(torch.from_numpy(positions))
    buffers.slot_mapping[:n_tok].copy_(torch.from_numpy(slots))
    buffers.query_start_loc[: n_req + 1].copy_(torch.from_numpy(qsl.astype(np.int32)))
    buffers.seq_lens[:n_req].copy_(torch.from_numpy(seq_lens.astype(np.int32)))
    buffers.block_table[:n_req].zero_()
    buffers.block_table[:n_req, :width].copy_(torch.from_numpy(table.astype(np.int32)))
    return CommonAttentionMetadata(
        num_reqs=n_req,
        num_actual_tokens=n_tok,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(seq_lens.max()),
        query_start_loc=buffers.query_start_loc[: n_req + 1],
        seq_lens=buffers.seq_lens[:n_req],
        block_table=buffers.block_table[:n_req],
        slot_mapping=buffers.slot_mapping[:n_tok],
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
        block_size=bs,
    )


def gpu_kv_budget(
    utilization: float,
    total: int,
    free_at_start: int,
    free_now: int,
    activations: int,
    graphs: int = 0,
) -> int:
    """Bytes for the KV cache: this engine's share of the device (``utilization`` of ``total``,
    vLLM's meaning: each engine's own share) less what the engine itself took since it started
    (``free_at_start - free_now``: weights, CUDA context, workspaces), its peak ``activations``
    and its decode graphs' pool. Memory in use before the engine started (another engine in
    this process or another process on the device) is not counted against its share. Negative
    when the share does not even hold the weights and activations."""
    share = total * utilization
    taken = free_at_start - free_now
    return int(share - taken - activations - graphs)


def check_gpu_share(utilization: float, total: int, free_at_start: int) -> None:
    """Raise ``ValueError`` when the device had less free memory at the engine's start than the
    share ``cache.gpu_memory_utilization`` asks for (other engines or processes hold the rest)."""
    share = total * utilization
    if free_at_start < share:
        raise ValueError(
            f"cache.gpu_memory_utilization={utilization:.2f} asks for {share / 2**30:.2f} GiB of "
            f"the GPU's {total / 2**30:.2f} GiB, but only {free_at_start / 2**30:.2f} GiB was free "
            "when the engine started (other engines or processes hold the rest): lower it, or "
            "free the device"
        )
