"""What the data-parallel tests share: engine settings, 32 prompts, greedy sampling."""

from __future__ import annotations

from pagoda import SamplingParams

SETTINGS = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory_bytes": 16 << 20}
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
SUBJECTS = ["rivers", "bread", "chess", "owls", "glass", "tides", "maps", "bees"]
FORMS = ["Tell me about {}.", "A short poem on {}:", "Why do people study {}?", "{} are"]
PROMPTS = [f.format(s) for s in SUBJECTS for f in FORMS]  # 32 prompts
