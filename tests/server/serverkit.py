"""A real ``pagoda serve`` on loopback (SmolLM2, CPU), started and inspected by the tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

API_KEY = "test-key"
MAX_MODEL_LEN = 1024
_START_TIMEOUT_S = 240


class Server:
    def __init__(
        self, *extra: str, api_key: str | None = API_KEY, engine_flags: bool = True
    ) -> None:
        """``extra``: more ``pagoda serve`` arguments; ``engine_flags``: pass the context and KV
        cache size as flags (leave them to a ``--config`` file in ``extra`` otherwise)."""
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        args = [
            sys.executable, "-m", "pagoda.entrypoints.cli", "serve",
            "--host", "127.0.0.1", "--port", str(self.port),
            *(["--max-model-len", str(MAX_MODEL_LEN)] if engine_flags else []),
            *(["--kv-cache-memory-bytes", str(256 << 20)] if engine_flags else []),
            *(["--api-key", api_key] if api_key else []),
            *extra,
        ]  # fmt: skip
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"pagoda-serve-{self.port}.log"
        self._log_file = open(self.log, "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(args, stdout=self._log_file, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy()

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + _START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pagoda serve exited:\n{self.log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"pagoda serve did not start:\n{self.log.read_text()[-4000:]}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_pid(self) -> int:
        """The engine process: the server's child started by multiprocessing's spawn."""
        for task in Path(f"/proc/{self.proc.pid}/task").iterdir():
            for pid in (task / "children").read_text().split():
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
                if b"spawn_main" in cmdline:
                    return int(pid)
        raise RuntimeError("the server has no engine process")

    def metrics(self) -> dict[str, float]:
        """The unlabelled-by-bucket samples of ``/metrics``: name -> value."""
        text = httpx.get(f"{self.url}/metrics", headers=self.headers, timeout=10).text
        out = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            out[name_labels.split("{")[0]] = float(value)
        return out

    def wait_idle(self, timeout: float = 60.0) -> dict[str, float]:
        """Poll ``/metrics`` until no request runs or waits and no KV block is held (or
        ``timeout`` passes); return the last metrics read."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = (
                m["pagoda:num_requests_running"] == m["pagoda:num_requests_waiting"] == 0
                and m["pagoda:kv_cache_usage_perc"] == 0
            )
            if idle or time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log_file.close()
