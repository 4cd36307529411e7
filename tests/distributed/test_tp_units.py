"""The pieces of tensor parallelism without processes: each rank's slices of a checkpoint (read
from the file, not whole), the KV heads split or replicated, the start-up error for a size that
does not divide the model, and the step messages' round trip without pickle."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import zmq

from pagoda import LLM
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.distributed import parallel_state, tp_shape
from pagoda.executor import messages as m
from pagoda.executor.workers import WorkerFailedError, WorkerGroupExecutor
from pagoda.loader import ModelArchConfig, load_hf_config
from pagoda.loader.sharded import iter_safetensors_slices
from pagoda.loader.weights import iter_safetensors
from pagoda.models.llama import LlamaForCausalLM
from pagoda.sampling_params import SamplingParams
from pagoda.step import (
    CachedRequestData,
    LogprobsArrays,
    ModelRunnerOutput,
    NewRequestData,
    PromptLogprobs,
    SchedulerOutput,
)


def _rank_model(folder: Path, rank: int, size: int, monkeypatch) -> LlamaForCausalLM:
    monkeypatch.setattr(parallel_state, "_rank", rank)
    monkeypatch.setattr(parallel_state, "_size", size)
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    model = LlamaForCausalLM(arch, TorchNativeBackend)
    model.load_weights(iter_safetensors_slices(folder))
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_each_rank_loads_its_slice_and_the_slices_make_the_checkpoint(
    tiny_models, monkeypatch, kind: str
) -> None:
    folder = tiny_models[kind]
    full = dict(iter_safetensors(folder))
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    ranks = [_rank_model(folder, r, 2, monkeypatch) for r in range(2)]
    p = [dict(r.named_parameters()) for r in ranks]
    attn = "model.layers.0.self_attn"
    hd, kv = arch.head_dim, arch.num_key_value_heads
    q = arch.num_attention_heads * hd // 2
    # Query heads and the MLP split by rows, o_proj and down_proj by columns.
    assert torch.equal(
        torch.cat([x[f"{attn}.qkv_proj.weight"][:q] for x in p]), full[f"{attn}.q_proj.weight"]
    )
    assert torch.equal(
        torch.cat([x[f"{attn}.o_proj.weight"] for x in p], dim=1), full[f"{attn}.o_proj.weight"]
    )
    inter = arch.intermediate_size // 2
    gate = torch.cat([x["model.layers.1.mlp.gate_up_proj.weight"][:inter] for x in p])
    assert torch.equal(gate, full["model.layers.1.mlp.gate_proj.weight"])
    # KV heads: split where there are as many as ranks, replicated where fewer.
    k = [x[f"{attn}.qkv_proj.weight"][q : q + hd * max(1, kv // 2)] for x in p]
    if kv == 1:
        assert torch.equal(k[0], full[f"{attn}.k_proj.weight"]) and torch.equal(k[0], k[1])
        assert [tp_shape(arch, r, 2).kv_replicas for r in range(2)] == [2, 2]
    else:
        assert torch.equal(torch.cat(k), full[f"{attn}.k_proj.weight"])
    # The vocabulary (1001) split in two padded halves; the tied head is the embedding.
    emb = torch.cat([x["model.embed_tokens.weight"] for x in p])
    assert emb.shape[0] == 1002 and not emb[1001:].any()
    assert torch.equal(emb[:1001], full["model.embed_tokens.weight"])
    if arch.tie_word_embeddings:
        assert ranks[1].lm_head.weight is ranks[1].model.embed_tokens.weight
    # No rank holds more than its share of the large weights (plus a replicated KV head's
    # other half, and a padding row).
    big = sum(t.numel() for n, t in full.items() if t.dim() == 2)
    replicated = arch.num_hidden_layers * hd * arch.hidden_size if kv == 1 else 0
    for x in p:
        held = sum(t.numel() for t in x.values() if t.dim() == 2)
        assert held <= big // 2 + replicated + emb.shape[1]


def test_a_size_that_does_not_divide_the_heads_fails_at_start_naming_them(smollm2_gguf) -> None:
    with pytest.raises(ValueError) as caught:
        LLM(model=str(smollm2_gguf), tensor_parallel_size=2)
    msg = str(caught.value)
    assert "tensor_parallel_size=2" in msg and "9 attention heads" in msg
    assert "3 KV heads" in msg and msg.endswith("sizes that fit: 1, 3")  # 9: not its MLP


def test_step_messages_round_trip_as_msgpack() -> None:
    params = SamplingParams(temperature=0.7, top_k=5, seed=3, stop=["x"], logprobs=2)
    so = SchedulerOutput(
        [NewRequestData("a", [1, 2, 3], [4], params, [7, 8], 2)],
        [CachedRequestData("b", [9], 11)],
        {"a": 2, "b": 1},
        3,
        {"c"},
    )
    enc = m.encoder()
    step = m.worker_decoder().decode(enc.encode(m.Step(5, so)))
    assert isinstance(step, m.StepIn) and step.seq == 5  # what the worker's loop serves
    back = m.scheduler_output_from_wire(step.scheduler_output)
    assert back == so and back.scheduled_new_reqs[0].sampling_params == params
    arrays = LogprobsArrays(
        np.array([[4, 4, 1]]), np.array([[-0.1, -0.1, -2.0]], np.float32), np.array([1])
    )
    out = ModelRunnerOutput(["a"], [[4]], {"a": arrays}, {"a": PromptLogprobs(1, arrays)})
    done = m.executor_decoder().decode(enc.encode(m.StepDone(5, out)))
    got = done.output.logprobs["a"]
    assert done.output.sampled_token_ids == [[4]] and done.output.req_ids == ["a"]
    assert np.array_equal(got.logprobs, arrays.logprobs) and got.logprobs.dtype == np.float32
    assert done.output.prompt_logprobs["a"].start == 1


def test_executor_names_auto_and_vllms() -> None:
    from pagoda.config import EngineConfig
    from pagoda.executor.base import executor_name

    def name(**kw) -> str:
        return executor_name(EngineConfig.load(overrides=kw).parallel)

    assert name() == "uniproc" and name(tensor_parallel_size=2) == "multiproc"
    assert name(tensor_parallel_size=2, distributed_executor_backend="mp") == "multiproc"
    assert name(tensor_parallel_size=2, executor="ray") == "ray"


class _NoWorkers(WorkerGroupExecutor):
    """The engine side of a group alone: its sockets, with no worker started."""

    def __init__(self, world_size: int, timeout_s: float) -> None:
        self.world_size = world_size
        self.failed = None
        self._timeout_s = timeout_s
        self._last_seen = [time.monotonic() + 3600.0] * world_size
        self._encoder = m.encoder()
        self._open_sockets()

    def start_workers(self, specs) -> None:
        raise AssertionError("no workers here")

    def dead_worker(self) -> str | None:
        return None

    def stop_workers(self, timeout_s: float) -> None:
        pass

    def dist_init_method(self) -> str:
        return "tcp://127.0.0.1:1"


def test_a_call_waits_for_a_rank_whose_inbox_connects_late() -> None:
    # A rank's hello can arrive before its inbox is connected; the first call must reach it.
    ex = _NoWorkers(2, timeout_s=30.0)
    ctx = zmq.Context()
    inboxes = [ctx.socket(zmq.PULL) for _ in range(2)]
    try:
        inboxes[0].connect(ex._connect_addrs[0])
        later = threading.Timer(0.5, inboxes[1].connect, (ex._connect_addrs[1],))
        later.start()
        ex._broadcast(m.Call(7, "load_model", []))
        later.join()
        decoder = m.worker_decoder()
        for sock in inboxes:
            assert sock.poll(5000), "a rank got no message"
            assert decoder.decode(sock.recv()) == m.Call(7, "load_model", [])
        assert ex.failed is None
    finally:
        ex.shutdown()
        ctx.destroy(linger=0)


def test_a_rank_that_never_connects_fails_the_call_naming_it() -> None:
    ex = _NoWorkers(2, timeout_s=0.5)
    ctx = zmq.Context()
    inbox = ctx.socket(zmq.PULL)
    try:
        inbox.connect(ex._connect_addrs[0])
        with pytest.raises(WorkerFailedError, match="rank 1 does not take its messages"):
            ex._broadcast(m.Call(0, "load_model", []))
    finally:
        ctx.destroy(linger=0)
