"""benchmarks/spec_decode.py ``--all-accepted`` on a CPU: random weights whose final norm is zero
repeat one token, so every n-gram draft is accepted, the outputs equal the plain engine's and
the speculating engine takes a fraction of its steps (what is left is the cost of speculating,
which the benchmark then measures), ``--host-path``'s report of the host's parts, and
``--plain-overhead``'s of both engines' plain steps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).parents[2]


def test_all_accepted_drafts_are_every_one_accepted(tmp_path) -> None:
    out = tmp_path / "spec.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "spec_decode.py"), "--device", "cpu"]
    cmd += ["--random-weights", str(ROOT / "benchmarks" / "configs" / "tiny-llama")]
    cmd += ["--all-accepted", "--prompts", "random", "--num-prompts", "2", "--input-len", "32"]
    cmd += ["--max-tokens", "64", "--max-model-len", "512", "--method", "ngram"]
    # NOTE: a fixed draft length and no governor: nothing chosen from timings. At the
    # proposer's own lengths the draft-cost model times the steps, and on a loaded host one slow
    # step read as a dear draft token once cut the drafts to one or two (58 steps where 30 are
    # usual); the harness is tested here, not that model.
    cmd += [
        "--num-speculative-tokens",
        "4",
        "--no-adaptive",
        "--host-path",
        "--plain-overhead",
        "2",
    ]
    env = {**os.environ, "PAGODA_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*cmd, "--output-json", str(out)], capture_output=True, text=True, env=env, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert "every draft accepted" in report["model"]
    assert report["acceptance_rate"] == 1.0 and report["greedy_outputs_identical"]
    steps = report["engine_steps"]
    assert steps["spec"]["steps"] * 3 < steps["off"]["steps"]
    # Why slot steps went without drafts: every request asked is counted once, by outcome.
    asked = report["proposals"]
    assert asked["asked"] == asked["drafted"] + asked["no_match"] + asked["not_worth"]
    assert asked["drafted"] >= report["drafts"] > 0
    assert 0.05 <= report["draft_cost"]["threshold"] <= 0.9
    assert set(report["slot_cost"]) == {
        "waited_ms", "waited_steps", "plain_ms", "plain_steps", "cost"
    }  # fmt: skip
    # --host-path: each engine's parts timed over one more pass; the proposer's calls on the
    # spec engine's only; no late drafts on a CPU (no verification graphs), so no cycle.
    path = report["host_path"]
    for name in ("off", "spec"):
        assert path[name]["calls"]["schedule"] == path[name]["calls"]["engine_step"] > 0
        assert path[name]["median_us"]["launch"] > 0
    assert path["spec"]["calls"]["proposer.propose"] > 0
    assert "proposer.propose" not in path["off"]["calls"]
    assert path["spec"]["late_launches"] == 0
    # --plain-overhead: two more passes on each engine, the spec engine's drafting held off
    # (every draft would be accepted here: a pass that drafted would take a fraction of the
    # steps, and its proposer's calls would show).
    over = report["plain_overhead"]
    assert over["passes"] == 2 and all(len(v) == 2 for v in over["pass_seconds"].values())
    assert all(len(v) == 2 for v in over["untimed_pass_seconds"].values())
    untimed = {k: float(np.median(v)) for k, v in over["untimed_pass_seconds"].items()}
    assert over["spec_over_off_median_untimed_pass"] == round(untimed["spec"] / untimed["off"], 4)
    for name in ("off", "spec"):
        assert over["steps"][name] > 0 and over["median_us"][name]["schedule"] > 0
    assert over["steps"]["spec"] == over["steps"]["off"]
    assert "proposer.propose" not in over["median_us"]["spec"]
    assert (tmp_path / "cache" / "random-weights" / "tiny-llama-seed0-all-accepted").is_dir()
