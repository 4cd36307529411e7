"""``pagoda serve --tensor-parallel-size 2`` answers through the OpenAI API, streaming included,
with the tokens of one rank; when a worker dies, requests in flight fail, ``/health`` answers
503 within seconds, and stopping the server leaves no process behind."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import psutil
import pytest

from pagoda import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from serverkit import Server  # noqa: E402

pytestmark = pytest.mark.slow

PROMPT = "a b c d"


def test_serve_at_two_ranks_streams_one_ranks_tokens_and_fails_cleanly(tiny_models) -> None:
    model = str(tiny_models["qwen3"])
    ref = LLM(model=model, dtype="float32", max_model_len=256, kv_cache_memory_bytes=16 << 20)
    want = ref.generate(
        [PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0].outputs[0]
    ref.engine.shutdown()

    srv = Server(
        model,
        "--tensor-parallel-size", "2",
        "--dtype", "float32",
        "--max-model-len", "256",
        "--kv-cache-memory-bytes", str(16 << 20),
        api_key=None,
        engine_flags=False,
    )  # fmt: skip
    try:
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0)
        name = client.models.list().data[0].id
        body = dict(model=name, prompt=PROMPT, max_tokens=12, temperature=0.0)
        whole = client.completions.create(**body, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == want.text and whole.usage.completion_tokens == 12
        stream = client.completions.create(**body, stream=True, extra_body={"ignore_eos": True})
        chunks = list(stream)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text

        engine = psutil.Process(srv.engine_pid())
        workers = engine.children()
        assert len(workers) == 2, [w.cmdline() for w in workers]
        every = [psutil.Process(srv.proc.pid), engine, *workers]

        failed: list[BaseException] = []

        def long_request() -> None:
            try:
                client.completions.create(
                    **{**body, "max_tokens": 240}, extra_body={"ignore_eos": True}
                )
            except BaseException as e:
                failed.append(e)

        t = threading.Thread(target=long_request)
        t.start()
        time.sleep(0.5)
        os.kill(workers[1].pid, signal.SIGKILL)
        killed = time.monotonic()
        t.join(15)
        assert failed and isinstance(failed[0], openai.APIError), failed
        while httpx.get(f"{srv.url}/health", timeout=5).status_code != 503:
            assert time.monotonic() - killed < 10, "/health still answers 200"
            time.sleep(0.2)
    finally:
        srv.stop()
    _, alive = psutil.wait_procs(every, timeout=10)
    assert alive == [], f"left behind: {alive}"
