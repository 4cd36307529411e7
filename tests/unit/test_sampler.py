"""The sampler pipeline: greedy fast path, greedy rows seeing processed logits, logprobs of the
model's own distribution, the logits-processor hook, and unused features building nothing."""

from __future__ import annotations

import numpy as np
import torch
from sampling_helpers import make_batch

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.sampler import Sampler
from pagoda.sampling_params import SamplingParams

V = 64


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_all_greedy_step_is_a_plain_argmax_with_no_tensors_built() -> None:
    ib, rows = make_batch([SamplingParams(temperature=0)] * 3, [[1]] * 3, vocab=V)
    md = ib.sampling_metadata(rows)
    assert md == SamplingMetadata.greedy()
    logits = _logits(3)
    out = Sampler()(logits.clone(), md)
    assert torch.equal(out.sampled, logits.argmax(-1)) and out.logprobs is None


def test_temperature_only_builds_no_tensor_for_unused_features() -> None:
    ib, rows = make_batch([SamplingParams(temperature=0.8)] * 2, [[1]] * 2, vocab=V)
    md = ib.sampling_metadata(rows)
    assert md.temperature is not None and md.uniform is not None
    unused = (md.greedy_mask, md.top_k, md.top_p, md.min_p, md.max_num_logprobs, md.allowed_mask)
    assert all(x is None for x in unused)
    assert md.banned is None and md.logit_bias is None and md.penalties is None


def test_greedy_rows_take_the_argmax_of_processed_logits_in_a_mixed_batch() -> None:
    logits = _logits(3)
    low = int(logits[0].argmin())
    params = [
        SamplingParams(temperature=0, logit_bias={low: 100.0}),
        SamplingParams(temperature=1.0, top_k=1),  # random row that can only pick the argmax
        SamplingParams(temperature=0, allowed_token_ids=[low]),
    ]
    ib, rows = make_batch(params, [[1]] * 3, vocab=V)
    md = ib.sampling_metadata(rows)
    assert not md.all_greedy and not md.all_random
    sampled = Sampler()(logits.clone(), md).sampled
    assert sampled.tolist() == [low, int(logits[1].argmax()), low]


def test_logprobs_are_the_raw_distribution_with_rank_and_top_k() -> None:
    params = [
        SamplingParams(temperature=0.5, logprobs=3, logit_bias={5: 20.0}),
        SamplingParams(temperature=0, logprobs=0, repetition_penalty=1.5),
    ]
    ib, rows = make_batch(params, [[5, 6], [7]], vocab=V)
    logits = _logits(2)
    out = Sampler()(logits.clone(), ib.sampling_metadata(rows))
    raw = logits.log_softmax(-1)
    lp = out.logprobs
    assert lp is not None and lp.token_ids.shape == (2, 4)  # chosen + the largest k of the step
    for i in range(2):
        token = int(out.sampled[i])
        assert lp.token_ids[i, 0] == token
        torch.testing.assert_close(lp.logprobs[i, 0], raw[i, token], rtol=0, atol=1e-6)
        assert lp.ranks[i] == 1 + int((raw[i] > raw[i, token]).sum())
        top = raw[i].topk(3)
        assert torch.equal(lp.token_ids[i, 1:], top.indices)
        torch.testing.assert_close(lp.logprobs[i, 1:], top.values, rtol=0, atol=1e-6)
    assert out.sampled[0] == 5 and lp.ranks[0] > 1  # the bias chose it; the rank is the model's


def test_logits_processors_run_after_builtin_processing_and_before_sampling() -> None:
    seen = {}

    def ban_argmax(logits: torch.Tensor, md: SamplingMetadata) -> torch.Tensor:
        seen["logits"] = logits.clone()
        return logits.scatter(1, logits.argmax(-1, keepdim=True), float("-inf"))

    sampler = Sampler()
    sampler.logits_processors.append(ban_argmax)
    ib, rows = make_batch([SamplingParams(temperature=0, logit_bias={3: 50.0})], [[1]], vocab=V)
    logits = _logits(1)
    sampled = sampler(logits.clone(), ib.sampling_metadata(rows)).sampled
    assert seen["logits"][0, 3] == logits[0, 3] + 50.0  # the bias came first
    second = logits[0].clone()
    second[3] = float("-inf")
    assert int(sampled[0]) == int(second.argmax())  # the processor's ban held


def test_resumed_request_rebuilds_its_penalty_counts_from_its_output() -> None:
    sp = SamplingParams(temperature=0, frequency_penalty=1.0)
    ib, rows = make_batch([sp], [[1]], [[9, 9, 4]], vocab=V)
    logits = torch.zeros(1, V)
    got = Sampler().process_logits(logits, ib.sampling_metadata(rows))
    assert got[0, 9] == -2.0 and got[0, 4] == -1.0 and got[0, 1] == 0.0
    assert np.count_nonzero(got.numpy()) == 2


def test_logits_in_the_models_dtype_sample_as_their_float32_copy() -> None:
    # The model hands over its logits in its own dtype; every step of the sampler that needs
    # float32 converts, so bf16 logits and their exact float32 copy draw and score alike.
    params = [
        SamplingParams(temperature=0, logprobs=2),
        SamplingParams(temperature=0.7, seed=3, logprobs=1),
        SamplingParams(temperature=1.2, seed=4, top_p=0.9, repetition_penalty=1.3),
        SamplingParams(temperature=0.6, seed=5),
    ]
    prompts = [[1, 2], [3], [4, 5, 6], [7]]
    logits = _logits(4, seed=2).bfloat16()
    outs = []
    for x in (logits, logits.float()):
        ib, rows = make_batch(params, prompts, vocab=V)
        outs.append(Sampler()(x.clone(), ib.sampling_metadata(rows)))
    assert torch.equal(outs[0].sampled, outs[1].sampled)
    a, b = outs[0].logprobs, outs[1].logprobs
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.ranks, b.ranks)
    assert a.logprobs.dtype == torch.float32 and torch.equal(a.logprobs, b.logprobs)
    # Temperature alone (the one-kernel draw where it runs) takes bf16 as well.
    temp_only = [SamplingParams(temperature=0.6, seed=s) for s in range(4)]
    drawn = []
    for x in (logits, logits.float()):
        ib, rows = make_batch(temp_only, prompts, vocab=V)
        drawn.append(Sampler()(x.clone(), ib.sampling_metadata(rows)).sampled)
    assert torch.equal(drawn[0], drawn[1])
