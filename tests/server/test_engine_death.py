"""If the engine process dies, every request in flight ends with an error within 5 s, and the
server says it is unhealthy instead of hanging."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from serverkit import Server

ERROR_DEADLINE_S = 5.0


@pytest.fixture(scope="module")
def doomed_server(tmp_path_factory, smollm2_gguf):
    config = tmp_path_factory.mktemp("doomed") / "engine.yaml"
    config.write_text(
        "model: {max_model_len: 1536}\n"
        "cache: {kv_cache_memory_bytes: 134217728}\n"
        "server: {served_model_name: doomed, port: 1}\n"  # the --port flag wins over the file
    )
    # `pagoda serve MODEL --config FILE`, the model given as the positional argument.
    srv = Server(str(smollm2_gguf), "--config", str(config), api_key=None, engine_flags=False)
    yield srv
    srv.stop()


def test_killed_engine_fails_requests_in_flight_and_health(doomed_server: Server) -> None:
    srv = doomed_server
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="none", max_retries=0, timeout=120)
    models = client.models.list().data
    model = models[0].id
    assert model == "doomed" and models[0].model_extra["max_model_len"] == 1536
    long = {"max_tokens": 900, "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    ended: dict[str, tuple[float, BaseException | None]] = {}
    streaming = threading.Event()

    def stream(name: str) -> None:
        try:
            for _ in client.completions.create(model=model, prompt=name, stream=True, **long):
                streaming.set()
            ended[name] = (time.monotonic(), None)
        except Exception as e:
            ended[name] = (time.monotonic(), e)

    def whole(name: str) -> None:
        try:
            client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": name}], **long
            )
            ended[name] = (time.monotonic(), None)
        except Exception as e:
            ended[name] = (time.monotonic(), e)

    names = ["stream one", "stream two", "stream three", "whole one", "whole two"]
    threads = [
        threading.Thread(target=stream if n.startswith("stream") else whole, args=(n,))
        for n in names
    ]
    for t in threads:
        t.start()
    assert streaming.wait(60), "no stream started"
    deadline = time.monotonic() + 30
    while srv.metrics()["pagoda:num_requests_running"] < len(names):
        assert time.monotonic() < deadline, "the requests did not all start"
        time.sleep(0.1)

    os.kill(srv.engine_pid(), signal.SIGKILL)
    killed = time.monotonic()
    for t in threads:
        t.join(ERROR_DEADLINE_S + 5)
    assert set(ended) == set(names), "a request hangs after the engine died"
    for name, (when, error) in ended.items():
        assert isinstance(error, openai.APIError), (name, error)
        assert when - killed < ERROR_DEADLINE_S, (name, when - killed)
    whole_error = ended["whole one"][1]
    assert isinstance(whole_error, openai.APIStatusError) and whole_error.status_code == 503

    health = httpx.get(f"{srv.url}/health", timeout=10)
    assert health.status_code == 503 and "engine" in health.json()["error"]["message"]
    with pytest.raises(openai.APIStatusError) as refused:
        client.completions.create(model=model, prompt="Hi", max_tokens=2)
    assert refused.value.status_code == 503
