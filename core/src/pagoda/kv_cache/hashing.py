"""Chained hashes of full KV cache blocks, the keys of the prefix cache.

A block's hash covers its parent's hash, its own token ids and extra keys (the cache salt and the
LoRA adapter's id and name, on the first block only: the chain carries them on; and the hash of every
image whose placeholder tokens the block holds, with its offset), so equal hashes mean equal KV
for the whole prefix, not just the block.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

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


def update_block_hashes(request: Request, block_size: int) -> list[bytes]:
    """Extend ``request.block_hashes`` to cover every full block of its tokens; returns it."""
    hashes = request.block_hashes
    num_full = request.num_tokens // block_size
    parent = hashes[-1] if hashes else None
    start = len(hashes)
    if request.mm_inputs is None:
        # The prompt's blocks, packed in one call: a long prompt has thousands of blocks, and
        # packing each block's ids apart cost more than hashing them (the first step of a batch
        # of new prompts waits for every one of its blocks' hashes).
        prompt_full = min(num_full, len(request.prompt_token_ids) // block_size)
        if start < prompt_full:
            parent = _hash_prompt_blocks(request, block_size, start, prompt_full, parent)
            start = prompt_full
    for i in range(start, num_full):
        tokens = request.token_slice(i * block_size, (i + 1) * block_size)
        extra = _first_block_keys(request) if i == 0 else ()
        if request.mm_inputs is not None:  # the images whose placeholders the block holds
            extra = (*extra, *request.mm_inputs.hash_keys(i * block_size, (i + 1) * block_size))
        parent = hash_block_tokens(parent, tokens, extra)
        hashes.append(parent)
    return hashes


def _hash_prompt_blocks(
    request: Request, block_size: int, first: int, end: int, parent: bytes | None
) -> bytes | None:
    """:func:`hash_block_tokens` of the prompt's blocks ``first..end`` (no images), appended to
    ``request.block_hashes``: the same bytes hashed, the ids packed once for all of them."""
    hashes = request.block_hashes
    if first == 0:
        parent = hash_block_tokens(None, request.prompt_token_ids[:block_size],
                                   _first_block_keys(request))  # fmt: skip
        hashes.append(parent)
        first = 1
        if first >= end:
            return parent
    ids = np.asarray(request.prompt_token_ids[first * block_size : end * block_size], dtype="<i8")
    data = memoryview(ids.tobytes())
    head = struct.pack("<Q", block_size)
    tail = struct.pack("<Q", 0)  # no extra keys past the first block
    step = block_size * 8
    sha256 = hashlib.sha256
    for off in range(0, len(data), step):
        h = sha256(b"\x01" + parent)  # type: ignore[operator]  # (a parent: not the first block)
        h.update(head)
        h.update(data[off : off + step])
        h.update(tail)
        parent = h.digest()
        hashes.append(parent)
    return parent


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
