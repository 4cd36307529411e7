"""Every draft of the served chain is what the training-time test predicts for it: a head
exported by the training module, drafting k = 4 tokens a request (the first call catching up on
whole prompts eagerly, the second on a few new positions through the fixed-shape chain), gives
at each step the token the training forward (``ttt_forward``) predicts when fed the same
context and the chain's own earlier drafts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from eagle_helpers import tiny_target
from pagoda_spec_eagle.checkpoint import llama_head_config, write_head
from pagoda_spec_eagle.proposer import Eagle3Proposer
from pagoda_spec_eagle.train import TrainHead, ttt_forward

from pagoda.config import SpeculativeConfig
from pagoda.models.layers import RotaryEmbedding
from pagoda.spec_decode import ProposalBatch
from pagoda.testing.spec_decode import make_context

H, VOCAB, DV, HD, K = 64, 512, 128, 16, 4


def _batch(ctx, tokens, aux, starts, ends) -> ProposalBatch:
    """Requests that computed positions ``starts[i]..ends[i]`` since they last sampled and now
    know tokens ``0..ends[i] + 1``."""
    token_ids = np.full((ctx.max_num_reqs, 300), -1, dtype=np.int64)
    for row, p in enumerate(ends):
        token_ids[row, : p + 2] = tokens[: p + 2].numpy()
    m = np.asarray([e + 1 - s for s, e in zip(starts, ends)], dtype=np.int64)
    loc = np.zeros(len(ends) + 1, dtype=np.int64)
    np.cumsum(m, out=loc[1:])
    n = len(ends)
    return ProposalBatch(
        req_ids=[f"r{i}" for i in range(n)],
        rows=np.arange(n, dtype=np.int64),
        token_ids=token_ids,
        num_tokens=np.asarray(ends, dtype=np.int64) + 2,
        num_prompt_tokens=np.asarray(ends, dtype=np.int64) + 1,
        max_num_drafts=np.full(n, K, dtype=np.int64),
        new_hidden_states=torch.cat([aux[s : e + 1] for s, e in zip(starts, ends)]),
        hidden_loc=loc,
    )


def test_chain_drafts_are_the_training_forwards_predictions(tmp_path: Path) -> None:
    torch.manual_seed(0)
    head = TrainHead(H, 2 * H, 4, 2, HD, DV, 1e-5)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
    d2t = 3 * torch.arange(DV)
    cfg = llama_head_config(
        "eagle3", H, 2 * H, 4, 2, VOCAB, head_dim=HD, draft_vocab_size=DV, rms_norm_eps=1e-5
    )
    write_head(tmp_path / "head", cfg, head.export(d2t, VOCAB))
    spec = SpeculativeConfig(
        method="eagle3", model=str(tmp_path / "head"), num_speculative_tokens=K
    )
    ctx = make_context(spec, max_num_reqs=4)
    proposer = Eagle3Proposer(ctx)
    target = tiny_target(ctx)
    proposer.bind_target(target)
    assert proposer.chain is not None  # the fixed-shape chain drafts the second call

    t = 40
    tokens = torch.randint(0, VOCAB, (t + 1,))
    aux = torch.randn(t, 3 * H)
    emb = target.model.model.embed_tokens.weight.detach()
    rope = RotaryEmbedding(HD, 8, 10000.0)
    inv_freq = torch.atan2(rope.sin[1], rope.cos[1])

    def trained_drafts(p: int, drafts: np.ndarray) -> list[int]:
        """The training forward's predictions at anchor ``p``, steps 0..K - 1, fed the
        chain's own drafts as the tokens after ``p + 1``."""
        toks = torch.cat([tokens[: p + 2], torch.from_numpy(drafts[: K - 1])])[None]
        valid = torch.ones(1, p + 1, dtype=torch.bool)
        out = []
        with torch.no_grad():
            for _, normed in ttt_forward(
                head, toks, aux[None, : p + 1], valid, lambda x: F.embedding(x, emb), inv_freq, K
            ):
                d = int(head.lm_head(normed[0, p]).argmax())
                out.append(d + int(d2t[d]))
        return out

    first_ends = [5, 11, 17, 23]
    drafts = proposer.propose(_batch(ctx, tokens, aux, [0] * 4, first_ends)).token_ids
    for i, p in enumerate(first_ends):
        assert drafts[i].tolist() == trained_drafts(p, drafts[i]), f"catch-up to {p}"
    # The second call: 1 to 4 new positions each (the last known token and accepted drafts).
    ends = [p + a for p, a in zip(first_ends, [1, 2, 3, 4])]
    before = proposer.chain.runs
    starts = [p + 1 for p in first_ends]
    drafts = proposer.propose(_batch(ctx, tokens, aux, starts, ends)).token_ids
    assert proposer.chain.runs == before + 1
    for i, p in enumerate(ends):
        assert drafts[i].tolist() == trained_drafts(p, drafts[i]), f"chain at {p}"
