"""A tensor-parallel worker that dies or hangs fails the requests in flight within seconds, with
an error naming it, and no process is left behind: not after that, not after Ctrl-C, not after
the engine's own process is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from pagoda import LLM, SamplingParams
from pagoda.executor.workers import WorkerFailedError

pytestmark = pytest.mark.slow

DEADLINE_S = 10.0


def _engine(model: Path) -> LLM:
    return LLM(
        model=str(model),
        tensor_parallel_size=2,
        executor="multiproc",
        dtype="float32",
        max_model_len=512,
        kv_cache_memory_bytes=16 << 20,
    )


def _gone(pids: list[int], timeout_s: float = 5.0) -> bool:
    """No process of ``pids`` runs, and none is a zombie."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                psutil.Process(pid).status()  # a zombie (not reaped) counts as left behind
                alive.append(pid)
            except psutil.NoSuchProcess:
                pass
        if not alive:
            return True
        time.sleep(0.1)
    return False


def _step_until_error(llm: LLM, action) -> tuple[float, BaseException]:
    engine = llm.engine
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": [5 + i, 6, 7]}, params)
    for _ in range(3):  # prefill and the first decodes
        engine.step()
    action()
    start = time.monotonic()
    with pytest.raises(WorkerFailedError) as caught:
        while engine.has_unfinished_requests():
            engine.step()
    return time.monotonic() - start, caught.value


def test_a_killed_worker_fails_generation_within_seconds_and_leaves_no_process(
    tiny_models,
) -> None:
    # (processes an earlier test of this process left running, a server fixture's, are not
    # this engine's)
    earlier = {p.pid for p in psutil.Process().children(recursive=True)}
    llm = _engine(tiny_models["llama"])
    executor = llm.engine.engine_core.executor
    pids = list(executor.worker_pids)
    took, error = _step_until_error(llm, lambda: os.kill(pids[1], signal.SIGKILL))
    assert took < DEADLINE_S
    assert "rank 1" in str(error) and str(pids[1]) in str(error)
    assert _gone(pids), "a worker process is left after the failure"
    with pytest.raises(WorkerFailedError):  # the engine stays failed
        llm.engine.step()
    llm.engine.shutdown()
    left = [p.cmdline() for p in psutil.Process().children(recursive=True) if p.pid not in earlier]
    # NOTE: multiprocessing's resource tracker lives as long as this interpreter.
    assert [c for c in left if not any("resource_tracker" in part for part in c)] == []


def test_a_hung_worker_fails_generation_and_is_killed(tiny_models) -> None:
    llm = _engine(tiny_models["qwen3"])
    executor = llm.engine.engine_core.executor
    executor._timeout_s = 3.0  # the step limit, shortened for the test
    pids = list(executor.worker_pids)
    took, error = _step_until_error(llm, lambda: os.kill(pids[0], signal.SIGSTOP))
    assert took < DEADLINE_S
    assert "rank 0" in str(error) and "hangs" in str(error)
    assert _gone(pids), "a stopped worker is left after the failure"
    llm.engine.shutdown()


SCRIPT = """
import faulthandler, signal, sys, time
from pagoda import LLM, SamplingParams

if __name__ == "__main__":
    # (where it hangs, if it does: every thread's stack on SIGUSR1, to the file the test reads)
    faulthandler.register(signal.SIGUSR1, file=open(sys.argv[2], "w"), all_threads=True)
    llm = LLM(model=sys.argv[1], tensor_parallel_size=2, executor="multiproc", dtype="float32",
              max_model_len=512, kv_cache_memory_bytes=16 << 20)
    ex = llm.engine.engine_core.executor
    print(" ".join(map(str, ex.worker_pids)), flush=True)
    print(signal.getsignal(signal.SIGINT), flush=True)
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    while True:
        llm.generate(["a b c"] * 4, params, use_tqdm=False)
"""


@pytest.mark.parametrize(
    "how",
    [
        # An open bug: in four fresh-checkout runs of the whole suite on 2 CPUs the engine did
        # not exit within 20 s (nor 60 s) of a Ctrl-C; it exits at once whenever this file, or
        # tests/distributed with tests/cli and tests/config, runs alone. Not strict: it still
        # runs, and reports XPASS when the engine exits.
        pytest.param(
            "ctrl-c",
            marks=pytest.mark.xfail(
                strict=False, reason="engine sometimes hangs on Ctrl-C in the full CPU suite"
            ),
        ),
        "killed",
    ],
)
def test_no_worker_outlives_its_engine(tiny_models, tmp_path, how: str) -> None:
    script = tmp_path / "engine.py"
    script.write_text(textwrap.dedent(SCRIPT))
    stacks = tmp_path / "stacks.txt"
    proc = subprocess.Popen(
        [sys.executable, str(script), str(tiny_models["llama"]), str(stacks)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group, as a terminal gives a command
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2, "the engine did not start"
        # (a SIGINT the test's own process ignores is ignored by the engine it starts too)
        sigint = proc.stdout.readline().strip()
        time.sleep(1.0)  # generating
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        else:
            proc.kill()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
            raise AssertionError(
                f"the engine did not exit within 20 s ({how}; its SIGINT handler: {sigint}); "
                f"its threads:\n{stacks.read_text()}"
            ) from None
        assert _gone(pids, timeout_s=10), f"workers {pids} outlive the engine ({how})"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
