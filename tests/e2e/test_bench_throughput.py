"""``pagoda bench throughput`` end to end on the smoke workload: a tiny random model on a CPU,
Pagoda and both transformers peers on the same weights and prompts, and the roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pagoda.bench.workloads import PRESETS, make_output_lens
from pagoda.entrypoints.cli import main

ENGINES = ("pagoda", "transformers_cb", "transformers_static")


@pytest.fixture
def bench_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: threads only wait for each other on a busy machine
    yield tmp_path
    torch.set_num_threads(threads)


def _bench(tmp: Path, name: str, *flags: str) -> dict:
    out = tmp / f"{name}.json"
    argv = ["bench", "throughput", "--workload", "smoke", *flags, "--output-json", str(out)]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_smoke_workload_runs_every_engine_on_the_same_exact_work(bench_env: Path) -> None:
    report = _bench(bench_env, "first", "--roofline")
    smoke = PRESETS["smoke"]
    want = sum(make_output_lens(smoke.num_prompts, *smoke.output_len, seed=0))
    results = report["results"]
    for name in ENGINES:
        r = results[name]
        assert "error" not in r, r.get("error")
        assert r["exact_output_lengths"] is True, name
        assert r["output_tokens"] == want and r["num_prompts"] == smoke.num_prompts
        assert r["reduced"] is False and r["output_tokens_per_s"] > 0 and r["load_s"] >= 0
        if name != "pagoda":
            ratio = results["pagoda"]["output_tokens_per_s"] / r["output_tokens_per_s"]
            assert results[f"pagoda_over_{name}"] == pytest.approx(ratio, rel=1e-2)
    assert report["weights"]["source"] == "random" and report["weights"]["built"] is True
    assert report["workload"]["name"] == "smoke" and report["model"] == "tiny-llama"
    assert report["engine_config"]["scheduler"]["max_num_seqs"] == 8  # from the preset
    assert report["startup"]["engine_s"] > 0
    for key in ("commit", "torch", "transformers", "hardware", "device"):
        assert report[key]
    rows = {row["batch"]: row for row in report["roofline"]["rows"]}
    assert set(rows) == set(smoke.roofline_batches)
    for row in rows.values():
        assert row["steps"] > 0 and 0 < row["floor_ms"] and row["step_over_floor"] > 0
    assert report["roofline"]["copy_bandwidth_GBps"] > 0
    assert report["decode_at_full_batch"]["batch"] == smoke.num_prompts


def test_second_run_reuses_the_random_weights_and_reports_a_reduced_peer(
    bench_env: Path,
) -> None:
    first = _bench(bench_env, "first", "--peers", "none", "--no-roofline")
    folder = Path(first["weights"]["path"])
    assert first["weights"]["built"] is True and folder.is_relative_to(bench_env / "cache")
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    second = _bench(bench_env, "second", "--peers", "cb", "--peer-num-prompts", "3")
    assert second["weights"]["built"] is False and second["weights"]["path"] == str(folder)
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp
    cb = second["results"]["transformers_cb"]
    assert cb["reduced"] is True and cb["num_prompts"] == 3 and cb["exact_output_lengths"]
    assert "transformers_static" not in second["results"] and second["roofline"] is None
