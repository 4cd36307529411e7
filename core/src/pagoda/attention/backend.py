"""The attention backend interface: what a backend plugin implements.

A backend is a class registered by name through the ``register_attention_backends`` hook. The
model runner builds one :class:`CommonAttentionMetadata` per step (never per layer); the backend
turns it into its own metadata once, and each layer's :class:`AttentionImpl` reads that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch


@dataclass
class CommonAttentionMetadata:
    """The flat batch of one step, as every backend receives it.

    Tokens of request ``i`` are ``query_start_loc[i]:query_start_loc[i + 1]`` of the flat batch;
    the request's context holds ``seq_lens[i]`` tokens including them, so its first query token sits
    at position ``seq_lens[i] - query_len[i]``. ``slot_mapping[t]`` is the KV cache slot
    (``block_id * block_size + offset``) where token ``t`` is written; ``block_table[i]`` lists the
    request's blocks, padded with block 0 (a block the pool never hands out).
    """

    num_reqs: int
    num_actual_tokens: int
    max_query_len: int
    max_seq_len: int
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32, on the device
    seq_lens: torch.Tensor  # [num_reqs] int32, on the device
    block_table: torch.Tensor  # [num_reqs, max_blocks_per_req] int32, on the device
    slot_mapping: torch.Tensor  # [num_actual_tokens] int64, on the device
    query_start_loc_cpu: np.ndarray  # the same, host copies for planning without a sync
    seq_lens_cpu: np.ndarray
    block_size: int


class AttentionImpl(ABC):
    """One attention layer's computation over the paged KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # the shape get_kv_cache_shape returned
        attn_metadata: Any,  # what build_metadata returned for this step
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_size]
        """Write this step's keys and values into the cache, then attend over each request's
        context (causal within the step's tokens)."""


class AttentionBackend(ABC):
    """A family of attention kernels. Subclasses are classes, not instances: the runner calls
    the class methods, and builds one impl per layer."""

    name: ClassVar[str]
    #: Higher wins when ``attention.backend`` is ``auto`` and several support the model.
    priority: ClassVar[int] = 0
    #: Whether decode steps can be captured in a CUDA graph and replayed over fixed buffers.
    supports_cuda_graph: ClassVar[bool] = False
    #: Top-level modules the kernels import (``("flashinfer",)``): ``pagoda plugins`` names the
    #: missing ones when the backend cannot run on this machine.
    requires: ClassVar[tuple[str, ...]] = ()

    @classmethod
    @abstractmethod
    def supports(cls, device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
        """Whether this backend runs on ``device`` with this dtype and head size."""

    @classmethod
    def supports_block_size(cls, block_size: int) -> bool:
        """Whether this backend reads a paged cache with blocks of ``block_size`` tokens."""
        return block_size >= 1

    @classmethod
    def get_kv_cache_shape(
        cls, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int
    ) -> tuple[int, ...]:
        """Shape of one layer's cache tensor. The default holds keys at [0] and values at [1]."""
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    @classmethod
    @abstractmethod
    def get_impl_cls(cls) -> type[AttentionImpl]: ...

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """Per-step planning (for example splitting decodes from prefills); once per step."""
        return common

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata) -> Any:
        """The metadata captured in a decode CUDA graph of ``common.num_reqs`` requests (one per
        batch size): ``common`` views the runner's persistent buffers and holds worst-case
        lengths (``max_seq_len`` is the model's limit). Default: ``build_metadata``."""
        return cls.build_metadata(common)

    @classmethod
    def prepare_graph_replay(cls, metadata: Any, common: CommonAttentionMetadata) -> None:
        """Before each replay, outside the graph: bring ``metadata`` (from
        ``build_graph_metadata``) up to this step, whose ``common`` is padded to the graph's batch
        size (padding rows attend to one slot of block 0). Default: nothing, for backends whose
        kernels read all they need from the persistent buffers."""
        return None


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    num_tokens: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Store this step's keys and values in their slots of a cache in the default layout
    (``[2, num_blocks, block_size, num_kv_heads, head_size]``); returns the key and value caches."""
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    heads, size = key.shape[1], key.shape[2]
    slots = slot_mapping[:num_tokens]
    key_cache.view(-1, heads, size).index_copy_(0, slots, key[:num_tokens])
    value_cache.view(-1, heads, size).index_copy_(0, slots, value[:num_tokens])
    return key_cache, value_cache
