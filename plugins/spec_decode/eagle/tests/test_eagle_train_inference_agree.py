"""What the training module computes is what the served head computes: a head trained by
``pagoda-train-eagle3`` (here, random values through the same export) drafts at inference the
token its training forward predicts at every position (same norms, rotary convention,
concatenation order, fc, draft vocabulary mapping)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from eagle_helpers import tiny_target
from pagoda_spec_eagle.checkpoint import llama_head_config, write_head
from pagoda_spec_eagle.proposer import Eagle3Proposer
from pagoda_spec_eagle.train import TrainHead

from pagoda.config import SpeculativeConfig
from pagoda.models.layers import RotaryEmbedding
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context

H, VOCAB, DV, HD = 64, 512, 128, 16


def test_served_head_drafts_what_the_training_forward_predicts(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head = TrainHead(H, 2 * H, 4, 2, HD, DV, 1e-5)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    d2t = 3 * torch.arange(DV)  # draft id d is target id 4 d
    cfg = llama_head_config(
        "eagle3", H, 2 * H, 4, 2, VOCAB, head_dim=HD, draft_vocab_size=DV, rms_norm_eps=1e-5
    )
    write_head(tmp_path / "head", cfg, head.export(d2t, VOCAB))
    spec = SpeculativeConfig(
        method="eagle3", model=str(tmp_path / "head"), num_speculative_tokens=1
    )
    ctx = make_context(spec)
    proposer = Eagle3Proposer(ctx)
    target = tiny_target(ctx)
    proposer.bind_target(target)

    # The training forward's step 0 over one sequence: position p reads token p + 1.
    t = 24
    tokens = torch.randint(0, VOCAB, (t + 1,))
    aux = torch.randn(t, 3 * H)
    emb = target.model.model.embed_tokens.weight.detach()
    rope = RotaryEmbedding(HD, 8, 10000.0)
    inv_freq = torch.atan2(rope.sin[1], rope.cos[1])
    with torch.no_grad():
        hidden = head.fc(aux)[None]
        q, k, v = head.qkv(
            F.embedding(tokens[1:], emb)[None], hidden, torch.arange(t)[None], inv_freq
        )
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=HD**-0.5)
        _, normed = head.finish(attn, hidden)
        want = (torch.arange(DV) + d2t)[head.lm_head(normed)[0].argmax(-1)]

    # Served: requests whose histories end at several positions, each caught up from scratch.
    ends = [3, 7, 10, 14, 17, 20, 22, 23]
    token_ids = np.full((ctx.max_num_reqs, 300), -1, dtype=np.int64)
    for row, p in enumerate(ends):
        token_ids[row, : p + 2] = tokens[: p + 2].numpy()
    m = np.asarray([p + 1 for p in ends], dtype=np.int64)
    loc = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum(m, out=loc[1:])
    batch = ProposalBatch(
        req_ids=[f"r{p}" for p in ends],
        rows=np.arange(len(ends), dtype=np.int64),
        token_ids=token_ids,
        num_tokens=m + 1,
        num_prompt_tokens=m,
        max_num_drafts=np.ones(len(ends), dtype=np.int64),
        new_hidden_states=torch.cat([aux[: p + 1] for p in ends]),
        hidden_loc=loc,
    )
    drafts = proposer.propose(batch).token_ids[:, 0]
    assert drafts.tolist() == want[ends].tolist()
