"""Opt-in soak (``PAGODA_SOAK_S=600``): mixed traffic with aborts against the tiny model for that
many seconds; memory stays flat and no KV block is left held.

How memory is measured, fairly: a warm-up (a fifth of the soak, at most 60 s) first fills the
allocator pools, the model runner's buffers and the tokenizer's caches. Memory is compared at
the same point before and after the soak: idle (no request running or waiting) for a few
seconds, by when the engine has given its heap's free memory back (``pagoda.engine.heap``), so
that what is compared is what the processes keep, not what the traffic of the moment holds.
The engine's KV cache is an anonymous shared map whose pages become resident as the block pool
first writes them: a free block goes to the back of the free queue, so the pool walks through
the whole cache over minutes and the engine's RSS climbs by up to the cache's size without
anything leaking. That part (``RssShmem``) is checked on its own, against the cache's size; the
rest of each process's RSS (its private memory) must stay within 5% of its level after warm-up.
RSS is also sampled every 30 s under traffic, for the record. ``PAGODA_SOAK_JSON=<file>`` writes
the figures there."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import time
from pathlib import Path

import httpx
import pytest

SOAK_S = float(os.environ.get("PAGODA_SOAK_S", "0"))
pytestmark = pytest.mark.skipif(SOAK_S <= 0, reason="opt-in: set PAGODA_SOAK_S (seconds)")
KV_CACHE_BYTES = 64 << 20  # the tiny server's --kv-cache-memory-bytes
SAMPLE_S = 30.0
IDLE_S = 3.0  # more than the engine's idle poll (1 s), after which it trims its heap


def _memory(pid: int) -> dict[str, int]:
    """RSS and its shared-memory part (the KV cache's map), in bytes."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssShmem"):
            out[key] = int(value.split()[0]) * 1024
    return {
        "rss": out["VmRSS"],
        "shmem": out["RssShmem"],
        "private": out["VmRSS"] - out["RssShmem"],
    }


async def _traffic(server, seconds: float, seed: int) -> int:
    rng = random.Random(seed)
    done = 0
    deadline = time.monotonic() + seconds
    async with httpx.AsyncClient(headers=server.headers, timeout=120) as client:

        async def one(i: int) -> None:
            stream = rng.random() < 0.5
            if rng.random() < 0.5:
                path = "/v1/completions"
                body = {"prompt": f"soak {i} " * rng.randint(1, 50)}
            else:
                path = "/v1/chat/completions"
                body = {"messages": [{"role": "user", "content": f"soak {i}"}]}
            body.update(max_tokens=rng.randint(1, 64), stream=stream, n=rng.choice([1, 1, 2]))
            drop = rng.random() < 0.3
            async with client.stream("POST", server.url + path, json=body) as resp:
                async for _ in resp.aiter_lines():
                    if drop and rng.random() < 0.2:
                        return  # an abort, mid-stream or mid-request

        while time.monotonic() < deadline:
            await asyncio.gather(*(one(done + k) for k in range(32)))
            done += 32
    return done


def _idle_memory(server, pids: dict[str, int]) -> dict[str, dict[str, int]]:
    """Memory once no request runs or waits and the engine has been idle for a few seconds."""
    m = server.wait_idle(60)
    assert m["pagoda:num_requests_running"] == m["pagoda:num_requests_waiting"] == 0, m
    time.sleep(IDLE_S)
    return {name: _memory(pid) for name, pid in pids.items()}


def _mib(n: int) -> float:
    return round(n / 2**20, 1)


def test_soak_memory_stays_flat_and_no_block_leaks(tiny_server) -> None:
    warmup_s = min(60.0, SOAK_S / 5)
    load = [os.getloadavg()[0]]
    warm = asyncio.run(_traffic(tiny_server, warmup_s, seed=0))
    pids = {"server": tiny_server.proc.pid, "engine": tiny_server.engine_pid()}
    before = _idle_memory(tiny_server, pids)
    samples = [{"t_s": 0.0, **{n: _memory(p) for n, p in pids.items()}}]
    start = time.monotonic()
    requests, seed = 0, 1
    while (left := SOAK_S - (time.monotonic() - start)) > 0:
        requests += asyncio.run(_traffic(tiny_server, min(SAMPLE_S, left), seed=seed))
        seed += 1
        t = round(time.monotonic() - start, 1)
        samples.append({"t_s": t, **{n: _memory(p) for n, p in pids.items()}})
    after = _idle_memory(tiny_server, pids)
    m = tiny_server.metrics()
    load.append(os.getloadavg()[0])
    report = {
        "test": "tests/server/test_soak.py",
        "command": f"PAGODA_SOAK_S={SOAK_S:g} python -m pytest -q tests/server/test_soak.py",
        "commit": _commit(),
        "machine": f"{os.cpu_count()} CPU cores, 1-minute load average {load[0]:.1f} at the "
        f"start, {load[1]:.1f} at the end",
        "soak_s": SOAK_S,
        "warmup_s": warmup_s,
        "requests": {"warmup": warm, "soak": requests},
        "kv_cache_mib": _mib(KV_CACHE_BYTES),
        "memory_mib": {
            name: {
                f"{when}_{kind}": _mib(mem[name][kind])
                for when, mem in (("start", before), ("end", after))
                for kind in ("rss", "private", "shmem")
            }
            | {
                f"busy_{kind}_max": _mib(max(s[name][kind] for s in samples))
                for kind in ("rss", "private")
            }
            for name in pids
        },
        "after": {
            k: m[f"pagoda:{k}"]
            for k in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")
        },
        "busy_samples_mib": [
            {"t_s": s["t_s"]}
            | {f"{n}_{kind}": _mib(s[n][kind]) for n in pids for kind in ("private", "shmem")}
            for s in samples
        ],
    }
    print(json.dumps(report["memory_mib"], indent=1))
    if os.environ.get("PAGODA_SOAK_JSON"):
        Path(os.environ["PAGODA_SOAK_JSON"]).write_text(json.dumps(report, indent=2) + "\n")
    for name, pid in pids.items():
        b, a = before[name]["private"], after[name]["private"]
        assert a <= b * 1.05, (
            f"{name} (pid {pid}): private RSS {_mib(b)} -> {_mib(a)} MiB over {requests} requests"
        )
    # The KV cache's pages: resident once written, never more than the cache.
    assert after["engine"]["shmem"] <= KV_CACHE_BYTES + (1 << 20), after
    assert report["after"] == {
        "num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0
    }, report["after"]  # fmt: skip


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=Path(__file__).parent,
        )  # fmt: skip
    except OSError:
        return None
    dirty = subprocess.run(
        ["git", "diff", "--quiet", "HEAD", "--", "core", "tests/server"],
        cwd=Path(__file__).parent, timeout=10,
    ).returncode  # fmt: skip
    return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else None
