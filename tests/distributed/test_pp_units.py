"""The pieces of pipeline parallelism without processes: how layers split into stages and the
one-line errors naming the keys, each stage loading only its part of the checkpoint, the
refusals by name at start, and the scheduler's side of the batch queue."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagoda import LLM
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.config import CacheConfig, SchedulerConfig
from pagoda.distributed import parallel_state, split_layers
from pagoda.kv_cache.manager import KVCacheManager
from pagoda.loader import ModelArchConfig, load_hf_config
from pagoda.loader.weights import iter_safetensors
from pagoda.models.llama import LlamaForCausalLM
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.scheduler import Scheduler
from pagoda.step import ModelRunnerOutput


def test_layers_split_evenly_or_as_the_partition_says() -> None:
    assert split_layers(30, 1) == [(0, 30)]
    assert split_layers(30, 2) == [(0, 15), (15, 30)]
    assert split_layers(30, 3, [8, 10, 12]) == [(0, 8), (8, 18), (18, 30)]


@pytest.mark.parametrize(
    ("layers", "pp", "partition", "message"),
    [
        (2, 3, None, r"parallel.pipeline_parallel_size=3 is larger than the model's 2 layers"),
        (
            30,
            4,
            None,
            r"pipeline_parallel_size=4 does not split the model's 30 layers evenly; give "
            r"parallel.pipeline_layer_partition .*\[8, 8, 7, 7\]",
        ),
        (30, 2, [14, 15], r"pipeline_layer_partition=\[14, 15\] sums to 29; the model has 30"),
        (30, 2, [30], r"pipeline_layer_partition=\[30\] names 1 stages; .*size=2 needs one"),
        (30, 2, [0, 30], r"every stage needs at least one layer"),
    ],
)
def test_a_split_that_cannot_be_made_is_one_line_naming_the_keys(
    layers: int, pp: int, partition: list[int] | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message) as err:
        split_layers(layers, pp, partition)
    assert "\n" not in str(err.value)


def _stage_model(folder: Path, stage: int, monkeypatch) -> LlamaForCausalLM:
    arch = ModelArchConfig.from_hf_config(load_hf_config(folder))
    ranges = split_layers(arch.num_hidden_layers, 2)
    monkeypatch.setattr(parallel_state, "_pp_rank", stage)
    monkeypatch.setattr(parallel_state, "_pp_size", 2)
    monkeypatch.setattr(parallel_state, "_layers", ranges[stage])
    model = LlamaForCausalLM(arch, TorchNativeBackend)
    model.load_weights(iter_safetensors(folder))  # raises on a parameter left unset
    return model


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_each_stage_holds_and_loads_only_its_layers(tiny_models, monkeypatch, kind) -> None:
    folder = tiny_models[kind]
    full = dict(iter_safetensors(folder))
    tied = "lm_head.weight" not in full
    first, last = (
        set(dict(_stage_model(folder, s, monkeypatch).named_parameters())) for s in (0, 1)
    )
    assert {n.split(".")[2] for n in first if n.startswith("model.layers.")} == {"0"}
    assert {n.split(".")[2] for n in last if n.startswith("model.layers.")} == {"1"}
    assert "model.embed_tokens.weight" in first and "model.norm.weight" not in first
    assert "model.norm.weight" in last
    # The last stage's LM head: its own weight, or (tied) the embedding it holds for it.
    assert ("model.embed_tokens.weight" if tied else "lm_head.weight") in last
    assert not any(n.startswith("lm_head") for n in first)


def test_pipeline_refuses_what_it_cannot_serve_by_name(tiny_models) -> None:
    model = str(tiny_models["llama"])
    base = dict(model=model, pipeline_parallel_size=2, executor="multiproc", max_model_len=64)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=2 does not work with "
                       r"speculative.method"):  # fmt: skip
        LLM(**base, speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match=r"pipeline_parallel_size=3 is larger than the model's 2"):
        LLM(**{**base, "pipeline_parallel_size": 3})
    with pytest.raises(ValueError, match=r"pipeline_layer_partition=\[1, 2\] sums to 3"):
        LLM(**base, pipeline_layer_partition=[1, 2])


def test_pipeline_refuses_a_model_impl_that_does_not_split(tiny_models) -> None:
    pytest.importorskip("pagoda_models_transformers")
    with pytest.raises(ValueError, match=r"model.impl='transformers' .* does not split into "
                       r"pipeline stages"):  # fmt: skip
        LLM(
            model=str(tiny_models["llama"]),
            model_impl="transformers",
            pipeline_parallel_size=2,
            executor="multiproc",
            max_model_len=64,
        )


def test_batch_queue_holds_back_requests_in_flight_and_carries_their_new_tokens() -> None:
    manager = KVCacheManager(64, 4, True, 128)
    sched = Scheduler(
        SchedulerConfig(max_num_batched_tokens=6),
        CacheConfig(block_size=4),
        manager,
        128,
        batch_queue=True,
    )
    for rid, prompt in (("a", [5, 6, 7, 8]), ("b", [9, 10, 11, 12])):
        sched.add_request(Request(rid, prompt, SamplingParams(max_tokens=4)))
    first = sched.schedule()  # a whole, b's first two tokens
    assert first.num_scheduled_tokens == {"a": 4, "b": 2}
    second = sched.schedule()  # a's token is in flight: only b's rest
    assert second.num_scheduled_tokens == {"b": 2}
    assert sched.schedule().is_empty  # both in flight: nothing to run
    sched.update_from_output(first, ModelRunnerOutput(["a", "b"], [[42], []]))
    third = sched.schedule()
    assert third.num_scheduled_tokens == {"a": 1}
    assert [c.new_token_ids for c in third.scheduled_cached_reqs] == [[42]]
