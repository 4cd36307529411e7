"""On a GPU: KV offload to pinned CPU memory, copies on their own streams. A device KV cache too
small for a set of long shared prefixes gives the same greedy output with offload on as off
(random fp32 weights in Qwen3-0.6B's attention shapes: token for token one request at a time,
also where overlap recomputes part of a hit in other chunks than the reference did, which in
bf16 would round differently; in a burst that batches differently, except at near-ties), while
the CPU pool serves the hits (through the ``pagoda:`` metrics, and the device copies match what
the scheduler counted), and both pools return to idle. Eager steps on the Triton backend, named
so that both engines run the same kernels and nothing compiles in the background: the test stays
short, and the benchmark (benchmarks/kv_offload.py) covers decode graphs reading loaded KV."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from pagoda import LLM, SamplingParams

from .gpu_helpers import check_same_or_near_tie

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

CONFIGS = Path(__file__).parents[2] / "benchmarks" / "configs"
VOCAB = 4096
_COMMON: dict = dict(
    dtype="float32",
    attention_backend="triton",
    max_model_len=512,
    max_num_seqs=8,
    enforce_eager=True,
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory) -> Path:
    """Qwen3-0.6B's attention shapes with four layers and a small vocabulary, weights drawn so
    that attention is sharp (greedy output depends on tokens far back: KV loaded wrong shows)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagoda.loader.synthetic import synthetic_tokenizer

    folder = tmp_path_factory.mktemp("qwen3-offload")
    cfg = json.loads((CONFIGS / "qwen3-0.6b" / "config.json").read_text())
    cfg.update(num_hidden_layers=4, vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    cfg["tie_word_embeddings"] = False
    torch.manual_seed(0)
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.fill_(3.0)
            elif "norm" not in name:
                p.normal_(0, 1.0 if "embed_tokens" in name else p.shape[-1] ** -0.5)
    model.save_pretrained(folder)
    synthetic_tokenizer(VOCAB, 2).save_pretrained(folder)
    return folder


def _prompts() -> list[list[int]]:
    """Six 384-token prefixes, each asked twice (a round apart), then each once more."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(10, VOCAB - 10) for _ in range(384)] for _ in range(6)]
    return [p + [100 + r, 200 + i] for r in range(3) for i, p in enumerate(prefixes)]


def _workload(llm: LLM) -> list[list[int]]:
    """The first twelve prompts one at a time (each prefix comes back after the others pushed
    it out of the device cache), the last six at once (loads in flight while others compute)."""
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    outs = [llm.generate(p, sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts[:12]]
    return outs + [o.outputs[0].token_ids for o in llm.generate(prompts[12:], sp, use_tqdm=False)]


def _metrics_text(llm: LLM, run) -> str:  # noqa: ANN001
    """The ``pagoda:`` metrics of what ``run()`` did, as /metrics renders them."""
    from pagoda.engine.core_proc import _StatsTracker
    from pagoda.engine.metrics import EngineMetrics

    tracker = _StatsTracker()
    tracker.core = llm.engine.engine_core
    tracker.make()  # start from zero
    run()
    metrics = EngineMetrics("qwen3-offload")
    metrics.record([], tracker.make())
    return metrics.render().decode()


def _value(text: str, name: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(name + "{"))
    return float(line.rsplit(" ", 1)[1])


def _check_idle(llm: LLM) -> None:
    core = llm.engine.engine_core
    kv = core.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks - 1 and not kv.req_to_blocks
    off = core.scheduler.offload
    if off is not None:
        assert off.idle_figures() == {
            "pinned_slots": 0, "storing_slots": 0, "jobs_in_flight": 0, "requests_loading": 0,
        }  # fmt: skip
        assert core.executor.worker.model_runner.kv_offload.num_in_flight == 0


@pytest.fixture(scope="module")
def reference(qwen3_dir: Path) -> tuple[LLM, list[list[int]]]:
    """The reference keeps every prefix on the device: its second round hits the device's
    prefix cache where the offloading engine (64 blocks of 16: about two of the six prefixes)
    loads the same KV from the CPU pool, and both compute the same suffix on it."""
    ref = LLM(**_COMMON, model=str(qwen3_dir), num_gpu_blocks_override=256)
    want = _workload(ref)
    _check_idle(ref)
    return ref, want


@pytest.mark.parametrize(
    ("policy", "store", "overlap"),
    [("lru", "evicted", False), ("arc", "full", True)],
)
def test_offload_on_cuda_gives_the_same_greedy_output_with_cpu_hits(
    qwen3_dir: Path,
    reference: tuple[LLM, list[list[int]]],
    policy: str,
    store: str,
    overlap: bool,
) -> None:
    ref, want = reference
    llm = LLM(
        **_COMMON,
        model=str(qwen3_dir),
        num_gpu_blocks_override=64,
        cpu_offload_gb=0.25,
        offload_policy=policy,
        offload_store=store,
        offload_overlap=overlap,
    )
    offload = llm.engine.engine_core.scheduler.offload
    if overlap:  # at this scale: 24-block hits met from both ends, computed 4 blocks a step
        offload.overlap_chunk = 4
    medium = llm.engine.engine_core.executor.worker.model_runner.kv_offload
    assert medium.cpu.is_pinned() and medium.stacked is not None  # one copy kernel a chunk
    got: list[list[int]] = []
    text = _metrics_text(llm, lambda: got.extend(_workload(llm)))
    stats = offload.stats_total
    # Rounds two and three find each prefix's 24 blocks in the CPU pool, but for the few the
    # device still holds; with overlap the device computes the first of them meanwhile.
    assert stats.loaded_blocks >= (6 * 4 if overlap else 6 * 20)
    assert stats.cpu_hit_tokens == 16 * stats.loaded_blocks
    assert _value(text, "pagoda:kv_offload_loaded_blocks_total") == stats.loaded_blocks
    assert _value(text, "pagoda:cpu_prefix_cache_hits_total") == stats.cpu_hit_tokens
    assert _value(text, "pagoda:kv_offload_stored_blocks_total") == stats.stored_blocks > 0
    assert medium.copied["load_blocks"] == stats.loaded_blocks and medium.copied["load_s"] > 0
    assert got[:12] == want[:12]  # one request at a time: the same computation, bit for bit
    for prompt, w, g in zip(_prompts()[12:], want[12:], got[12:]):
        check_same_or_near_tie(ref, prompt, w, g)  # the burst batches differently
    _check_idle(llm)
