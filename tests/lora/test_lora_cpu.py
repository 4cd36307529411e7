"""LoRA on the CPU: a mixed batch of base-model requests and two adapters gives transformers'
tokens and logprobs on the adapters' merged weights; the model's logits on a mixed flat batch
(SGMV segments, then BGMV decode rows) are within 1e-4 of transformers'; the prefix cache never
shares blocks across adapters; the slots' LRU and the scheduler's limit; bad adapters are
refused in one line and nothing else fails."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kv_cache import hashing
from pagoda.lora_request import LoRARequest

PROMPTS = [
    [1, 17, 301, 45, 12, 99, 230, 7, 88, 5, 61],
    [1, 400, 3, 3, 250, 19, 77],
    [1, 9, 9, 120, 33, 410, 270, 18, 42],
    [1, 60, 200, 311, 4],
]
MAX_TOKENS = 6


def _hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and the logprobs of every step [n, vocab]."""
    ids = list(prompt)
    rows = []
    with torch.inference_mode():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits[0, -1]
            rows.append(logits.log_softmax(-1))
            ids.append(int(logits.argmax()))
    return ids[len(prompt) :], torch.stack(rows)


@pytest.fixture(scope="module")
def adapters(lora_model) -> dict[str, LoRARequest]:
    paths = lora_model["paths"]
    return {
        "lora-a": LoRARequest("lora-a", 1, str(paths["lora-a"])),
        "lora-b": LoRARequest("lora-b", 2, str(paths["lora-b"])),
    }


@pytest.fixture(scope="module")
def llm(lora_model) -> LLM:
    return LLM(
        model=str(lora_model["base"]), enable_lora=True, max_loras=2, max_lora_rank=16,
        max_model_len=256, dtype="float32", kv_cache_memory_bytes=8 << 20,
    )  # fmt: skip


def _check(outs, lora_model, which) -> None:
    for out, prompt, name in zip(outs, PROMPTS, which):
        want, lps = _hf_greedy(lora_model["hf"][name], prompt, MAX_TOKENS)
        got = out.outputs[0]
        assert got.token_ids == want, name
        for step, pos in enumerate(got.logprobs):
            for tok, lp in pos.items():
                assert abs(lp.logprob - float(lps[step, tok])) < 1e-4, (name, step, tok)


def test_mixed_batch_of_base_and_two_adapters_gives_transformers_merged_tokens(
    llm, lora_model, adapters
) -> None:
    which = [None, "lora-a", "lora-b", "lora-a"]
    sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=5, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in PROMPTS], sp,
        lora_request=[None if w is None else adapters[w] for w in which], use_tqdm=False,
    )  # fmt: skip
    _check(outs, lora_model, which)
    # The adapters change the output (else the comparison above proves little).
    base = _hf_greedy(lora_model["hf"][None], PROMPTS[1], MAX_TOKENS)[0]
    assert outs[1].outputs[0].token_ids != base


def test_model_logits_of_a_mixed_flat_batch_match_transformers(lora_model, adapters) -> None:
    """The model alone: one flat batch of three prompts (base, lora-a, lora-b) through the
    SGMV reference, then one decode token each through the BGMV reference: every logit within
    1e-4 of transformers' on the merged weights."""
    from pagoda.attention.backend import CommonAttentionMetadata
    from pagoda.attention.layer import Attention, set_forward_context
    from pagoda.attention.torch_native import TorchNativeBackend
    from pagoda.loader import ModelArchConfig, iter_safetensors
    from pagoda.lora.layers import LoRAContext, wrap_model
    from pagoda.lora.slots import AdapterSlots
    from pagoda.models.llama import LlamaForCausalLM
    from pagoda.ops.lora import LoRABatch

    cfg = json.loads((lora_model["base"] / "config.json").read_text())
    arch = ModelArchConfig.from_hf_config(cfg)
    model = LlamaForCausalLM(arch, TorchNativeBackend)
    model.load_weights(iter_safetensors(str(lora_model["base"])))
    model.eval()
    ctx = LoRAContext()
    slots = AdapterSlots(wrap_model(model, ctx, 3, 16), arch, 3, 16, 3)
    slot_of = slots.activate({1: adapters["lora-a"], 2: adapters["lora-b"]})
    block, nb = 4, 64
    shape = TorchNativeBackend.get_kv_cache_shape(nb, block, 2, 16)
    for m in model.modules():
        if isinstance(m, Attention):
            m.kv_cache = torch.zeros(shape)
    prompts, names = PROMPTS[:3], [None, "lora-a", "lora-b"]
    req_slots = [-1, slot_of[1], slot_of[2]]
    tables = np.arange(1, 1 + 3 * 16).reshape(3, 16).astype(np.int32)

    def run(tokens: list[list[int]], starts: list[int], rows: bool) -> torch.Tensor:
        counts = np.array([len(t) for t in tokens])
        qsl = np.concatenate([[0], np.cumsum(counts)])
        pos = np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
        req = np.repeat(np.arange(3), counts)
        slot_map = tables[req, pos // block].astype(np.int64) * block + pos % block
        seq_lens = np.array(starts) + counts
        common = CommonAttentionMetadata(
            num_reqs=3, num_actual_tokens=int(qsl[-1]), max_query_len=int(counts.max()),
            max_seq_len=int(seq_lens.max()), query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_table=torch.tensor(tables),
            slot_mapping=torch.from_numpy(slot_map), query_start_loc_cpu=qsl,
            seq_lens_cpu=seq_lens, block_size=block,
        )  # fmt: skip
        tok_slots = torch.tensor(np.repeat(req_slots, counts), dtype=torch.int32)
        segments = [(int(qsl[i]), int(qsl[i + 1]), s) for i, s in enumerate(req_slots) if s >= 0]
        ctx.batch = LoRABatch(
            tok_slots, torch.tensor(qsl, dtype=torch.int32), torch.tensor(req_slots),
            int(counts.max()), segments, use_rows=rows,
        )  # fmt: skip
        ids = torch.tensor([t for seq in tokens for t in seq])
        with torch.inference_mode(), set_forward_context(TorchNativeBackend.build_metadata(common)):
            logits = model.compute_logits(model(ids, torch.from_numpy(pos)))
        return logits[torch.from_numpy(qsl[1:] - 1)]

    got = run(prompts, [0, 0, 0], rows=False)
    nxt = [[int(g.argmax())] for g in got]
    got2 = run(nxt, [len(p) for p in prompts], rows=True)
    with torch.inference_mode():
        for i, name in enumerate(names):
            hf = lora_model["hf"][name]
            want = hf(torch.tensor([prompts[i] + nxt[i]])).logits[0, -2:]
            torch.testing.assert_close(got[i], want[0], atol=1e-4, rtol=0)
            torch.testing.assert_close(got2[i], want[1], atol=1e-4, rtol=0)
    # The negative control: without the adapters' slots the adapter rows are off.
    with torch.inference_mode():
        base = lora_model["hf"][None](torch.tensor([prompts[1]])).logits[0, -1]
    assert (got[1] - base).abs().max() > 1e-2


def _prefix_prompt() -> list[int]:
    return [1] + [(7 * i + 3) % 500 + 3 for i in range(40)]  # more than two 16-token blocks


def test_prefix_cache_never_shares_blocks_across_adapters(llm, adapters, lora_model) -> None:
    prompt = {"prompt_token_ids": _prefix_prompt()}
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)  # the base model's blocks are cached
    a = llm.generate(prompt, sp, lora_request=adapters["lora-a"], use_tqdm=False)[0]
    assert a.num_cached_tokens == 0
    assert a.outputs[0].token_ids == _hf_greedy(lora_model["hf"]["lora-a"], _prefix_prompt(), 3)[0]
    again = llm.generate(prompt, sp, lora_request=adapters["lora-a"], use_tqdm=False)[0]
    assert again.num_cached_tokens == 32  # its own blocks are shared with itself
    b = llm.generate(prompt, sp, lora_request=adapters["lora-b"], use_tqdm=False)[0]
    assert b.num_cached_tokens == 0


def test_without_the_adapter_in_the_key_blocks_leak_across_adapters(
    llm, adapters, lora_model, monkeypatch
) -> None:
    """The negative control of the test above: with the adapter left out of the first block's
    key, a request on lora-b takes the base model's blocks and gives other tokens."""
    llm.engine.engine_core.kv_cache_manager.reset_prefix_cache()
    monkeypatch.setattr(hashing, "_first_block_keys", lambda request: ())
    prompt = {"prompt_token_ids": _prefix_prompt()}
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    llm.generate(prompt, sp, use_tqdm=False)
    b = llm.generate(prompt, sp, lora_request=adapters["lora-b"], use_tqdm=False)[0]
    assert b.num_cached_tokens == 32
    assert b.outputs[0].token_ids != _hf_greedy(lora_model["hf"]["lora-b"], _prefix_prompt(), 3)[0]
    monkeypatch.undo()
    llm.engine.engine_core.kv_cache_manager.reset_prefix_cache()


def test_one_slot_runs_three_adapters_in_turn_with_the_same_tokens(
    lora_model, adapters, tmp_path
) -> None:
    """max_loras=1: the scheduler runs one adapter's requests at a time (with base-model ones
    beside them), the slot's LRU reloads adapters as they come back, and every request gives
    its merged model's tokens."""
    c_path = tmp_path / "lora-c"
    shutil.copytree(lora_model["paths"]["lora-a"], c_path)
    c = LoRARequest("lora-c", 3, str(c_path))  # lora-a's weights under another name and id
    llm = LLM(
        model=str(lora_model["base"]), enable_lora=True, max_loras=1, max_cpu_loras=1,
        max_lora_rank=16, max_model_len=256, dtype="float32", kv_cache_memory_bytes=8 << 20,
    )  # fmt: skip
    which = ["lora-a", "lora-b", None, "lora-c", "lora-a", "lora-b"]
    loras = [None if w is None else {**adapters, "lora-c": c}[w] for w in which]
    prompts = [PROMPTS[i % 4] for i in range(len(which))]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], sp, lora_request=loras, use_tqdm=False
    )
    for out, prompt, w in zip(outs, prompts, which):
        hf = lora_model["hf"]["lora-a" if w == "lora-c" else w]
        assert out.outputs[0].token_ids == _hf_greedy(hf, prompt, 4)[0], w
    slots = llm.engine.engine_core.executor.worker.model_runner.lora.slots
    assert slots.loads >= 3 and len(slots.slot_of) == 1 and len(slots.host) == 1


# ---- bad input -------------------------------------------------------------------------------


def _bad(tmp_path, name: str, lora_model, **change) -> LoRARequest:
    path = tmp_path / name
    shutil.copytree(lora_model["paths"]["lora-a"], path)
    cfg = json.loads((path / "adapter_config.json").read_text())
    cfg.update(change)
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    return LoRARequest(name, 50 + len(name), str(path))


def test_bad_adapters_are_refused_in_one_line_naming_them(llm, lora_model, tmp_path) -> None:
    missing = LoRARequest("gone", 40, str(tmp_path / "nowhere"))
    garbled = _bad(tmp_path, "garbled", lora_model)
    (tmp_path / "garbled" / "adapter_config.json").write_text("{not json")
    no_weights = _bad(tmp_path, "noweights", lora_model)
    (tmp_path / "noweights" / "adapter_model.safetensors").unlink()
    torn = _bad(tmp_path, "torn", lora_model)
    (tmp_path / "torn" / "adapter_model.safetensors").write_bytes(b"\x00" * 12)
    big = _bad(tmp_path, "big", lora_model, r=32)
    lacking = _bad(tmp_path, "lacking", lora_model, target_modules=["q_proj", "foo_proj"])
    cases = {
        missing: "no such folder",
        garbled: "not valid JSON",
        no_weights: "no adapter_model.safetensors",
        torn: "cannot be read",
        big: "rank 32 is above lora.max_lora_rank=16",
        lacking: "['foo_proj']",
    }
    sp = SamplingParams(max_tokens=2, temperature=0.0)
    for lora, words in cases.items():
        with pytest.raises(ValueError) as err:
            llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, lora_request=lora, use_tqdm=False)
        msg = str(err.value)
        assert "\n" not in msg and repr(lora.lora_name) in msg and words in msg, msg
    # An adapter checked once, then deleted: refused before it reaches the worker.
    gone = _bad(tmp_path, "deleted", lora_model)
    llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, lora_request=gone, use_tqdm=False)
    shutil.rmtree(tmp_path / "deleted")
    with pytest.raises(ValueError, match="'deleted'.*gone since the adapter was first checked"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, lora_request=gone, use_tqdm=False)
    # A good batch right after: nothing else failed.
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, sp, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_an_adapter_gone_before_its_first_step_fails_its_requests_alone(
    llm, lora_model, tmp_path
) -> None:
    """Checked when its request came in, the adapter's folder is gone when the worker first
    loads it: that request ends with an error naming the adapter; a base-model request and a
    request on a loaded adapter in the same steps finish; the engine serves on, KV blocks back."""
    gone = _bad(tmp_path, "vanished", lora_model)
    good = LoRARequest("lora-a", 1, str(lora_model["paths"]["lora-a"]))
    engine = llm.engine
    sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_processed("v", None, PROMPTS[0], sp, lora_request=gone)
    engine.add_processed("b", None, PROMPTS[1], sp)
    engine.add_processed("a", None, PROMPTS[2], sp, lora_request=good)
    shutil.rmtree(tmp_path / "vanished")
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    failed = done["v"].outputs[0]
    assert failed.finish_reason == "error", failed
    assert "'vanished'" in str(failed.stop_reason) and "could not be loaded" in str(
        failed.stop_reason
    )
    assert len(done["b"].outputs[0].token_ids) == 3 and len(done["a"].outputs[0].token_ids) == 3
    assert engine.engine_core.kv_cache_manager.usage == 0.0
    again = llm.generate({"prompt_token_ids": PROMPTS[3]}, sp, lora_request=good, use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 3


def test_an_adapter_tensor_for_a_module_the_model_lacks_is_refused(llm, lora_model, tmp_path):
    from safetensors.torch import load_file, save_file

    lacking = _bad(tmp_path, "embed", lora_model)
    tensors = load_file(str(tmp_path / "embed" / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.fc9.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(tmp_path / "embed" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match="'embed'.*targets 'fc9', which the model lacks"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=lacking, use_tqdm=False)


def test_one_id_for_two_adapters_and_lora_off_are_refused(lora_model, llm, adapters) -> None:
    other = LoRARequest("other", 1, adapters["lora-b"].lora_path)  # lora-a's id
    with pytest.raises(ValueError, match="lora_int_id 1 is adapter 'lora-a'"):
        llm.generate({"prompt_token_ids": PROMPTS[0]}, lora_request=other, use_tqdm=False)
    with pytest.raises(ValueError, match="lora_int_id must be an integer >= 1"):
        LoRARequest("zero", 0, "x")


def test_a_bad_lora_module_is_refused_in_one_line_naming_it(llm, adapters, tmp_path) -> None:
    """What ``pagoda serve --lora-modules`` does with each module before serving: a bad one
    stops it with this error (``pagoda: error: ...``)."""
    from types import SimpleNamespace

    from pagoda.entrypoints.openai.lora_modules import LoRAModules

    def modules(*items: str) -> LoRAModules:
        config = llm.engine.config.model_copy(deep=True)
        config.server.lora_modules = list(items)
        return LoRAModules(SimpleNamespace(config=config, engine=llm.engine), ["base"])

    served = (f"lora-a={adapters['lora-a'].lora_path}",
              json.dumps({"name": "lora-b", "path": adapters["lora-b"].lora_path}))  # fmt: skip
    good = modules(*served)
    assert good.names == ["base", "lora-a", "lora-b"]
    assert good.by_name["lora-b"] == adapters["lora-b"]
    for item, words in [
        (f"bad={tmp_path / 'nowhere'}", "'bad' ("),
        (f"base={adapters['lora-a'].lora_path}", "the base model's name"),
        ('{"name": "x"}', "has a name and a path"),
    ]:
        with pytest.raises(ValueError) as err:
            modules(*served, item)  # (the third gets an id of its own)
        assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_transformers_model_impl_refuses_lora_by_name(lora_model) -> None:
    pytest.importorskip("pagoda_models_transformers")
    with pytest.raises(ValueError, match="model.impl 'transformers'.*does not support adapters"):
        LLM(model=str(lora_model["base"]), enable_lora=True, model_impl="transformers",
            max_model_len=64, dtype="float32")  # fmt: skip


def test_lora_settings_that_cannot_work_are_refused_by_key(lora_model) -> None:
    from pagoda.config import ConfigError, EngineConfig

    with pytest.raises(ConfigError, match="max_cpu_loras=1 is below lora.max_loras=2"):
        EngineConfig.load(overrides={"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1})
    with pytest.raises(ConfigError, match="max_lora_rank"):
        EngineConfig.load(overrides={"max_lora_rank": 128})
    with pytest.raises(ConfigError, match="a LoRA module is `name=path`"):
        EngineConfig.load(overrides={"lora_modules": ["no-path"]})
    base = dict(model=str(lora_model["base"]), max_model_len=64, dtype="float32")
    with pytest.raises(ValueError, match="lora_modules.*needs lora.enable_lora"):
        LLM(lora_modules=["a=/x"], **base)
    with pytest.raises(ValueError, match="lora.enable_lora with speculative decoding"):
        LLM(enable_lora=True, speculative_config={"method": "ngram", "num_speculative_tokens": 2},
            **base)  # fmt: skip
    with pytest.raises(ValueError, match="lora.enable_lora with model.batch_invariant"):
        LLM(enable_lora=True, batch_invariant=True, **base)
    plain = LLM(kv_cache_memory_bytes=4 << 20, **base)
    with pytest.raises(ValueError, match="'x': LoRA is off"):
        plain.generate({"prompt_token_ids": [1, 2]}, lora_request=LoRARequest("x", 1, "/x"))


def test_a_graph_replay_gets_every_tokens_slot_and_padding_rows_none(llm, adapters) -> None:
    """What a decode graph reads (``LoRAInputs.prepare`` with the bucket's token count): each
    request's slot for each of its tokens, -1 for the base model and the padding rows; an
    eager step without adapters runs the base path alone."""
    import numpy as np

    lora = llm.engine.engine_core.executor.worker.model_runner.lora
    lora.add("x", adapters["lora-a"])
    lora.add("y", None)
    lora.add("z", adapters["lora-b"])
    try:
        counts = np.array([2, 2, 2])  # a verification-shaped step: 2 tokens a request
        qsl = np.array([0, 2, 4, 6])
        lora.prepare(["x", "y", "z"], counts, qsl, graph_tokens=10)
        slot_a, slot_b = lora.slots.slot_of[1], lora.slots.slot_of[2]
        assert lora.context.batch is lora.graph_batch and lora.graph_batch.use_rows
        want = [slot_a, slot_a, -1, -1, slot_b, slot_b] + [-1] * 4
        assert lora.token_slots[:10].tolist() == want
        lora.prepare(["y"], np.array([3]), np.array([0, 3]), graph_tokens=None)
        assert lora.context.batch is None
    finally:
        for rid in "xyz":
            lora.remove(rid)
        lora.context.batch = None


def test_a_decode_step_of_the_same_requests_reuses_the_last_slots(
    llm, adapters, monkeypatch
) -> None:
    """``LoRAInputs.prepare`` uploads nothing for a rows step of the requests, token counts and
    slots of the last one; a request added, or an adapter moved to another slot, uploads
    again. With ``fused-slots``' sort on, the rows grouped by slot go up with the slots."""
    import numpy as np

    lora = llm.engine.engine_core.executor.worker.model_runner.lora
    uploads = []
    real = lora.buffers.to_device
    monkeypatch.setattr(lora.buffers, "to_device", lambda d, s: (uploads.append(1), real(d, s)))
    monkeypatch.setattr(lora, "sorts", True)
    lora.add("x", adapters["lora-a"])
    lora.add("y", adapters["lora-b"])
    lora.add("z", adapters["lora-a"])
    try:
        ids, counts, qsl = ["x", "y", "z"], np.ones(3, dtype=np.int64), np.arange(4)
        lora.prepare(ids, counts, qsl, graph_tokens=4)
        assert len(uploads) == 3  # the slots, the sorted rows, each slot's start
        slot_a, slot_b = lora.slots.slot_of[1], lora.slots.slot_of[2]
        starts = lora.slot_starts.tolist()
        assert lora.sorted_rows[starts[slot_a] : starts[slot_a + 1]].tolist() == [0, 2]
        assert lora.sorted_rows[starts[slot_b] : starts[slot_b + 1]].tolist() == [1]
        lora.prepare(list(ids), counts.copy(), qsl, graph_tokens=4)
        assert len(uploads) == 3 and lora.context.batch is lora.graph_batch
        lora.slots.version += 1  # as when an adapter is written into another slot
        lora.prepare(ids, counts, qsl, graph_tokens=4)
        assert len(uploads) == 6
        lora.add("w", None)
        lora.prepare(ids + ["w"], np.ones(4, dtype=np.int64), np.arange(5), graph_tokens=4)
        assert len(uploads) == 9
        assert lora.token_slots[:4].tolist() == [slot_a, slot_b, slot_a, -1]
    finally:
        for rid in "xyzw":
            lora.remove(rid)
        lora.context.batch = None
