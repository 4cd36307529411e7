"""Our Llama-family code against transformers on tiny random models: logits within 1e-4 (fp32),
for a prefill and for decode steps through a paged KV cache with scattered blocks."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.layer import Attention, set_forward_context
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.loader import ModelArchConfig
from pagoda.models.llama import LlamaForCausalLM

BLOCK = 4
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    return {
        "qwen2": transformers.Qwen2Config(**TINY, tie_word_embeddings=False),
        "qwen3": transformers.Qwen3Config(**TINY, head_dim=32, tie_word_embeddings=True),
        "llama3_rope": transformers.LlamaConfig(
            **TINY,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        "mistral": transformers.MistralConfig(**TINY, sliding_window=None),
        # Windows far shorter than the prompt: every layer (Mistral), the layers past
        # max_window_layers (Qwen2).
        "mistral_window": transformers.MistralConfig(**TINY, sliding_window=8),
        "qwen2_window": transformers.Qwen2Config(
            **TINY, use_sliding_window=True, sliding_window=8, max_window_layers=1
        ),
    }


def _build(name: str, **override: object) -> tuple[torch.nn.Module, LlamaForCausalLM]:
    """transformers' model of config ``name`` and ours on its weights (``override``: keys of our
    config set otherwise, for negative controls)."""
    torch.manual_seed(0)
    hf_cfg = _configs()[name]
    hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # random norms, so q/k-norm and layer norms matter
        for n, p in hf.named_parameters():
            if "norm" in n:
                p.uniform_(0.5, 1.5)
    cfg = hf_cfg.to_dict()
    cfg["architectures"] = [type(hf).__name__]
    arch = dataclasses.replace(ModelArchConfig.from_hf_config(cfg), **override)
    ours = LlamaForCausalLM(arch, TorchNativeBackend)
    ours.load_weights(hf.state_dict().items())
    return hf, ours.eval()


class _PagedSequence:
    """One sequence in a paged cache whose blocks are deliberately out of order."""

    def __init__(self, model: LlamaForCausalLM, max_len: int) -> None:
        cfg = model.config
        num_blocks = 2 * max_len // BLOCK + 2
        shape = TorchNativeBackend.get_kv_cache_shape(
            num_blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim
        )
        for m in model.modules():
            if isinstance(m, Attention):
                m.kv_cache = torch.zeros(shape)
        rng = np.random.default_rng(0)
        self.blocks = rng.permutation(np.arange(1, num_blocks))[: max_len // BLOCK + 1]
        self.model = model
        self.len = 0

    def run(self, tokens: list[int]) -> torch.Tensor:
        n, start = len(tokens), self.len
        pos = np.arange(start, start + n)
        slots = self.blocks[pos // BLOCK] * BLOCK + pos % BLOCK
        seq_len = start + n
        common = CommonAttentionMetadata(
            num_reqs=1,
            num_actual_tokens=n,
            max_query_len=n,
            max_seq_len=seq_len,
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
            seq_lens=torch.tensor([seq_len], dtype=torch.int32),
            block_table=torch.from_numpy(self.blocks[None].astype(np.int32)),
            slot_mapping=torch.from_numpy(slots.astype(np.int64)),
            query_start_loc_cpu=np.array([0, n]),
            seq_lens_cpu=np.array([seq_len]),
            block_size=BLOCK,
        )
        with torch.inference_mode(), set_forward_context(TorchNativeBackend.build_metadata(common)):
            hidden = self.model(torch.tensor(tokens), torch.from_numpy(pos))
            logits = self.model.compute_logits(hidden)
        self.len = seq_len
        return logits


@pytest.mark.parametrize(
    "name", ["qwen2", "qwen3", "llama3_rope", "mistral", "mistral_window", "qwen2_window"]
)
def test_prefill_and_decode_logits_match_transformers(name: str) -> None:
    hf, ours = _build(name)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 256, (37,), generator=gen).tolist()
    seq = _PagedSequence(ours, 64)
    # Prefill in two chunks, the second one attending to cached context.
    got = torch.cat([seq.run(prompt[:21]), seq.run(prompt[21:])])
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    tokens = list(prompt)
    for _ in range(4):
        tokens.append(int(got[-1].argmax()))
        got = seq.run(tokens[-1:])
        with torch.inference_mode():
            want = hf(torch.tensor([tokens])).logits[0, -1:]
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mistral_window", "qwen2_window"])
def test_dropping_the_window_changes_the_logits(name: str) -> None:
    """The negative control of the window cases: the same weights attending over the whole
    context are off by far more than the parity tolerance, so the parity test sees the window."""
    hf, ours = _build(name, sliding_window=None, layer_types=None)
    prompt = torch.randint(0, 256, (37,), generator=torch.Generator().manual_seed(1)).tolist()
    got = _PagedSequence(ours, 64).run(prompt)
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    assert (got[:8] - want[:8]).abs().max() < 1e-4  # the window is not reached yet
    assert (got - want).abs().max() > 1e-2


@pytest.mark.parametrize("name", ["qwen3", "llama3_rope"])
def test_residual_added_in_the_projections_epilogue_gives_transformers_logits(
    name: str, residual_added_in_epilogue: list[int]
) -> None:
    """Where a step is large, the output and down projections add into the residual in place
    (``pagoda.ops.linear_add_``, a GPU's path) and the next norm normalises the sum alone: forced
    here on every step, the logits stay transformers', and the embedding table is not written
    (the first layer's residual is the caller's input, never added into)."""
    added = residual_added_in_epilogue
    hf, ours = _build(name)
    table = ours.model.embed_tokens.weight.detach().clone()
    prompt = torch.randint(0, 256, (29,), generator=torch.Generator().manual_seed(2)).tolist()
    seq = _PagedSequence(ours, 48)
    got = torch.cat([seq.run(prompt[:13]), seq.run(prompt[13:])])
    with torch.inference_mode():
        want = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    got = seq.run([int(got[-1].argmax())])
    with torch.inference_mode():
        want = hf(torch.tensor([[*prompt, int(want[-1].argmax())]])).logits[0, -1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # Each layer's output projection but the first's (its residual is the input) and every
    # layer's down projection, in each of the three steps.
    layers = hf.config.num_hidden_layers
    assert len(added) == 3 * (2 * layers - 1)
    assert torch.equal(ours.model.embed_tokens.weight, table)
