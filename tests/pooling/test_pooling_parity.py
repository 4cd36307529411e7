"""Embeddings, scores and classifications from Pagoda match sentence-transformers' ``encode``
and transformers' heads on tiny random BERT and Qwen3 models (CPU, float32): with every
pooling, with and without normalisation, with prompts split over chunked-prefill steps, and with
prefix-cache hits."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pooling_models import TEXTS, bert_config, qwen3_config, randomize, save_hf

from pagoda import LLM
from pagoda.pooling_params import PoolingParams

TOL = 1e-4
ENGINE = dict(max_model_len=256, block_size=16, max_num_seqs=8)


def _st_encode(folder, texts):
    from sentence_transformers import SentenceTransformer

    st = SentenceTransformer(str(folder), device="cpu")
    return st.encode(texts, convert_to_numpy=True, batch_size=len(texts))


def _check(got: np.ndarray, ref: np.ndarray) -> None:
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() < TOL
    cos = (got * ref).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(ref, axis=1))
    assert cos.min() >= 0.99999


def _embed(llm: LLM, texts, params=None) -> np.ndarray:
    return np.array([o.outputs.embedding for o in llm.embed(texts, params, use_tqdm=False)])


@pytest.mark.parametrize(
    "body,pooling,normalize",
    [
        ("bert", "cls", True),
        ("bert", "mean", False),
        ("bert", "lasttoken", True),
        ("qwen3", "lasttoken", True),
        ("qwen3", "mean", True),
        ("qwen3", "cls", False),
    ],
)
def test_embeddings_match_sentence_transformers(st_dirs, body, pooling, normalize) -> None:
    folder = st_dirs(body, pooling, normalize)
    llm = LLM(model=str(folder), **ENGINE)
    assert llm.engine.info.pooler.normalize is normalize
    _check(_embed(llm, TEXTS), _st_encode(folder, TEXTS))


@pytest.mark.parametrize(
    "body,pooling", [("qwen3", "lasttoken"), ("bert", "cls"), ("bert", "lasttoken")]
)
def test_steps_of_one_pooled_row_a_request_run_the_last_layer_for_those_rows(
    st_dirs, body, pooling
) -> None:
    """A step whose every request pools one row and ends its prompt there (its last token;
    an encoder's first or last) runs the last layer for those rows alone (``keeps_rows``):
    their queries attend as a step of one query a request over the cached keys (every row's
    keys and values written first), and only they go on past attention; the embeddings stay
    sentence-transformers'."""
    from pagoda.attention.layer import Attention

    folder = st_dirs(body, pooling, True)
    llm = LLM(model=str(folder), **ENGINE)
    model = llm.engine.engine_core.executor.worker.model_runner.model
    kept: list[int | None] = []
    forward = model.forward

    def spy(*args, keep=None, **kwargs):
        kept.append(None if keep is None else len(keep))
        return forward(*args, keep=keep, **kwargs)

    model.forward = spy
    # Queries each layer's attention computed in each step, and the keys its cache held after.
    layers = [m for m in model.modules() if isinstance(m, Attention)]
    attended: dict[int, list[tuple[int, int]]] = {0: [], len(layers) - 1: []}
    for i in attended:
        attn = layers[i]
        impl_forward = attn.impl.forward

        def impl_spy(q, k, v, cache, md, _i=i, _f=impl_forward, _attn=attn):
            out = _f(q, k, v, cache, md)
            attended[_i].append((q.shape[0], int((_attn.kv_cache[0] != 0).any(-1).any(-1).sum())))
            return out

        attn.impl.forward = impl_spy
    _check(_embed(llm, TEXTS), _st_encode(folder, TEXTS))
    assert sum(n or 0 for n in kept) == len(TEXTS), kept  # every prompt's kept row, once
    first, last = attended[0], attended[len(layers) - 1]
    assert sum(q for q, _ in last) == len(TEXTS), last  # the last layer: one query a prompt
    assert sum(q for q, _ in first) > 2 * len(TEXTS), first  # the first: every token
    # ...over keys of every token in the last layer's cache (slots holding a nonzero key). The
    # first layer's: no later step reads these prompts' keys, and the CPU's backend attends
    # over a causal step's own (``attends_from_inputs``), so it stores none of them; a
    # bidirectional layer it runs over the cache, so the encoders' store them.
    assert all(slots >= q for (q, _), (_, slots) in zip(first, last)), (first, last)
    stored = [slots for _, slots in first]
    assert stored == ([0] * len(first) if body == "qwen3" else [slots for _, slots in last])


@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls"])
def test_chunked_prefill_splits_prompts_and_keeps_embeddings(st_dirs, pooling) -> None:
    """A 32-token budget splits the 72-token prompt over three steps (and others beside it):
    mean and CLS pooling keep their chunks' hidden states across the steps."""
    folder = st_dirs("qwen3", pooling, True)
    llm = LLM(model=str(folder), max_num_batched_tokens=32, **ENGINE)
    assert llm.engine.engine_core.scheduler.enable_chunked_prefill
    _check(_embed(llm, TEXTS), _st_encode(folder, TEXTS))


def test_last_token_pooling_takes_prefix_cache_hits_and_mean_pooling_does_not(st_dirs) -> None:
    last = st_dirs("qwen3", "lasttoken", True)
    long_text = TEXTS[4]
    llm = LLM(model=str(last), **ENGINE)
    # (the first sighting of a prompt's first block leaves nothing cached, the second caches
    # it: ``KVCacheManager.admits_pooled_prompt``)
    outs = [llm.encode([long_text], use_tqdm=False)[0] for _ in range(3)]
    assert [o.num_cached_tokens for o in outs[:2]] == [0, 0]
    assert outs[2].num_cached_tokens >= 64  # four full blocks
    ref = _st_encode(last, [long_text])
    _check(np.stack([o.outputs.data for o in outs]), np.concatenate([ref] * 3))

    mean = st_dirs("qwen3", "mean", True)
    llm = LLM(model=str(mean), **ENGINE)
    outs = [llm.encode([long_text], use_tqdm=False)[0] for _ in range(3)]
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # it needs every token's state
    ref = _st_encode(mean, [long_text])
    _check(np.stack([o.outputs.data for o in outs]), np.concatenate([ref] * 3))


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_new_prompts_store_only_the_keys_a_step_reads(st_dirs, monkeypatch, pooling) -> None:
    """A step of new pooling prompts whose blocks the prefix cache does not keep (the first
    sighting of each prompt's first block) stores keys and values only where its own attention
    reads them from the cache: the last layer's kept rows (last-token pooling) attend through
    it, the other layers over the step's own. The embeddings stay sentence-transformers'. A
    prompt seen again stores every layer's (it is cached); so does every prompt with the skip
    off (``SKIP_UNREAD_KV``)."""
    from pagoda.attention.layer import Attention
    from pagoda.scheduler import scheduler as sched_mod

    folder = st_dirs("qwen3", pooling, True)
    ref = _st_encode(folder, TEXTS)

    def run(skip: bool, texts: list[str]) -> list[int]:
        monkeypatch.setattr(sched_mod, "SKIP_UNREAD_KV", skip)
        llm = LLM(model=str(folder), **ENGINE)
        model = llm.engine.engine_core.executor.worker.model_runner.model
        layers = [m for m in model.modules() if isinstance(m, Attention)]
        _check(_embed(llm, texts), ref[[TEXTS.index(t) for t in texts]])  # (one step)
        # slots holding a nonzero key, per layer
        return [int((a.kv_cache[0] != 0).any(-1).any(-1).sum()) for a in layers]

    tokens = sum(len(t.split()) for t in TEXTS)  # (at least a token a word)
    stored = run(True, TEXTS)
    kept = pooling == "lasttoken"
    assert stored[:-1] == [0] * (len(stored) - 1)
    assert (stored[-1] >= tokens) if kept else (stored[-1] == 0), stored
    assert min(run(False, TEXTS)) >= tokens  # every layer, every token
    again = run(True, [TEXTS[4], TEXTS[4]])  # (the second sighting: stored and cached)
    assert min(again) >= len(TEXTS[4].split()), again


def test_encoder_runs_prompts_whole_without_prefix_cache(st_dirs) -> None:
    folder = str(st_dirs("bert", "cls", True))
    llm = LLM(model=folder, **ENGINE)
    core = llm.engine.engine_core
    assert llm.engine.info.bidirectional
    assert not core.scheduler.enable_chunked_prefill and not core.kv_cache_manager.enable_caching
    assert core.scheduler.max_num_batched_tokens >= 256  # a whole prompt fits one step
    with pytest.raises(ValueError, match="bidirectional encoder"):
        LLM(model=folder, max_num_batched_tokens=32, **ENGINE)


def test_dimensions_truncate_then_normalise(st_dirs) -> None:
    folder = st_dirs("bert", "mean", True)
    llm = LLM(model=str(folder), **ENGINE)
    got = _embed(llm, TEXTS[:3], PoolingParams(dimensions=8))
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(folder), device="cpu", truncate_dim=8)
    want = ref.encode(TEXTS[:3], convert_to_numpy=True)
    # sentence-transformers truncates after its Normalize: normalise again to compare.
    want = want / np.linalg.norm(want, axis=1, keepdims=True)
    _check(got, want)
    raw = _embed(llm, TEXTS[:3], PoolingParams(normalize=False))
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0)


def _hf_classifier(cls_name: str, pool_dir, name: str, **config):
    import transformers

    cfg = (bert_config if "Bert" in cls_name else qwen3_config)(**config)
    model = randomize(getattr(transformers, cls_name)(cfg), 3)
    folder = save_hf(model, pool_dir / name, pool_dir / "tok")
    return model, folder


def test_cross_encoder_scores_match_transformers(pool_dir) -> None:
    from transformers import BertTokenizerFast

    hf, folder = _hf_classifier("BertForSequenceClassification", pool_dir, "ce", num_labels=1)
    llm = LLM(model=str(folder), **ENGINE)
    assert llm.engine.info.tasks == ("classify", "score")
    query, docs = "what is the capital of france", TEXTS
    got = [o.outputs.score for o in llm.score(query, docs, use_tqdm=False)]
    tok = BertTokenizerFast.from_pretrained(str(folder))
    batch = tok([query] * len(docs), docs, padding=True, return_tensors="pt")
    with torch.no_grad():
        want = torch.sigmoid(hf(**batch).logits[:, 0]).numpy()
    assert np.abs(np.array(got) - want).max() < TOL
    raw = llm.score(query, docs[:2], PoolingParams(activation=False), use_tqdm=False)
    with torch.no_grad():
        logits = hf(**tok([query] * 2, docs[:2], padding=True, return_tensors="pt")).logits
    assert np.abs(np.array([o.outputs.score for o in raw]) - logits[:, 0].numpy()).max() < TOL


@pytest.mark.parametrize(
    "cls_name", ["BertForSequenceClassification", "Qwen3ForSequenceClassification"]
)
def test_classification_logits_and_probs_match_transformers(pool_dir, cls_name) -> None:
    from transformers import BertTokenizerFast

    hf, folder = _hf_classifier(cls_name, pool_dir, f"cls_{cls_name}", num_labels=3)
    llm = LLM(model=str(folder), **ENGINE)
    assert llm.engine.info.tasks == ("classify",)
    tok = BertTokenizerFast.from_pretrained(str(folder))
    with torch.no_grad():
        logits = torch.cat([hf(**tok([t], return_tensors="pt")).logits for t in TEXTS])
    got = llm.classify(TEXTS, PoolingParams(activation=False), use_tqdm=False)
    assert np.abs(np.array([o.outputs.probs for o in got]) - logits.numpy()).max() < TOL
    probs = np.array([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    assert np.abs(probs - logits.softmax(-1).numpy()).max() < TOL


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_residual_added_in_the_projections_epilogue_keeps_the_embeddings(
    st_dirs, pooling, residual_added_in_epilogue: list[int]
) -> None:
    """The residual added into in place by the output and down projections (a large step's path
    on a GPU, ``pagoda.ops.linear_add_``), forced on every step here: through the last layer's
    kept rows (last-token pooling) and through the final norm of every row (mean), the
    embeddings stay sentence-transformers'."""
    added = residual_added_in_epilogue
    folder = st_dirs("qwen3", pooling, True)
    llm = LLM(model=str(folder), **ENGINE)
    _check(_embed(llm, TEXTS), _st_encode(folder, TEXTS))
    assert added
