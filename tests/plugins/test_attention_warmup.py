"""The step kinds a JIT backend's compile runs (pagoda.attention.warmup) are the ones the model
runner sends: a mixed prefill step, an eager decode step, and for a graphed backend a decode graph
and a speculative verification graph, each planned at capture and re-planned before a replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pagoda.attention.backend import CommonAttentionMetadata
from pagoda.attention.torch_native import TorchNativeBackend
from pagoda.attention.warmup import STEP_KINDS, run_every_step_kind, run_step, step_kinds

CPU = torch.device("cpu")


class RecordingBackend(TorchNativeBackend):
    """The reference backend, graphed, noting each call the runner's paths make."""

    name = "recording"
    supports_cuda_graph = True
    calls: list[tuple[str, int, int]] = []  # (method, num_reqs, max_query_len)
    steps: list[CommonAttentionMetadata] = []  # the steps attended: eager ones and replays

    @classmethod
    def build_metadata(cls, common: CommonAttentionMetadata):
        cls.calls.append(("build_metadata", common.num_reqs, common.max_query_len))
        cls.steps.append(common)
        return super().build_metadata(common)

    @classmethod
    def build_graph_metadata(cls, common: CommonAttentionMetadata):
        cls.calls.append(("build_graph_metadata", common.num_reqs, common.max_query_len))
        return TorchNativeBackend.build_metadata(common)

    @classmethod
    def prepare_graph_replay(cls, metadata, common: CommonAttentionMetadata) -> None:
        cls.calls.append(("prepare_graph_replay", common.num_reqs, common.max_query_len))
        cls.steps.append(common)
        metadata.__dict__.update(TorchNativeBackend.build_metadata(common).__dict__)


@pytest.fixture
def recording():
    RecordingBackend.calls, RecordingBackend.steps = [], []
    yield RecordingBackend


def test_a_graphed_backend_is_driven_through_every_kind_of_runner_step(recording) -> None:
    assert run_every_step_kind(recording, CPU, torch.float32, 64) == list(STEP_KINDS)
    calls = recording.calls
    eager = [c for c in calls if c[0] == "build_metadata"]
    assert any(q > 1 for _, _, q in eager), "no prefill step"
    assert any(q == 1 for _, _, q in eager), "no eager decode step"
    graphs = [c for c in calls if c[0] == "build_graph_metadata"]
    assert sorted(q for _, _, q in graphs) == [1, 3]  # a decode and a verification graph
    replays = [c for c in calls if c[0] == "prepare_graph_replay"]
    assert sorted(q for _, _, q in replays) == [1, 3]
    # The replayed step is padded to the graph's bucket, as the runner pads it.
    assert all(n == graphs[0][1] for _, n, _ in replays)


def test_a_backend_without_graphs_gets_the_eager_kinds_only() -> None:
    assert step_kinds(TorchNativeBackend) == ("prefill", "decode")
    assert run_every_step_kind(TorchNativeBackend, CPU, torch.float32, 64) == [
        "prefill",
        "decode",
    ]


def _check_consistent(common: CommonAttentionMetadata) -> None:
    """Device and host copies agree, and each token's slot is its request's block at its
    position (so every write and read of the step lands where the runner would put it); a
    graph's padding rows, as the runner pads them, write slot 0 of block 0."""
    n, bs = common.num_reqs, common.block_size
    qsl = common.query_start_loc_cpu[: n + 1]
    seq = common.seq_lens_cpu[:n]
    assert np.array_equal(common.query_start_loc.cpu().numpy(), qsl)
    assert np.array_equal(common.seq_lens.cpu().numpy(), seq)
    assert common.max_query_len == np.diff(qsl).max() and common.max_seq_len == seq.max()
    table = common.block_table.cpu().numpy()
    slots = common.slot_mapping.cpu().numpy()
    assert len(slots) == common.num_actual_tokens == qsl[-1]
    for i in range(n):
        q = qsl[i + 1] - qsl[i]
        assert 1 <= q <= seq[i]
        pos = np.arange(seq[i] - q, seq[i])
        want = table[i, pos // bs].astype(np.int64) * bs + pos % bs
        if not table[i].any():  # a graph's padding row: every token writes slot 0
            want = np.zeros(q, dtype=np.int64)
        assert np.array_equal(slots[qsl[i] : qsl[i + 1]], want)


def test_every_step_it_attends_is_a_consistent_runner_step(recording) -> None:
    run_every_step_kind(recording, CPU, torch.float32, 64)
    assert len(recording.steps) == 4  # prefill, decode, and the two graph replays
    for common in recording.steps:
        _check_consistent(common)
    for replay in recording.steps[2:]:
        first_blocks = replay.block_table.cpu().numpy()[:, 0]
        # Real requests own blocks past 0; padding rows point at block 0 only, as the runner's.
        assert 0 < int((first_blocks != 0).sum()) < replay.num_reqs


def test_an_unknown_step_kind_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="prefill, decode, decode graph, verification graph"):
        run_step(TorchNativeBackend, "ragged", CPU, torch.float32, 64)


def test_a_backend_replans_its_graphs_where_it_says_so() -> None:
    """By default a backend that overrides ``prepare_graph_replay`` re-plans every graph, one
    that does not re-plans none; the Triton backend re-plans only the decode graphs whose
    requests it orders (its verification graphs may then be launched ahead of the step in
    flight, which a re-plan would forbid)."""
    assert RecordingBackend.graph_replans(object())
    assert not TorchNativeBackend.graph_replans(object())
    triton_backend = pytest.importorskip("pagoda_attention_triton.backend")
    md = triton_backend.TritonMetadata(common=None, num_splits=1)
    assert not triton_backend.TritonAttentionBackend.graph_replans(md)
    md.order = torch.arange(4, dtype=torch.int32)
    assert triton_backend.TritonAttentionBackend.graph_replans(md)
