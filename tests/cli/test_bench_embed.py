"""``pagoda bench embed`` on a tiny random Qwen3 (built from a config.json, on the CPU): both
engines' rates, the two engines' embeddings of the same prompts agreeing, and with
``--profile`` where a further call's time went (on a CPU: operators by their own time)."""

from __future__ import annotations

import json

from pagoda.entrypoints.cli import main

TINY_QWEN3 = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def test_bench_embed_reports_both_engines_and_a_profile(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    config = tmp_path / "tiny-qwen3"
    config.mkdir()
    (config / "config.json").write_text(json.dumps(TINY_QWEN3))
    report = tmp_path / "embed.json"
    args = ["bench", "embed", "--random-weights", str(config), "--num-prompts", "6"]
    args += ["--input-len", "24", "--max-model-len", "128", "--st-batch-size", "4"]
    assert main([*args, "--profile", "--device", "cpu", "--output-json", str(report)]) == 0
    got = json.loads(report.read_text())
    results = got["results"]
    assert got["pooling"] == "LAST" and got["workload"] == {"num_prompts": 6, "input_len": 24}
    for engine in ("pagoda", "sentence_transformers"):
        assert results[engine]["elapsed_s"] > 0 and results[engine]["requests_per_s"] > 0
    assert results["min_cosine"] > 0.999  # the same last-token embeddings, both engines
    profile = results["pagoda_profile"]
    ops = profile["operators"]
    assert profile["wall_ms"] > 0 and ops and all(o["ms"] > 0 for o in ops)
    assert [o["ms"] for o in ops] == sorted((o["ms"] for o in ops), reverse=True)
    assert any(o["name"].startswith("aten::") for o in ops)
    assert sum(o["ms"] for o in ops) <= profile["wall_ms"]
