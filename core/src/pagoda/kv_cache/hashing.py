"""Chained hashes of full KV cache blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and extra keys (the cache salt and
the LoRA adapter's id and name, on the first block only: the chain carries them on; and the hash
of every image whose placeholder tokens the block holds, with its offset), so equal hashes mean
equal KV for the whole prefix, not just the block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

from pagoda.request import Request

ExtraKey = str | int | bytes


def _encode_extra_key(key: ExtraKey) -> bytes:
    if isinstance(key, bytes):
        tag, data = b"b", key
    elif isinstance(key, str):
        tag, data = b"s", key.encode()
    elif isinstance(key, int):
        tag, data = b"i", str(key).encode()
    else:
        raise TypeError(f"unsupported block hash extra key {key!r}")
    return tag + struct.pack("<Q", len(data)) + data


def hash_block_tokens(
    parent_hash: bytes | None,
    token_ids: Sequence[int],
    extra_keys: Sequence[ExtraKey] = (),
) -> bytes:
    """SHA-256 over a length-prefixed encoding of (parent hash, token ids, extra keys)."""
    h = hashlib.sha256()
    h.update(b"\x00" if parent_hash is None else b"\x01" + parent_hash)
    h.update(struct.pack(f"<Q{len(token_ids)}q", len(token_ids), *token_ids))
    h.update(struct.pack("<Q", len(extra_keys)))
    for key in extra_keys:
        h.update(_encode_extra_key(key))
    return h.digest()


def update_block_hashes(
    request: Request, block_size: int, num_blocks: int | None = None
) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens (the first
    ``num_blocks`` at most); returns it."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    if num_blocks is not None:
        num_full = min(num_full, num_blocks)
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full):
        tokens = request.token_slice(i * block_size, (i + 1) * block_size)
        extra = _first_block_keys(request) if i == 0 else ()
        if request.mm_inputs is not None:  # the images whose placeholders the block holds
            extra = (*extra, *request.mm_inputs.hash_keys(i * block_size, (i + 1) * block_size))
        parent = hash_block_tokens(parent, tokens, extra)
        hashes.append(parent)
    return hashes


def _first_block_keys(request: Request) -> tuple[ExtraKey, ...]:
    """The extra keys of a request's first block: its cache salt and its adapter (KV computed
    with one adapter is not another's, nor the base model's)."""
    keys: tuple[ExtraKey, ...] = ()
    if request.cache_salt:
        keys += (request.cache_salt,)
    if request.lora_request is not None:
        lora = request.lora_request  # (an adapter unloaded and loaded again gets a new id)
        keys += (f"lora:{lora.lora_int_id}:{lora.lora_name}".encode(),)
    return keys
