"""The reference attention backend: plain torch over the paged cache, on any device.

Decoding requests (one query token) are grouped by context length, and each group is attended in
one batched call over its gathered contexts, padded to the group's longest; requests with several
query tokens (prefill chunks) one call each. All per-step planning happens in ``build_metadata``,
once per step, not in the layers.

A layer whose :class:`~pagoda.attention.spec.AttentionSpec` is not plain causal attention (a
window, a soft-cap, sinks, chunks, bidirectional, a value head size of its own) takes a general
path: each request's context gathered and attended with explicit float32 logits and the spec's
mask, built once per step per distinct spec. Sinks are read from ``impl.sinks`` (see
:class:`~pagoda.attention.backend.AttentionImpl`).

An FP8 cache (``cache.kv_cache_dtype: fp8``) is read through the same paths: each gather is
dequantized with the layer's scales, and a prompt without context attends to its keys as
stored, not to the step's own, so that every read of a token sees the same values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from pagoda.attention.backend import (
    AttentionBackend,
    AttentionImpl,
    CommonAttentionMetadata,
    read_kv,
    write_kv_cache,
)
from pagoda.attention.spec import AttentionSpec
from pagoda.ops.fp8 import FP8_DTYPE


@dataclass
class _Prefill:
    start: int  # first token in the flat batch
    end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] block ids covering the context
    mask: torch.Tensor | None  # [q_len, seq_len] bool, None when plain causal (no context)


@dataclass
class _Decodes:
    """The step's decodes, grouped by context length; each group is one attention call over its
    rows' blocks, every row padded to the group's longest."""

    tokens: torch.Tensor  # flat-batch indices of the decode tokens, group after group
    blocks: torch.Tensor  # block ids of every group's rows, row-major, group after group
    shapes: list[tuple[int, int]]  # (rows, max_blocks) of each group
    masks: list[torch.Tensor]  # [rows, 1, 1, max_blocks * block_size] bool, True on row's keys
    # The masks as additive float masks, made by the first layer that needs them.
    biases: list[torch.Tensor] | None = None

    def biases_for(self, dtype: torch.dtype) -> list[torch.Tensor]:
        if self.biases is None or self.biases[0].dtype != dtype:
            self.biases = [
                torch.zeros(m.shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
                for m in self.masks
            ]
        return self.biases


@dataclass
class _Request:
    start: int  # first token in the flat batch
    end: int
    blocks: torch.Tensor  # [num_blocks] block ids covering the context
    q_pos: torch.Tensor  # [q_len, 1] the queries' positions
    k_pos: torch.Tensor  # [1, seq_len] the keys' positions


@dataclass
class TorchNativeMetadata:
    common: CommonAttentionMetadata
    decodes: _Decodes | None
    prefills: list[_Prefill]
    # The general path's requests and, per spec, each request's mask: made by the first layer
    # that needs them.
    requests: list[_Request] | None = None
    masks: dict[AttentionSpec, list[torch.Tensor]] = field(default_factory=dict)

    def masks_for(self, spec: AttentionSpec) -> tuple[list[_Request], list[torch.Tensor]]:
        if self.requests is None:
            self.requests = _requests(self.common)
        if spec not in self.masks:
            self.masks[spec] = [_mask(spec, r.q_pos, r.k_pos) for r in self.requests]
        return self.requests, self.masks[spec]


def _requests(common: CommonAttentionMetadata) -> list[_Request]:
    qsl, seq_lens = common.query_start_loc_cpu, common.seq_lens_cpu
    device = common.block_table.device
    out = []
    for i in range(common.num_reqs):
        start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
        blocks = common.block_table[i, : -(-seq_len // common.block_size)].long()
        k_pos = torch.arange(seq_len, device=device)
        q_pos = k_pos[seq_len - (end - start) :, None]
        out.append(_Request(start, end, blocks, q_pos, k_pos[None]))
    return out


def _mask(spec: AttentionSpec, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
    """[q_len, seq_len] bool: True where the spec lets query position ``q_pos`` see ``k_pos``."""
    dist = q_pos - k_pos
    mask = dist >= 0 if spec.causal else torch.ones_like(dist, dtype=torch.bool)
    if spec.sliding_window is not None:
        mask &= dist.abs() < spec.sliding_window
    if spec.chunk_size is not None:
        mask &= q_pos // spec.chunk_size == k_pos // spec.chunk_size
    return mask


def _length_classes() -> np.ndarray:
    """Upper bounds, in blocks, of the decode groups' lengths: 4, 8, .., 32, then 1/8 more each
    (a group costs a few calls a layer; narrower classes would pad less but call more)."""
    bounds = [4]
    while bounds[-1] < 1 << 24:
        bounds.append(max(bounds[-1] + 4, -(-bounds[-1] * 9 // 8)))
    return np.array(bounds)


_LENGTH_CLASSES = _length_classes()


def _dequantize(t: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Gathered keys or values in ``dtype``: an FP8 cache's (gathered as bytes) dequantized."""
    return read_kv(t.view(FP8_DTYPE), scale, dtype) if t.dtype == torch.uint8 else t.to(dtype)


class TorchNativeBackend(AttentionBackend):
    name = "torch_native"
    accepts_model_stored_kv = True  # (its forward writes through write_kv_cache alone)
    priority = 0

    @classmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        return dtype in (torch.float32, torch.float16, torch.bfloat16)

    @classmethod
    def unsupported(cls, spec: AttentionSpec) -> str | None:
        return None  # every feature of the spec

    @classmethod
    def supports_kv_cache_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype == FP8_DTYPE

    @classmethod
    def get_impl_cls(cls) -> type[AttentionImpl]:
        return TorchNativeImpl

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> TorchNativeMetadata:
        n = common.num_reqs
        qsl = common.query_start_loc_cpu[: n + 1]
        seq_lens = common.seq_lens_cpu[:n]
        q_lens = np.diff(qsl)
        bs = common.block_size
        device = common.block_table.device
        # NOTE: a decode reads its whole context, so padding every row to the batch's longest
        # reads 1.6 times the keys when lengths spread evenly over x..4x; rows of one length class
        # (_LENGTH_CLASSES: 4 blocks wide, an eighth of the bound past 32) share one call,
        # padded to their own longest.
        decode_rows = np.nonzero(q_lens == 1)[0]
        decodes = None
        if len(decode_rows):
            num_blocks = -(-seq_lens[decode_rows] // bs)
            classes = np.searchsorted(_LENGTH_CLASSES, num_blocks)
            order = np.argsort(classes, kind="stable")
            rows, num_blocks, classes = decode_rows[order], num_blocks[order], classes[order]
            starts = np.flatnonzero(np.diff(classes, prepend=-1))
            ends = np.append(starts[1:], len(rows))
            keys = torch.arange(int(num_blocks.max()) * bs, device=device)
            lens = torch.from_numpy(seq_lens[rows].astype(np.int64)).to(device)
            blocks, shapes, masks = [], [], []
            for lo, hi in zip(starts.tolist(), ends.tolist()):
                max_blocks = int(num_blocks[lo:hi].max())
                rows_t = torch.from_numpy(rows[lo:hi]).to(device)
                blocks.append(common.block_table[rows_t, :max_blocks].flatten())
                shapes.append((hi - lo, max_blocks))
                masks.append((keys[None, : max_blocks * bs] < lens[lo:hi, None])[:, None, None])
            tokens = torch.from_numpy(qsl[rows].astype(np.int64)).to(device)
            decodes = _Decodes(tokens, torch.cat(blocks).long(), shapes, masks)
        prefills = []
        for i in np.nonzero(q_lens > 1)[0]:
            start, end, seq_len = int(qsl[i]), int(qsl[i + 1]), int(seq_lens[i])
            q_len = end - start
            blocks = common.block_table[int(i), : -(-seq_len // bs)]
            mask = None
            if seq_len > q_len:
                ctx = seq_len - q_len
                q_pos = torch.arange(q_len, device=device)[:, None] + ctx
                mask = torch.arange(seq_len, device=device)[None, :] <= q_pos
            prefills.append(_Prefill(start, end, seq_len, blocks, mask))
        return TorchNativeMetadata(common, decodes, prefills)


class TorchNativeImpl(AttentionImpl):
    def attends_from_inputs(self, kv_cache: torch.Tensor, attn_metadata: Any) -> bool:
        # New prompts of two tokens or more (a one-token prompt takes the decode path, which
        # gathers from the cache), plain attention, a cache in the model's dtype.
        md: TorchNativeMetadata = attn_metadata
        return (
            md.decodes is None
            and kv_cache.dtype != FP8_DTYPE
            and not self.spec.features()
            and all(p.mask is None for p in md.prefills)
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: TorchNativeMetadata,
    ) -> torch.Tensor:
        md = attn_metadata
        num_tokens = md.common.num_actual_tokens
        key_cache, value_cache = write_kv_cache(
            key, value, kv_cache, md.common.slot_mapping, num_tokens, self.k_scale, self.v_scale
        )
        fp8 = kv_cache.dtype == FP8_DTYPE
        if fp8:  # NOTE: gathered as bytes: not every device has FP8 gather kernels
            key_cache, value_cache = key_cache.view(torch.uint8), value_cache.view(torch.uint8)
        if self.spec.features():
            return self._general(query, key_cache, value_cache, md)

        out = torch.empty_like(query)
        if md.decodes is not None:
            q = query.index_select(0, md.decodes.tokens)
            out.index_copy_(0, md.decodes.tokens, self._decode(q, key_cache, value_cache, md))
        h_kv, d = self.num_kv_heads, self.head_size
        group = self.num_heads // h_kv
        for p in md.prefills:
            if p.mask is None and not fp8:  # no context: the keys are the step's own, no gather
                k, v = key[p.start : p.end], value[p.start : p.end]
            else:
                k = key_cache[p.blocks].flatten(0, 1)[: p.seq_len]
                v = value_cache[p.blocks].flatten(0, 1)[: p.seq_len]
                if fp8:
                    k = _dequantize(k, self.k_scale, query.dtype)
                    v = _dequantize(v, self.v_scale, query.dtype)
            q_len, kv_len = p.end - p.start, k.shape[0]
            # NOTE: KV heads as the batch and the query heads sharing one as its heads, K and V
            # expanded (stride 0, no copy): torch's fused CPU kernel with no copy of K and V per
            # query head, the same bits as repeating them (enable_gqa takes a slower path).
            o = F.scaled_dot_product_attention(
                query[p.start : p.end].view(q_len, h_kv, group, d).permute(1, 2, 0, 3),
                k.permute(1, 0, 2).unsqueeze(1).expand(h_kv, group, kv_len, d),
                v.permute(1, 0, 2).unsqueeze(1).expand(h_kv, group, kv_len, d),
                attn_mask=p.mask,
                is_causal=p.mask is None,
                scale=self.scale,
            )
            out[p.start : p.end] = o.permute(2, 0, 1, 3).reshape(q_len, self.num_heads, d)
        return out

    def _decode(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_size], group after group
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchNativeMetadata,
    ) -> torch.Tensor:
        h_kv, d = self.num_kv_heads, self.head_size
        dec = md.decodes
        key_rows = key_cache.view(key_cache.shape[0], -1)
        value_rows = value_cache.view(value_cache.shape[0], -1)
        outs, row, block = [], 0, 0
        for (b, max_blocks), bias in zip(dec.shapes, dec.biases_for(q.dtype)):
            # One row gather per block (index_select beats advanced indexing on CPU), a group at
            # a time so that its keys are still in cache when attended, viewed as [B, H_kv, L,
            # D] without a copy.
            blocks = dec.blocks[block : block + b * max_blocks]
            k = key_rows.index_select(0, blocks).view(b, -1, h_kv, d).transpose(1, 2)
            v = value_rows.index_select(0, blocks).view(b, -1, h_kv, d).transpose(1, 2)
            if k.dtype == torch.uint8:  # an FP8 cache's bytes
                k = _dequantize(k, self.k_scale, q.dtype)
                v = _dequantize(v, self.v_scale, q.dtype)
            # NOTE: the query heads that share a KV head ride as that head's "query
            # positions", so grouped-query attention needs no copy of K and V per query head.
            o = F.scaled_dot_product_attention(
                q[row : row + b].view(b, h_kv, -1, d), k, v, attn_mask=bias, scale=self.scale
            )
            outs.append(o.reshape(b, self.num_heads, d))
            row, block = row + b, block + b * max_blocks
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _general(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        md: TorchNativeMetadata,
    ) -> torch.Tensor:
        """Any spec: per request, float32 logits over the gathered context, soft-capped, masked,
        with the sinks in the softmax's denominator."""
        spec = self.spec
        h_kv, d, dv = self.num_kv_heads, self.head_size, spec.v_head_size
        group = self.num_heads // h_kv
        out = query.new_empty(query.shape[0], self.num_heads, dv)
        sinks = None
        if spec.sinks:
            if self.sinks is None:
                raise ValueError("an attention spec with sinks needs impl.sinks, [num_heads]")
            sinks = self.sinks.float().view(h_kv, group, 1, 1)
        requests, masks = md.masks_for(spec)
        for r, mask in zip(requests, masks):
            seq_len = mask.shape[1]
            k = _dequantize(key_cache[r.blocks].flatten(0, 1)[:seq_len, :, :d], self.k_scale,
                            torch.float32)  # fmt: skip
            v = _dequantize(value_cache[r.blocks].flatten(0, 1)[:seq_len, :, :dv], self.v_scale,
                            torch.float32)  # fmt: skip
            q = query[r.start : r.end].float().view(-1, h_kv, group, d).permute(1, 2, 0, 3)
            # [h_kv, group, q_len, seq_len]
            logits = q @ k.permute(1, 2, 0).unsqueeze(1) * self.scale
            if spec.logit_softcap is not None:
                logits = torch.tanh(logits / spec.logit_softcap) * spec.logit_softcap
            logits = logits.masked_fill(~mask, float("-inf"))
            if sinks is not None:
                logits = torch.cat([logits, sinks.expand(-1, -1, logits.shape[2], 1)], dim=-1)
            probs = logits.softmax(dim=-1)[..., :seq_len]
            o = probs @ v.permute(1, 0, 2).unsqueeze(1)  # [h_kv, group, q_len, dv]
            out[r.start : r.end] = o.permute(2, 0, 1, 3).reshape(-1, self.num_heads, dv)
        return out
