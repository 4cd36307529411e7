"""Heads in the layouts EAGLE and EAGLE-3 publish (names and shapes, random values) load and
draft; a head that does not fit the target fails at start with a message naming the mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from eagle_helpers import TINY_LLAMA, tiny_target, write_random_head
from pagoda_spec_eagle.checkpoint import llama_head_config, random_head_weights, write_head
from pagoda_spec_eagle.proposer import Eagle3Proposer, EagleProposer
from safetensors.torch import load_file

from pagoda import LLM
from pagoda.bench.random_weights import ensure_random_weights
from pagoda.config import SpeculativeConfig
from pagoda.testing.spec_decode import make_batch, make_context, proposer_cases

VOCAB = 512  # the conformance kit's


def _proposer(kind: str, path: Path, k: int = 3):
    cls = Eagle3Proposer if kind == "eagle3" else EagleProposer
    ctx = make_context(SpeculativeConfig(method=kind, model=str(path), num_speculative_tokens=k))
    return cls(ctx), ctx


def test_eagle_layout_loads_with_shared_embedding_and_lm_head(tmp_path: Path) -> None:
    head = write_random_head(tmp_path / "h", "eagle", 64, VOCAB)
    names = set(load_file(head / "model.safetensors"))
    assert "fc.weight" in names and "layers.0.self_attn.q_proj.weight" in names
    assert not any(n.startswith("embed_tokens") or n.startswith("lm_head") for n in names)
    proposer, ctx = _proposer("eagle", head)
    proposer.bind_target(tiny_target(ctx))
    assert proposer.head.lm_head is None and proposer.head.embed_tokens is None
    assert proposer.hidden_state_layers == ()  # the target's final hidden state
    batch = make_batch(proposer_cases()[0], ctx)
    drafts = proposer.propose(batch).token_ids
    assert drafts.shape == (1, 3) and (drafts >= 0).all()


def test_eagle3_layout_loads_with_draft_vocabulary_mapping(tmp_path: Path) -> None:
    path = tmp_path / "h3"
    cfg = llama_head_config("eagle3", 64, 128, 4, 2, VOCAB, draft_vocab_size=128)
    d2t = 3 * torch.arange(128)  # draft id d is target id 4 d
    weights = random_head_weights(cfg, 1, d2t, std=0.5)
    assert weights["fc.weight"].shape == (64, 192)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # reads 2H
    assert weights["lm_head.weight"].shape == (128, 64)
    write_head(path, cfg, weights)
    proposer, ctx = _proposer("eagle3", path)
    proposer.bind_target(tiny_target(ctx, num_layers=8))
    assert proposer.hidden_state_layers == (2, 4, 5)  # low, middle, high of 8 layers
    batch = make_batch(proposer_cases()[0], ctx, proposer.hidden_state_layers)
    drafts = proposer.propose(batch).token_ids
    assert (drafts >= 0).all() and (drafts % 4 == 0).all()  # through d2t


def test_eagle3_config_names_its_target_layers(tmp_path: Path) -> None:
    cfg = llama_head_config(
        "eagle3", 64, 128, 4, 2, VOCAB, draft_vocab_size=64, aux_layers=(1, 2, 3)
    )
    write_head(tmp_path / "h", cfg, random_head_weights(cfg))
    proposer, ctx = _proposer("eagle3", tmp_path / "h")
    proposer.bind_target(tiny_target(ctx))
    assert proposer.hidden_state_layers == (1, 2, 3)


def test_pytorch_bin_and_model_prefix_are_read(tmp_path: Path) -> None:
    cfg = llama_head_config("eagle", 64, 128, 4, 2, VOCAB)
    weights = {"model." + k: v for k, v in random_head_weights(cfg).items()}
    (tmp_path / "h").mkdir()
    torch.save(weights, tmp_path / "h" / "pytorch_model.bin")
    (tmp_path / "h" / "config.json").write_text(json.dumps(cfg))
    proposer, ctx = _proposer("eagle", tmp_path / "h")
    proposer.bind_target(tiny_target(ctx))


@pytest.mark.parametrize(
    ("kind", "hidden", "vocab", "message"),
    [
        ("eagle", 32, VOCAB, "hidden size 32, the target model's is 64"),
        ("eagle3", 32, VOCAB, "hidden size 32, the target model's is 64"),
        ("eagle", 64, 1000, "vocab_size 1000, the target model's is 512"),
        ("eagle3", 64, 1000, "vocab_size 1000, the target model's is 512"),
    ],
)
def test_a_head_for_another_target_fails_at_start(
    tmp_path: Path, kind: str, hidden: int, vocab: int, message: str
) -> None:
    head = write_random_head(tmp_path / "h", kind, hidden, vocab, draft_vocab=64)
    with pytest.raises(ValueError, match=message):
        _proposer(kind, head)


def test_wrong_method_missing_folder_and_bad_d2t_are_named(tmp_path: Path) -> None:
    head = write_random_head(tmp_path / "h", "eagle3", 64, VOCAB, draft_vocab=64)
    with pytest.raises(ValueError, match="is an EAGLE-3 head .* use method 'eagle3'"):
        _proposer("eagle", head)
    with pytest.raises(ValueError, match="not a folder with a config.json"):
        _proposer("eagle3", tmp_path / "nowhere")
    ctx = make_context(SpeculativeConfig(method="eagle3", num_speculative_tokens=2))
    with pytest.raises(ValueError, match="needs speculative.model"):
        Eagle3Proposer(ctx)
    cfg = llama_head_config("eagle3", 64, 128, 4, 2, VOCAB, draft_vocab_size=64)
    weights = random_head_weights(cfg, d2t=torch.full((64,), 500))
    write_head(tmp_path / "bad", cfg, weights)
    with pytest.raises(ValueError, match="d2t maps draft ids past the target vocabulary"):
        _proposer("eagle3", tmp_path / "bad")
    weights["lm_head.weight"] = torch.zeros(100, 64)
    weights["d2t"] = torch.zeros(64, dtype=torch.int64)
    write_head(tmp_path / "bad", cfg, weights)
    with pytest.raises(ValueError, match=r"lm_head.weight is \[100, 64\]"):
        _proposer("eagle3", tmp_path / "bad")


def test_an_eagle3_head_needs_as_many_target_layers_as_fc_reads(tmp_path: Path) -> None:
    cfg = llama_head_config("eagle3", 64, 128, 4, 2, VOCAB, draft_vocab_size=64, aux_layers=(1, 2))
    write_head(tmp_path / "h", cfg, random_head_weights(cfg))
    proposer, ctx = _proposer("eagle3", tmp_path / "h")
    with pytest.raises(ValueError, match="fc.weight takes 192 features, not 2 layers of 64"):
        proposer.bind_target(tiny_target(ctx))


def test_a_head_with_tensor_parallelism_is_refused_at_start(tmp_path: Path) -> None:
    """A draft head runs on the first rank only, where the target's sharded layers wait for the
    other ranks: refused before any worker starts, with the reason and what works instead."""
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    head = write_random_head(tmp_path / "h", "eagle3", 64, 1024, draft_vocab=256)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="tensor parallelism does not support yet") as info:
        LLM(model=str(folder), device="cpu", tensor_parallel_size=2, speculative_config=spec)
    assert "parallel.tensor_parallel_size=2" in str(info.value) and "ngram" in str(info.value)
