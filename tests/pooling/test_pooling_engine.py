"""Pooling on the engine beyond parity: chat and embeddings on one engine, late interaction
(token embeddings and MaxSim), ``AsyncLLM.encode``, and offline bad input refused by name."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from pooling_models import TEXTS, qwen3_config, randomize, save_hf

from pagoda import LLM, SamplingParams
from pagoda.pooling_params import PoolingParams

ENGINE = dict(max_model_len=256, block_size=16, max_num_seqs=8)


@pytest.fixture(scope="module")
def causal_lm(pool_dir):
    from transformers import Qwen3ForCausalLM

    model = randomize(Qwen3ForCausalLM(qwen3_config()), 7)
    return model, save_hf(model, pool_dir / "qwen3_lm", pool_dir / "tok")


def _last_hidden(body, tok, text: str) -> np.ndarray:
    """transformers' final hidden states of ``text``'s tokens (``body``: a bare model)."""
    ids = tok(text, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        h = body(input_ids=ids).last_hidden_state[0]
    return h.numpy()


def test_one_engine_serves_chat_and_embeddings_together(causal_lm) -> None:
    from transformers import AutoTokenizer

    model, folder = causal_lm
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = LLM(model=str(folder), **ENGINE).generate(TEXTS[:3], greedy, use_tqdm=False)

    llm = LLM(model=str(folder), task="embed", max_num_batched_tokens=48, **ENGINE)
    assert llm.engine.info.tasks == ("generate", "embed", "token_embed")
    engine = llm.engine
    for i, text in enumerate(TEXTS[:3]):  # chat and embedding requests in the same steps
        p = engine.input_processor.process(text)
        engine.add_processed(f"g{i}", p.prompt, p.prompt_token_ids, greedy, final_only=True)
        q = engine.input_processor.process_pooling(TEXTS[3 + i])
        engine.add_pooling(f"e{i}", q.prompt, q.prompt_token_ids, PoolingParams(task="embed"))
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            done[out.request_id] = out
    for i in range(3):
        assert done[f"g{i}"].outputs[0].token_ids == alone[i].outputs[0].token_ids
    tok = AutoTokenizer.from_pretrained(str(folder))
    for i in range(3):
        want = _last_hidden(model.model, tok, TEXTS[3 + i])[-1]
        want = want / np.linalg.norm(want)
        assert np.abs(done[f"e{i}"].outputs.data - want).max() < 1e-4


def test_generation_only_engine_refuses_embeddings_and_an_embedder_refuses_generation(
    causal_lm, st_dirs
) -> None:
    llm = LLM(model=str(causal_lm[1]), **ENGINE)
    assert llm.engine.info.tasks == ("generate",)
    with pytest.raises(ValueError, match=r"PoolingParams.task='embed'.*serves generate"):
        llm.embed(["hello"])
    embedder = LLM(model=str(st_dirs("qwen3", "lasttoken", True)), **ENGINE)
    with pytest.raises(ValueError, match="not generation"):
        embedder.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match=r"PoolingParams.task='classify'.*serves embed"):
        embedder.classify(["hello"])
    with pytest.raises(ValueError, match="model.task='classify'"):
        LLM(model=str(causal_lm[1]), task="classify", **ENGINE)


def test_offline_bad_input_is_refused_by_field(st_dirs) -> None:
    llm = LLM(model=str(st_dirs("qwen3", "mean", True)), **ENGINE)
    with pytest.raises(ValueError, match="empty"):
        llm.embed([{"prompt_token_ids": []}])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.embed(["w1 " * 300])
    out = llm.embed(["w1 " * 300], PoolingParams(truncate_prompt_tokens=20))
    assert len(out[0].prompt_token_ids) == 20
    with pytest.raises(ValueError, match="PoolingParams.dimensions=65"):
        llm.embed(["hello"], PoolingParams(dimensions=65))
    full = llm.embed(["w3 " * 256], PoolingParams(truncate_prompt_tokens=-1))
    assert len(full[0].prompt_token_ids) == 256  # a pooling prompt may fill the context
    # Parameters this engine resolved come back as they are (a batch's shared object, resolved
    # once); any other object is checked again, a bad one refused after a good one.
    engine = llm.engine
    resolved = engine.resolve_pooling(PoolingParams())
    assert engine.resolve_pooling(resolved) is resolved and resolved.pooling_type == "MEAN"
    with pytest.raises(ValueError, match="PoolingParams.dimensions=65"):
        engine.resolve_pooling(PoolingParams(dimensions=65))


def test_late_interaction_token_embeddings_and_maxsim(st_dirs, qwen3_dir) -> None:
    from transformers import AutoModel, AutoTokenizer

    llm = LLM(model=str(st_dirs("qwen3", "lasttoken", True)), max_num_batched_tokens=32, **ENGINE)
    outs = llm.encode(TEXTS[:5], pooling_task="token_embed", use_tqdm=False)
    hf = AutoModel.from_pretrained(str(qwen3_dir)).eval()
    tok = AutoTokenizer.from_pretrained(str(qwen3_dir))
    vecs = []
    for text, out in zip(TEXTS[:5], outs):
        h = _last_hidden(hf, tok, text)
        h = h / np.linalg.norm(h, axis=1, keepdims=True)
        assert out.outputs.data.shape == h.shape  # one row per prompt token, chunked or not
        assert np.abs(out.outputs.data - h).max() < 1e-4
        vecs.append(h)
    scores = llm.score(TEXTS[2], TEXTS[:2], PoolingParams(task="token_embed"), use_tqdm=False)
    for doc, s in zip(vecs[:2], scores):
        want = (vecs[2] @ doc.T).max(axis=1).sum()
        assert abs(s.outputs.score - want) < 1e-3


def test_async_llm_encode_streams_one_final_output(st_dirs) -> None:
    from pagoda import AsyncLLM
    from pagoda.config import EngineConfig

    folder = st_dirs("bert", "cls", True)
    engine = AsyncLLM(EngineConfig.load(overrides={"model": str(folder), **ENGINE}))
    try:

        async def run() -> list:
            outs = []
            async for out in engine.encode("hello world", PoolingParams(task="embed")):
                outs.append(out)
            return outs

        outs = asyncio.run(run())
    finally:
        engine.shutdown()
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs.data.shape == (32,)
    want = LLM(model=str(folder), **ENGINE).embed(["hello world"])[0].outputs.embedding
    assert np.abs(outs[0].outputs.data - np.array(want)).max() < 1e-5


def test_one_step_of_differently_finished_embeddings_matches_each_alone(qwen3_dir) -> None:
    # One step holds requests whose embeddings are finished differently (truncated, normalised
    # or not): each group is picked out of the step's rows and finished apart. Picking the
    # wrong rows (or one group's finish for all) changes what a request gets.
    llm = LLM(model=str(qwen3_dir), task="embed", **ENGINE)
    kinds = [PoolingParams(), PoolingParams(dimensions=8), PoolingParams(normalize=False)]
    params = [kinds[i % 3] for i in range(6)]
    mixed = llm.embed(TEXTS[:6], params, use_tqdm=False)
    for i, p in enumerate(params):
        alone = llm.embed([TEXTS[i]], p, use_tqdm=False)[0].outputs.embedding
        got = mixed[i].outputs.embedding
        assert len(got) == len(alone)
        assert np.abs(np.asarray(got) - np.asarray(alone)).max() < 1e-5
    dims = {len(o.outputs.embedding) for o in mixed}
    assert dims == {8, 64}
    norms = [np.linalg.norm(o.outputs.embedding) for o in mixed]
    assert all(abs(norms[i] - 1) < 1e-5 for i in (0, 1, 3, 4))
    assert all(abs(norms[i] - 1) > 1e-3 for i in (2, 5))


def test_a_bad_prompt_late_in_a_batch_fails_it_whole_and_leaves_nothing(qwen3_dir) -> None:
    # Prompts are checked as they are added, a step's worth at a time: a bad one found after
    # steps have run aborts every request added before it; the engine is left as it was.
    llm = LLM(model=str(qwen3_dir), task="embed", max_num_batched_tokens=64, **ENGINE)
    core = llm.engine.engine_core
    good = [{"prompt_token_ids": [5 + i] * 30} for i in range(12)]
    bad = {"prompt_token_ids": [5, 10**9]}
    with pytest.raises(ValueError, match="prompt token ids must be integers"):
        llm.embed([*good, bad], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    assert core.kv_cache_manager.num_free_blocks == core.num_blocks - 1
    again = llm.embed(good[:2], use_tqdm=False)
    assert len(again) == 2


def test_embeddings_become_lists_as_their_requests_finish(qwen3_dir, monkeypatch) -> None:
    # Each embedding is made a list when its request finishes, while later steps still run,
    # not all of them after the last step (the host has nothing else to do then).
    import pagoda.entrypoints.llm as llm_module

    llm = LLM(model=str(qwen3_dir), task="embed", max_num_batched_tokens=64, **ENGINE)
    steps: list[int] = []
    step = llm.engine.step

    def counted_step():
        steps.append(len(steps))
        return step()

    made_at: list[int] = []
    convert = llm_module._embedding_output

    def recorded(out):
        made_at.append(len(steps))
        return convert(out)

    monkeypatch.setattr(llm.engine, "step", counted_step)
    monkeypatch.setattr(llm_module, "_embedding_output", recorded)
    prompts = [{"prompt_token_ids": [5 + i] * 30} for i in range(8)]
    outs = llm.embed(prompts, use_tqdm=False)
    assert len(made_at) == 8 and min(made_at) < len(steps)
    # (in the prompts' order, as encode gives them)
    want = llm.encode(prompts, use_tqdm=False)
    for got, ref in zip(outs, want, strict=True):
        assert isinstance(got.outputs.embedding, list)
        assert np.abs(np.asarray(got.outputs.embedding) - ref.outputs.data).max() < 1e-6
