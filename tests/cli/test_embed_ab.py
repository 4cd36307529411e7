"""``benchmarks/embed_ab.py`` on a tiny random Llama on the CPU: the two settings of a module
attribute take turns (A B B A ...), each timed ``--reps`` times, the attribute is back as it was
after, and a setting that does not exist stops it with its name."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "benchmarks" / "configs" / "tiny-llama"


def _script():
    spec = importlib.util.spec_from_file_location("embed_ab", ROOT / "benchmarks" / "embed_ab.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_settings_take_turns_and_the_attribute_is_restored(tmp_path, monkeypatch) -> None:
    import pagoda.ops as ops
    from pagoda.models import llama

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[bool] = []
    real = llama.linear_add_

    def spy(residual, x, weight):
        seen.append(ops.RESIDUAL_IN_EPILOGUE)  # the setting the engine read at this call
        return real(residual, x, weight)

    monkeypatch.setattr(llama, "linear_add_", spy)
    before = ops.RESIDUAL_IN_EPILOGUE
    out = tmp_path / "ab.json"
    report = _script().main(
        ["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE", "--config", str(TINY), "--device", "cpu"]
        + ["--num-prompts", "4", "--input-len", "16", "--max-model-len", "64", "--reps", "2"]
        + ["--warm-s", "0", "--output-json", str(out)]
    )
    assert ops.RESIDUAL_IN_EPILOGUE is before
    assert json.loads(out.read_text()) == report
    runs = report["runs_s"]
    assert list(runs) == ["RESIDUAL_IN_EPILOGUE=True", "RESIDUAL_IN_EPILOGUE=False"]
    assert all(len(r) == 2 and min(r) > 0 for r in runs.values())
    first, second = (report["median_s"][n] for n in runs)  # (rounded to 10 us)
    ratios = report["over_first"]
    assert ratios["RESIDUAL_IN_EPILOGUE=True"] == 1.0
    assert ratios["RESIDUAL_IN_EPILOGUE=False"] == pytest.approx(second / first, rel=0.01)
    assert report["clocks"] is None  # (a CPU: nothing sampled)
    # Both settings reached the model, in turns: warm-up A, B, then A B, B A.
    changes = [v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]
    assert changes == [True, False, True, False, True]


def test_three_settings_take_turns_forth_and_back(tmp_path, monkeypatch) -> None:
    import pagoda.ops as ops
    from pagoda.models import llama

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[int] = []
    real = llama.linear_add_

    def spy(residual, x, weight):
        seen.append(ops.RESIDUAL_IN_EPILOGUE_MIN_ROWS)
        return real(residual, x, weight)

    monkeypatch.setattr(llama, "linear_add_", spy)
    report = _script().main(
        ["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE_MIN_ROWS", "--values", "1, 2, 3"]
        + ["--config", str(TINY), "--device", "cpu", "--num-prompts", "2", "--input-len", "8"]
        + ["--max-model-len", "64", "--reps", "2", "--warm-s", "0"]
        + ["--output-json", str(tmp_path / "ab.json")]
    )
    assert list(report["over_first"]) == [f"RESIDUAL_IN_EPILOGUE_MIN_ROWS={v}" for v in (1, 2, 3)]
    changes = [v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]
    assert changes == [1, 2, 3, 1, 2, 3, 2, 1]  # warm-up, then forth and back


def test_a_setting_that_does_not_exist_or_fewer_than_two_values_are_named() -> None:
    with pytest.raises(SystemExit, match="has no attribute 'NO_SUCH'"):
        _script().main(["--toggle", "pagoda.ops:NO_SUCH", "--config", str(TINY)])
    for bad in ("True", "(1, 2", "[4]"):
        with pytest.raises(SystemExit, match="two or more Python literals"):
            _script().main(["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE", "--values", bad])


def test_call_llm_times_llm_embed(tmp_path, monkeypatch) -> None:
    """``--call llm`` times ``LLM.embed`` (the issue's GPU test's call), its prompts built
    before the clock starts; the default times the engine's steps alone."""
    from pagoda import LLM

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    calls: list[int] = []
    real = LLM.embed

    def spy(self, prompts, *args, **kwargs):
        calls.append(len(prompts))
        assert all(set(p) == {"prompt_token_ids"} for p in prompts)
        return real(self, prompts, *args, **kwargs)

    monkeypatch.setattr(LLM, "embed", spy)
    argv = ["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE", "--config", str(TINY)]
    argv += ["--device", "cpu", "--num-prompts", "3", "--input-len", "8", "--max-model-len", "64"]
    argv += ["--reps", "2", "--warm-s", "0", "--output-json", str(tmp_path / "ab.json")]
    report = _script().main(argv + ["--call", "llm"])
    assert report["call"] == "llm"
    assert calls == [3] * 6  # a warm-up call a setting, then two of each
    calls.clear()
    assert _script().main(argv)["call"] == "loop" and calls == []


def test_several_attributes_are_set_together(tmp_path, monkeypatch) -> None:
    """Two ``--toggle``: each value a pair, both attributes set at each call (the model sees
    the pairs given, never one attribute's value with the other's of another pair), both
    restored after; a value that is not a pair stops it."""
    import pagoda.ops as ops
    from pagoda.models import llama

    monkeypatch.setenv("PAGODA_CACHE_DIR", str(tmp_path / "cache"))
    seen: list[tuple] = []
    real = llama.linear_add_

    def spy(residual, x, weight):
        seen.append((ops.RESIDUAL_IN_EPILOGUE, ops.RESIDUAL_IN_EPILOGUE_MIN_ROWS))
        return real(residual, x, weight)

    monkeypatch.setattr(llama, "linear_add_", spy)
    before = (ops.RESIDUAL_IN_EPILOGUE, ops.RESIDUAL_IN_EPILOGUE_MIN_ROWS)
    toggles = ["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE"]
    toggles += ["--toggle", "pagoda.ops:RESIDUAL_IN_EPILOGUE_MIN_ROWS"]
    common = ["--config", str(TINY), "--device", "cpu", "--num-prompts", "2"]
    common += ["--input-len", "8", "--max-model-len", "64", "--reps", "2", "--warm-s", "0"]
    common += ["--output-json", str(tmp_path / "ab.json")]
    report = _script().main(toggles + ["--values", "(True, 7), (False, 9)"] + common)
    assert (ops.RESIDUAL_IN_EPILOGUE, ops.RESIDUAL_IN_EPILOGUE_MIN_ROWS) == before
    assert report["toggle"] == [
        "pagoda.ops:RESIDUAL_IN_EPILOGUE",
        "pagoda.ops:RESIDUAL_IN_EPILOGUE_MIN_ROWS",
    ]
    assert list(report["over_first"]) == [
        "RESIDUAL_IN_EPILOGUE=True, RESIDUAL_IN_EPILOGUE_MIN_ROWS=7",
        "RESIDUAL_IN_EPILOGUE=False, RESIDUAL_IN_EPILOGUE_MIN_ROWS=9",
    ]
    assert set(seen) == {(True, 7), (False, 9)}
    changes = [v for i, v in enumerate(seen) if i == 0 or v != seen[i - 1]]
    assert changes == [(True, 7), (False, 9), (True, 7), (False, 9), (True, 7)]
    with pytest.raises(SystemExit, match="a tuple of 2"):
        _script().main(toggles + ["--values", "(True, 7), False"] + common)
