"""The training command on a tiny random Llama, on the CPU: it generates with Pagoda, records
the target's hidden states, trains an EAGLE-3 head with the training-time test, writes it in
the public layout, and reports a held-out acceptance; serving with that head keeps greedy
output token for token while drafts are accepted."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from eagle_helpers import TINY_LLAMA
from pagoda_spec_eagle.record import corpus
from pagoda_spec_eagle.train import main
from safetensors.torch import load_file

from pagoda import LLM, SamplingParams
from pagoda.bench.random_weights import ensure_random_weights


def test_train_command_writes_a_head_that_drafts_and_keeps_greedy_output(
    tmp_path: Path, capsys
) -> None:
    folder, _ = ensure_random_weights(TINY_LLAMA, 0, torch.device("cpu"))
    head = tmp_path / "head"
    argv = ["--model", str(folder), "--out", str(head), "--num-prompts", "12"]
    argv += ["--heldout-prompts", "3", "--max-tokens", "24", "--epochs", "6"]
    argv += ["--tokens-per-batch", "1024", "--draft-vocab", "256", "--device", "cpu"]
    argv += ["--max-model-len", "256", "--json", str(tmp_path / "report.json")]
    assert main(argv) == 0
    printed = capsys.readouterr()
    assert "held-out (3 prompts, k=4): mean acceptance length" in printed.out
    assert "training EAGLE-3 head" in printed.err  # the progress bar
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["train_generated_tokens"] == 12 * 24
    # The tiny random model's continuations are easy to predict: most drafts are accepted.
    assert report["heldout"]["mean_acceptance_length"] > 2.0

    cfg = json.loads((head / "config.json").read_text())
    assert cfg["draft_vocab_size"] == 256 and cfg["hidden_size"] == 64
    weights = load_file(head / "model.safetensors")
    assert weights["fc.weight"].shape == (64, 192)
    assert weights["midlayer.self_attn.q_proj.weight"].shape == (64, 128)
    assert weights["lm_head.weight"].shape == (256, 64)
    assert weights["d2t"].shape == (256,) and weights["t2d"].sum() == 256

    engine = {"model": str(folder), "device": "cpu", "max_model_len": 256}
    base = LLM(**engine)
    prompts = [
        {"prompt_token_ids": base.get_tokenizer().encode(m)}
        for m in corpus(3, heldout=True, skip=3)
    ]
    prompts += [{"prompt_token_ids": list(range(40, 90))}]
    params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params, use_tqdm=False)]
    # NOTE: no governor: its choices follow wall-clock rates, and with drafting off the head is
    # not asked, so the two engines' draft sequences would depend on the machine's timing.
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "adaptive": False}
    runs = {}
    for behind in (True, False):  # drafts on the device right after verification, or later
        llm = LLM(**engine, speculative_config=spec)
        proposer = llm.engine.engine_core.executor.worker.model_runner.proposer
        proposer.draft_behind = behind
        drafts = _spy(proposer)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        stats = llm.engine.engine_core.scheduler.spec_stats_total
        assert stats.num_accepted_tokens > 0
        runs[behind] = (drafts, stats.num_accepted_tokens, proposer.num_drafted_behind)
    # The same drafts either way; behind the step, most drafts after a verification came
    # from the device without a draft of the proposer's own.
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][2] > 10 and runs[False][2] == 0


def _spy(proposer) -> list[tuple[str, int, list[int]]]:
    """Record the proposer's drafts by request and length."""
    drafts = []
    propose = proposer.propose

    def spy(batch):
        out = propose(batch)
        for i, req_id in enumerate(batch.req_ids):
            drafts.append((req_id, int(batch.num_tokens[i]), out.token_ids[i].tolist()))
        return out

    proposer.propose = spy
    return drafts
