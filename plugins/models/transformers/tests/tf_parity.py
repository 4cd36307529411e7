"""Helpers of the parity tests: tiny random transformers models saved as checkpoints, and a
paged KV cache driven by hand (chunked prefill, a prefix-cache hit, mixed decode steps)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from pagoda_models_transformers.impl import TransformersModelImpl
from pagoda_models_transformers.model import TransformersCausalLM
from pagoda_models_transformers.tiny import tiny_config

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.spec import AttentionSpec
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.loader import iter_safetensors
from pagoda.loader.synthetic import synthetic_tokenizer

BLOCK = 4
#: The architectures whose parity the tests pin (model types of transformers).
ARCHS = (
    "gemma2",
    "gemma3_text",
    "phi3",
    "olmo2",
    "granite",
    "smollm3",
    "glm",
    "qwen3_moe",
    "mixtral",
    "gpt_oss",
    "cohere",
    "stablelm",
)


def hf_model(
    model_type: str, seed: int = 0, tweak: Callable[[Any], None] | None = None, **overrides: Any
) -> Any:
    """The tiny random transformers model of ``model_type`` (float32, eager attention), with
    random norm weights so that every norm matters; ``tweak`` edits its weights after."""
    cfg = tiny_config(model_type)
    if cfg is None:
        raise RuntimeError(f"no tiny config for {model_type}")
    for key, value in overrides.items():
        setattr(cfg, key, value)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and p.ndim == 1:
                p.uniform_(0.5, 1.5) if p.mean().abs() > 0.5 else p.uniform_(-0.5, 0.5)
        if tweak is not None:
            tweak(model)
    return model


def save(model: Any, folder: Path) -> Path:
    """``model`` as a checkpoint folder (``save_pretrained``'s format) with a stand-in
    tokenizer."""
    model.save_pretrained(folder)
    cfg = model.config
    synthetic_tokenizer(cfg.vocab_size, cfg.eos_token_id if isinstance(cfg.eos_token_id, int)
                        else None).save_pretrained(folder)  # fmt: skip
    return folder


def hf_config_dict(folder: Path) -> dict[str, Any]:
    import json

    return json.loads((folder / "config.json").read_text())


def build_ours(
    folder: Path, drop: Callable[[AttentionSpec], AttentionSpec] | None = None
) -> TransformersCausalLM:
    """The impl's model of the checkpoint in ``folder``, its weights loaded from the files;
    ``drop`` rewrites each layer's spec (a negative control)."""
    shape = TransformersModelImpl.shape(hf_config_dict(folder), 1)
    cfg = shape.config
    if drop is not None:
        cfg = dataclasses.replace(cfg, specs=tuple(drop(s) for s in cfg.specs))
    model = TransformersModelImpl.model_class(shape)(cfg, TorchNativeBackend)
    model.load_weights(iter_safetensors(folder))
    return model.eval()


@dataclasses.dataclass
class Sequence:
    tokens: list[int]
    blocks: list[int]
    computed: int = 0
    #: The first position this cache computed (a prefix hit's tokens come from another).
    first: int = 0
    logits: list[torch.Tensor] = dataclasses.field(default_factory=list)


class PagedCache:
    """Sequences in one paged cache whose blocks are handed out out of order; a sequence may
    start on another's blocks (a prefix-cache hit)."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 64) -> None:
        self.model = model
        for m in model.modules():
            if isinstance(m, Attention):
                shape = TorchNativeBackend.get_kv_cache_shape(
                    num_blocks, BLOCK, m.spec.num_kv_heads, m.spec.cache_head_size
                )
                m.kv_cache = torch.zeros(shape)
        order = np.random.default_rng(0).permutation(np.arange(1, num_blocks))
        self.free = [int(b) for b in order]

    def add(self, tokens: list[int], share: Sequence | None = None, shared: int = 0) -> Sequence:
        """A sequence of ``tokens`` (prompt so far); with ``share``, its first ``shared`` tokens
        (whole blocks) are already in ``share``'s blocks."""
        blocks = list(share.blocks[: shared // BLOCK]) if share is not None else []
        return Sequence(list(tokens), blocks, computed=shared, first=shared)

    def _grow(self, seq: Sequence, length: int) -> None:
        while len(seq.blocks) * BLOCK < length:
            seq.blocks.append(self.free.pop())

    def step(self, work: list[tuple[Sequence, int]]) -> None:
        """One step over the flat batch: each (sequence, number of its next tokens to run)."""
        ids, pos, slots, starts, lens = [], [], [], [0], []
        for seq, n in work:
            start = seq.computed
            self._grow(seq, start + n)
            for p in range(start, start + n):
                ids.append(seq.tokens[p])
                pos.append(p)
                slots.append(seq.blocks[p // BLOCK] * BLOCK + p % BLOCK)
            starts.append(starts[-1] + n)
            lens.append(start + n)
        width = max(len(s.blocks) for s, _ in work)
        table = np.zeros((len(work), width), dtype=np.int32)
        for i, (seq, _) in enumerate(work):
            table[i, : len(seq.blocks)] = seq.blocks
        n = len(ids)
        common = CommonAttentionMetadata(
            num_reqs=len(work),
            num_actual_tokens=n,
            max_query_len=max(k for _, k in work),
            max_seq_len=max(lens),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            block_table=torch.from_numpy(table),
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc_cpu=np.array(starts),
            seq_lens_cpu=np.array(lens),
            block_size=BLOCK,
        )
        meta = TorchNativeBackend.build_metadata(common)
        with torch.inference_mode(), set_forward_context(meta):
            hidden = self.model(torch.tensor(ids), torch.tensor(pos))
            logits = self.model.compute_logits(hidden)
        for i, (seq, k) in enumerate(work):
            seq.logits.extend(logits[starts[i] : starts[i] + k])
            seq.computed += k


def run_in_steps(model: torch.nn.Module, tokens: list[int], steps: list[int]) -> torch.Tensor:
    """One sequence of ``tokens`` through a paged cache, ``steps[i]`` tokens in step ``i`` (a
    chunked prefill, each chunk after the first attending to the cache, then decode steps):
    the logits of every position run, ``[sum(steps), vocab]``."""
    cache = PagedCache(model)
    seq = cache.add(tokens)
    for n in steps:
        cache.step([(seq, n)])
    return torch.stack(seq.logits)


def run_scenario(model: torch.nn.Module, vocab: int, decode_steps: int = 4) -> list[Sequence]:
    """A chunked prefill (13 + 10 tokens), a second prompt that hits the first's first three
    blocks and runs its last 11 tokens in a step with the first's decode, then decode steps of
    both, each appending the greedy token. Returns the sequences with their logits."""
    gen = torch.Generator().manual_seed(1)
    a_prompt = torch.randint(3, vocab, (23,), generator=gen).tolist()
    b_prompt = a_prompt[:12] + torch.randint(3, vocab, (11,), generator=gen).tolist()
    cache = PagedCache(model)
    a = cache.add(a_prompt)
    cache.step([(a, 13)])
    cache.step([(a, 10)])
    b = cache.add(b_prompt, share=a, shared=12)
    a.tokens.append(int(a.logits[-1].argmax()))
    cache.step([(a, 1), (b, 11)])
    for _ in range(decode_steps):
        for seq in (a, b):
            seq.tokens.append(int(seq.logits[-1].argmax()))
        cache.step([(a, 1), (b, 1)])
    return [a, b]


def max_logit_error(hf: Any, seqs: list[Sequence]) -> float:
    """The largest difference between the sequences' logits (every position computed) and the
    transformers model's over the same tokens."""
    worst = 0.0
    for seq in seqs:
        with torch.inference_mode():
            want = hf(torch.tensor([seq.tokens])).logits[0]
        want = want[seq.first : seq.first + len(seq.logits)]
        got = torch.stack(seq.logits)
        worst = max(worst, float((got - want).abs().max()))
    return worst
