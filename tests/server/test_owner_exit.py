"""An ``AsyncLLM`` whose owner exits, cleanly without calling ``shutdown`` or killed outright,
leaves no engine process behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

SCRIPT = """
import asyncio, sys
from pagoda.config import EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.sampling_params import SamplingParams

llm = AsyncLLM(EngineConfig.load(overrides={
    "model": sys.argv[1], "load_format": "dummy", "max_model_len": 128,
    "kv_cache_memory_bytes": 16 << 20}))

async def main():
    async for _ in llm.generate("Hi", SamplingParams(max_tokens=2), "r"):
        pass
    global in_flight  # still running when the owner goes
    in_flight = llm.generate("Hi", SamplingParams(max_tokens=100, ignore_eos=True), "in-flight")
    await in_flight.__anext__()

asyncio.run(main())
print(llm.client.pid, flush=True)
if sys.argv[2] == "wait":
    sys.stdin.read()  # until killed
"""


def _gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours is gone too
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("how", ["exits", "is killed"])
def test_no_engine_process_outlives_its_owner(tiny_model, how: str) -> None:
    mode = "exit" if how == "exits" else "wait"
    owner = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(tiny_model), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
    )
    assert owner.stdout is not None
    engine = int(owner.stdout.readline())
    if mode == "wait":
        owner.send_signal(signal.SIGKILL)
    owner.wait(60)
    assert _gone(engine), f"engine process {engine} outlived its owner, which {how}"
