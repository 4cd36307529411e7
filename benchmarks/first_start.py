"""Time from `pagoda serve`'s process start to its first answered request, twice.

The first start is meant for a fresh machine (no FlashInfer or Triton compile caches): with
`attention.backend: auto` the engine starts on a backend whose kernels are ready and compiles
FlashInfer's in the background. The script waits for that compile to finish, stops the server,
and starts it again: the second start finds FlashInfer built and picks it. For each start it
reports seconds to `/health` answering 200 and to the first completion answered, the attention
backend chosen, and the log lines about compiling.

    python benchmarks/first_start.py --random-weights benchmarks/configs/qwen3-0.6b \\
        --output-json results/first-start.json

The model's weights are built (or a model is given) before the clock starts: a model on disk is
the start's precondition, not part of it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 2.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except (urllib.error.URLError, OSError):
        return 0


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (its engine included), SIGKILL after 60 s."""
    for sig, wait in ((signal.SIGTERM, 60), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:  # the group is gone already
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def one_start(model: str, extra: list[str], log: Path, wait_compile_s: float) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "pagoda.entrypoints.cli", "serve", "--model", model]
    cmd += ["--port", str(port), *extra]
    t0 = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    row: dict[str, Any] = {"command": " ".join(cmd[1:])}
    try:
        while _get(base + "/health") != 200:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}; see {log}")
            if time.perf_counter() - t0 > 600:
                raise RuntimeError("the server was not healthy within 600 s")
            time.sleep(0.05)
        row["health_s"] = round(time.perf_counter() - t0, 2)
        body = {"model": model, "prompt": "The capital of France is", "max_tokens": 16}
        answer = _post(base + "/v1/completions", body)
        row["first_request_s"] = round(time.perf_counter() - t0, 2)
        row["first_text"] = answer["choices"][0]["text"]
        deadline = time.perf_counter() + wait_compile_s
        while wait_compile_s and time.perf_counter() < deadline:
            done = r"compiled in the background|background compile .* failed"
            if re.search(done, log.read_text()):
                break
            time.sleep(0.5)
    finally:
        _stop(proc)
    text = log.read_text()
    chosen = re.findall(r"attention: (\w+) \(attention\.backend", text)
    row["attention_backend"] = chosen[-1] if chosen else None
    row["compile_log"] = [
        line.split("] ", 1)[-1] for line in text.splitlines() if "attention:" in line
    ]
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="a model folder (else --random-weights)")
    p.add_argument("--random-weights", default="benchmarks/configs/qwen3-0.6b")
    p.add_argument("--starts", type=int, default=2, help="starts in a row (default 2)")
    p.add_argument("--wait-compile-s", type=float, default=240, help="after the first request")
    p.add_argument("--output-json", required=True)
    p.add_argument("extra", nargs="*", help="more `pagoda serve` options, after --")
    args = p.parse_args()
    model = args.model
    if model is None:
        import torch

        from pagoda.bench.random_weights import ensure_random_weights

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        folder, _ = ensure_random_weights(Path(args.random_weights), 0, device)
        model = str(folder)
    out = Path(args.output_json)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.starts):
        log = out.with_suffix(f".start{i + 1}.log")
        wait = args.wait_compile_s if i + 1 < args.starts else 0
        rows.append(one_start(model, args.extra, log, wait))
        r = rows[-1]
        print(
            f"start {i + 1}: health {r['health_s']} s, first request {r['first_request_s']} s, "
            f"attention {r['attention_backend']}",
            flush=True,
        )
        for line in r["compile_log"]:
            print("   ", line)
    from pagoda.bench.report import commit

    report = {
        "benchmark": "first_start",
        "model": args.model or Path(args.random_weights).name + " (random weights)",
        "commit": os.environ.get("PAGODA_COMMIT") or commit(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "starts": rows,
    }
    try:
        import torch

        report["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:  # noqa: BLE001 - the figure stands without the name
        pass
    out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
