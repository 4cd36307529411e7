"""On a GPU: the sampler pipeline gives the CPU's results on the same logits (every setting in
one batch), and in batch-invariant mode a seeded request on a random-weight SmolLM2 draws the same
tokens in any batch. (Without the mode a GPU promises no such thing: GEMM and reduction kernels
picked by the batch's size change a token's logits in the last bits, and a near tie can flip.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.ops.batch_invariant import set_batch_invariant
from pagoda.sample.sampler import Sampler

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))
from sampling_helpers import make_batch  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

V = 1000
CONFIG = Path(__file__).parents[2] / "benchmarks" / "configs" / "smollm2-135m" / "config.json"

PARAMS = [
    SamplingParams(temperature=0, logprobs=3, logit_bias={5: 3.0}, repetition_penalty=1.3),
    SamplingParams(temperature=0.8, top_p=0.9, seed=1, allowed_token_ids=list(range(0, V, 3))),
    SamplingParams(temperature=1.2, top_k=20, min_p=0.05, seed=2, presence_penalty=0.5),
    SamplingParams(temperature=1.0, seed=3, frequency_penalty=1.0, bad_words_token_ids=[[4, 7]]),
    SamplingParams(temperature=0.7, top_k=400, top_p=0.95, seed=4, logprobs=1),
    SamplingParams(min_tokens=4, stop_token_ids=[9], temperature=0.5, seed=5),
]
PROMPTS = [[1, 2, 3], [4, 4, 8], [9], [10, 11], [12], [13, 14]]
OUTPUTS = [[5, 6], [7], [], [4], [3, 3, 3], [9]]


def test_every_setting_gives_the_cpus_tokens_and_logprobs_on_cuda() -> None:
    logits = torch.randn(len(PARAMS), V, generator=torch.Generator().manual_seed(0)) * 3
    results = {}
    for device in ("cpu", "cuda"):
        ib, rows = make_batch(PARAMS, PROMPTS, OUTPUTS, vocab=V, device=device)
        tokens, lps = [], []
        for step in range(4):
            md = ib.sampling_metadata(rows)
            out = Sampler()(logits.roll(step, dims=1).to(device), md)
            ib.append_sampled(rows, out.sampled)
            tokens.append(out.sampled.cpu())
            lps.append(out.logprobs.logprobs.cpu())
        results[device] = torch.stack(tokens), torch.stack(lps)
    assert torch.equal(results["cpu"][0], results["cuda"][0])
    torch.testing.assert_close(results["cpu"][1], results["cuda"][1], rtol=0, atol=1e-5)


def test_seeded_request_on_cuda_draws_the_same_tokens_in_any_batch(tmp_path: Path) -> None:
    """With ``model.batch_invariant`` on; the mode is what makes this hold."""
    cfg = json.loads(CONFIG.read_text())
    cfg["num_hidden_layers"] = 4
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(
        model=str(tmp_path),
        load_format="dummy",
        max_model_len=256,
        batch_invariant=True,
        kv_cache_memory_bytes=256 << 20,  # not most of the GPU: later tests build engines too
    )
    try:
        target = SamplingParams(
            max_tokens=12, temperature=1.0, top_p=0.95, seed=7, logprobs=2, ignore_eos=True
        )
        prompt = {"prompt_token_ids": list(range(100, 140))}
        alone = llm.generate(prompt, target)[0].outputs[0]
        others = [{"prompt_token_ids": list(range(200 + i, 230 + 3 * i))} for i in range(5)]
        mixed = llm.generate(
            [*others[:3], prompt, *others[3:]],
            [SamplingParams(max_tokens=6, temperature=1.0)] * 3 + [target] + [SamplingParams()] * 2,
        )[3].outputs[0]
        assert mixed.token_ids == alone.token_ids and len(mixed.logprobs) == 12
        n4 = SamplingParams(
            n=4, max_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True
        )
        first = llm.generate(prompt, n4)[0].outputs[0]
        assert first.token_ids == alone.token_ids
    finally:
        llm.engine.shutdown()
        set_batch_invariant(False)  # process-wide: the next tests run without it
