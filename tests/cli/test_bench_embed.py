"""``pagoda bench embed`` on a tiny random Llama (built from a config.json, on the CPU): both
engines' rates, the two engines' embeddings of the same prompts agreeing, and with
``--profile`` where a further call's time went (on a CPU: operators by their own time)."""

from __future__ import annotations

import json
from pathlib import Path

from pagoda.entrypoints.cli import main

# (the benchmarks' own tiny config: a Llama, run as a last-token embedder)
TINY = Path(__file__).resolve().parents[2] / "benchmarks" / "configs" / "tiny-llama"


def test_bench_embed_reports_both_engines_and_a_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    report = tmp_path / "embed.json"
    args = ["bench", "embed", "--random-weights", str(TINY), "--num-prompts", "6"]
    args += ["--input-len", "24", "--max-model-len", "128", "--st-batch-size", "4"]
    assert main([*args, "--profile", "--device", "cpu", "--output-json", str(report)]) == 0
    got = json.loads(report.read_text())
    results = got["results"]
    assert got["pooling"] == "LAST" and got["workload"] == {"num_prompts": 6, "input_len": 24}
    assert got["attention_backend"] == "torch_native"  # (a CPU without the interpreter)
    assert got["repeats"] == 3
    # (a CPU: no clocks sampled, for either engine)
    assert got["clocks"] == {"pagoda": None, "sentence_transformers": None}
    for engine in ("pagoda", "sentence_transformers"):
        assert results[engine]["elapsed_s"] > 0 and results[engine]["requests_per_s"] > 0
        runs = results[engine]["runs_s"]  # each run's time; the rates are at their median
        assert len(runs) == 3 and abs(results[engine]["elapsed_s"] - sorted(runs)[1]) < 1e-3
    assert results["min_cosine"] > 0.999  # the same last-token embeddings, both engines
    profile = results["pagoda_profile"]
    ops = profile["operators"]
    assert profile["wall_ms"] > 0 and ops and all(o["ms"] > 0 for o in ops)
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert any(o["name"].startswith("aten::") for o in ops)
    assert sum(o["ms"] for o in ops) <= profile["wall_ms"]
    # Each step's host phases, in order, inside the call: 6 prompts run as one step (and the
    # step that reads it), each scheduled, launched and read.
    phases = profile["host_phases"]
    names = [p[0] for p in phases]
    assert {"schedule", "launch", "after_launch", "finish"} <= set(names)
    assert names.index("schedule") < names.index("launch") < names.index("finish")
    assert all(0 <= s <= e <= profile["wall_ms"] for _, s, e in phases)
    assert [s for _, s, _ in phases] == sorted(s for _, s, _ in phases)
