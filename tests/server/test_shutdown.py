"""SIGTERM on ``pagoda serve``: no new requests; those in flight finish within the grace period;
the ones still running then end with a clear 503 (in-band on a stream); the process exits with 0
and leaves no engine process behind."""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
from serverkit import Server

GRACE_S = 1.5


def _stream(server: Server, max_tokens: int, first: threading.Event, out: dict) -> None:
    body = {"prompt": "Count", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    events = []
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json=body, headers=server.headers, timeout=120
    ) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                first.set()
    out["events"] = events


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_sigterm_lets_requests_finish_then_ends_the_rest_and_leaves_no_process(tiny_model):
    server = Server(
        "--model", str(tiny_model), "--load-format", "dummy",
        "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
        "--shutdown-grace-s", str(GRACE_S),
        engine_flags=False,
    )  # fmt: skip
    try:
        engine = server.engine_pid()
        short, long = {}, {}
        short_started, long_started = threading.Event(), threading.Event()
        threads = [
            threading.Thread(target=_stream, args=(server, 2040, long_started, long)),
            threading.Thread(target=_stream, args=(server, 24, short_started, short)),
        ]
        for t in threads:
            t.start()
        assert long_started.wait(60) and short_started.wait(60)
        server.proc.send_signal(signal.SIGTERM)
        sent = time.monotonic()
        time.sleep(0.3)
        try:  # the listening socket is closed: nothing new is taken
            refused = httpx.get(f"{server.url}/health", timeout=5).status_code != 200
        except httpx.HTTPError:
            refused = True
        assert refused
        for t in threads:
            t.join(60)
        assert server.proc.wait(30) == 0
        exited = time.monotonic() - sent
    finally:
        server.stop()
    # In flight and short enough: finished normally within the grace period.
    assert short["status"] == 200 and short["events"][-1] == "[DONE]"
    chunks = [json.loads(e) for e in short["events"][:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert not any("error" in c for c in chunks)
    # Still running when the grace period ran out: ended with a clear error, then [DONE].
    assert long["status"] == 200 and long["events"][-1] == "[DONE]"
    error = json.loads(long["events"][-2])["error"]
    assert error["code"] == "server_shutting_down" and "shutting down" in error["message"]
    assert not any(
        c.get("choices") and c["choices"][0].get("finish_reason") == "length"
        for c in map(json.loads, long["events"][:-2])
    ), "the long request was not ended early: make it longer"
    assert GRACE_S <= exited < GRACE_S + 20
    deadline = time.monotonic() + 10
    while _alive(engine) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(engine), "the engine process outlived the server"
    log = server.log.read_text()
    assert "ending 1 requests still in flight" in log and "stopped" in log
