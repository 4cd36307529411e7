"""One core's greedy tokens for the data-parallel tests' prompts, computed once in this process
for the multiprocess and the Ray tests alike."""

from __future__ import annotations

import pytest
import torch
from dpkit import GREEDY, PROMPTS, SETTINGS

from pagoda import LLM


@pytest.fixture(scope="session")
def one_core_tokens() -> list[list[int]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # NOTE: in this process, beside the cores of the other engine
    try:
        llm = LLM(**SETTINGS)
        outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        llm.engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    return [o.outputs[0].token_ids for o in outs]
