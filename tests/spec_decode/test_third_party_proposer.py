"""A third-party proposer from an empty folder: a module with a hook implementation, registered
as a plugin and selected by ``speculative.method`` as any user would; its drafts (with their own
probabilities) are verified by the core, so greedy output stays the same, seeded sampling
reproduces itself, and the conformance kit holds for it. An unknown method fails at start with
the list of the installed ones."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from pagoda import LLM, SamplingParams
from pagoda.config import SpeculativeConfig
from pagoda.testing import check_proposer_case, plugin_registered, proposer_cases

TOY = '''
"""Proposes the last token again, k times, with q = 0.7 on it and the rest spread evenly."""
import numpy as np
import torch

from pagoda import hookimpl
from pagoda.spec_decode import Drafts, SpeculativeProposer

PAGODA_PLUGIN_API = 1


class RepeatLastProposer(SpeculativeProposer):
    def propose(self, batch):
        k = self.ctx.num_speculative_tokens
        last = batch.token_ids[batch.rows, batch.num_tokens - 1]
        ids = np.repeat(last[:, None], k, axis=1).astype(np.int64)
        vocab = self.ctx.vocab_size
        probs = torch.full((len(batch), k, vocab), 0.3 / vocab, device=self.ctx.device)
        idx = torch.as_tensor(ids, device=self.ctx.device).unsqueeze(2)
        probs.scatter_add_(2, idx, torch.full(idx.shape, 0.7, device=self.ctx.device))
        return Drafts(ids, probs)


@hookimpl
def register_spec_proposers(register):
    register("repeat_last", RepeatLastProposer)
'''

ENGINE = {"max_model_len": 256, "kv_cache_memory_bytes": 32 << 20}
PROMPTS = ["The the the the the the", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def toy_plugin(tmp_path_factory):
    folder = tmp_path_factory.mktemp("toy_proposer")
    (folder / "toy_repeat_proposer.py").write_text(textwrap.dedent(TOY))
    sys.path.insert(0, str(folder))
    try:
        module = importlib.import_module("toy_repeat_proposer")
        with plugin_registered(module):
            yield module
    finally:
        sys.path.remove(str(folder))


def _tokens(llm: LLM, params: SamplingParams) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def test_toy_proposer_passes_the_conformance_kit(toy_plugin):
    config = SpeculativeConfig(method="repeat_last", num_speculative_tokens=3)
    for case in proposer_cases():
        check_proposer_case(toy_plugin.RepeatLastProposer, config, case)


def test_toy_proposer_selected_by_config_keeps_greedy_output(toy_plugin):
    greedy = SamplingParams(max_tokens=12, temperature=0.0)
    want = _tokens(LLM(**ENGINE), greedy)
    spec = {"method": "repeat_last", "num_speculative_tokens": 3}
    llm = LLM(**ENGINE, speculative_config=spec)
    assert _tokens(llm, greedy) == want
    stats = llm.engine.engine_core.scheduler.spec_stats_total
    assert stats.num_drafts > 0 and 0 < stats.num_accepted_tokens < stats.num_draft_tokens

    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=7)
    first = _tokens(llm, seeded)
    assert _tokens(llm, seeded) == first  # a seeded request draws the same with drafts too


def test_unknown_method_fails_at_start_listing_the_installed_ones(toy_plugin):
    with pytest.raises(Exception, match="ngram") as info:
        LLM(**ENGINE, speculative_config={"method": "no_such", "num_speculative_tokens": 2})
    assert "repeat_last" in str(info.value) and "no_such" in str(info.value)
