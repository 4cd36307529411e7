"""Plugins load in every worker process: a logits processor registered in the engine's process
decides every rank's sampling (rank 0's tokens come back; the others' feed their next steps)."""

from __future__ import annotations

import importlib
import sys
import textwrap

import pytest

from pagoda import LLM, SamplingParams
from pagoda.plugins import plugin_registered

pytestmark = pytest.mark.slow

PLUGIN = """
import torch
from pagoda import hookimpl

PAGODA_PLUGIN_API = 1


def _only_seven(logits, md):
    keep = logits[:, 7].clone()
    logits.fill_(float("-inf"))
    logits[:, 7] = keep
    return logits


@hookimpl
def logits_processors(config, vocab_size, device):
    return [_only_seven]
"""


def test_a_plugin_registered_here_runs_in_every_worker(tiny_models, tmp_path, monkeypatch) -> None:
    (tmp_path / "tp_only_seven.py").write_text(textwrap.dedent(PLUGIN))
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers get this process's sys.path
    plugin = importlib.import_module("tp_only_seven")
    try:
        with plugin_registered(plugin):
            llm = LLM(
                model=str(tiny_models["llama"]),
                tensor_parallel_size=2,
                executor="multiproc",
                dtype="float32",
                max_model_len=128,
                kv_cache_memory_bytes=8 << 20,
            )
            try:
                params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
            finally:
                llm.engine.shutdown()
    finally:
        sys.modules.pop("tp_only_seven", None)
    assert outs[0].outputs[0].token_ids == [7] * 6
