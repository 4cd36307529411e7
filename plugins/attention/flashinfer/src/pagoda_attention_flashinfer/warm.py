"""Compile FlashInfer's kernels for one (device, dtype, head size) ahead of the first step.

``python -m pagoda_attention_flashinfer.warm --device cuda:0 --dtype bfloat16 --head-size 128``
builds exactly the modules the engine's steps load, by running every kind of step the model
runner sends the backend (:mod:`pagoda.attention.warmup`: prefill, decode, decode graphs,
speculative verification graphs) through the backend's own code on a tiny cache:

1. each kind runs until FlashInfer asks for a module, which is noted, not built;
2. the modules noted are built at once, each by its own ninja in its own folder, as a load does;
3. every kind runs for real, recording each module it loads (one that step 1 missed is built
   here) and checking that nothing is left to build.

It prints one line per module with its time, then records the modules, the build environment and
a fingerprint of this backend's code (:func:`marker_path`). ``FlashInferBackend.is_compiled``
reads that record: true only while every module in it would load without building. The engine
runs this in a child process and logs what it prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib.metadata
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("pagoda.attention.flashinfer")

#: Environment variables that change the commands FlashInfer builds with, or where it caches.
_ENV_KEYS = ("CUDA_HOME", "CUDA_PATH", "CC", "CXX", "HOME")


def marker_path(device: torch.device, dtype: torch.dtype, head_size: int) -> Path:
    """Where a finished compile for this configuration is recorded (in Pagoda's cache)."""
    from pagoda.loader import cache_dir

    major, minor = torch.cuda.get_device_capability(device)
    version = importlib.metadata.version("flashinfer-python")
    name = f"{version}-sm{major}{minor}-{str(dtype).removeprefix('torch.')}-h{head_size}.json"
    return cache_dir() / "flashinfer-compiled" / name


def fingerprint() -> str:
    """A digest of the code that decides which modules the engine loads: this backend's and the
    step kinds'. A record from other code is not trusted: its modules may not be the set."""
    from pagoda.attention import warmup

    here = Path(__file__).parent
    digest = hashlib.sha256()
    for path in (here / "backend.py", here / "warm.py", here / "modules.py", Path(warmup.__file__)):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def build_env() -> dict[str, str]:
    """The environment FlashInfer's build commands and cache folder depend on."""
    keys = [k for k in os.environ if k.startswith("FLASHINFER_")] + list(_ENV_KEYS)
    return {k: os.environ[k] for k in sorted(set(keys)) if k in os.environ}


def why_not_compiled(record: dict[str, Any]) -> str | None:
    """None when the record's modules are the engine's and each loads without building."""
    from pagoda_attention_flashinfer.modules import Module, why_stale

    if record.get("fingerprint") != fingerprint():
        return "it was made by other code of Pagoda's FlashInfer backend"
    env, then = build_env(), record.get("env", {})
    changed = sorted(k for k in set(env) | set(then) if env.get(k) != then.get(k))
    if changed:
        return f"the build environment changed since ({', '.join(changed)})"
    if record.get("unrecorded"):  # a FlashInfer whose module loads cannot be watched
        return None
    modules = [Module(**m) for m in record.get("modules", [])]
    if not modules:
        return "it names no module"
    for module in modules:
        reason = why_stale(module)
        if reason:
            return reason
    return None


def is_compiled(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether a compile was recorded for this configuration and every module it recorded would
    load without building (so the engine's first steps compile nothing)."""
    try:
        record = json.loads(marker_path(device, dtype, head_size).read_text())
    except (OSError, ValueError):
        return False
    try:
        reason = why_not_compiled(record)
    except (TypeError, KeyError, AttributeError) as e:
        reason = f"it cannot be read ({e!r})"
    if reason:
        logger.info("attention: flashinfer's recorded compile is not usable: %s", reason)
        return False
    return True


def compile_kernels(
    device: torch.device,
    dtype: torch.dtype,
    head_size: int,
    say: Callable[[str], None] = print,
) -> float:
    """Build (or find built) every module the backend's steps load; record them; returns seconds.
    ``say`` gets one line per module and a summary."""
    import flashinfer  # noqa: F401  (missing: fail here, before anything is recorded)

    from pagoda.attention.warmup import run_step, step_kinds
    from pagoda_attention_flashinfer import modules
    from pagoda_attention_flashinfer.backend import FlashInferBackend

    start = time.perf_counter()
    kinds = step_kinds(FlashInferBackend)

    def run(kind: str) -> None:
        run_step(FlashInferBackend, kind, device, dtype, head_size)

    with modules.discovering() as asked:
        for kind in kinds:
            try:
                run(kind)
            except modules.Discovered:
                pass
    up_front = {m.name: m for m in modules.build_all(asked, say)}
    with modules.recording() as loaded:
        for kind in kinds:
            run(kind)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    for module in loaded:
        if module.built:  # NOTE: one that discovery did not reach; built on its load.
            say(f"flashinfer: compiled {module.name} in {module.seconds:.1f} s")
    stale = [r for r in map(modules.why_stale, loaded) if r]
    if stale:
        raise RuntimeError("modules still to build after the warm: " + "; ".join(stale))
    took = time.perf_counter() - start
    used: dict[str, modules.Module] = {}
    for m in loaded:
        first = up_front.get(m.name)
        if first is not None:  # NOTE: its time and whether it was built are those of step 2
            m = dataclasses.replace(m, seconds=first.seconds + m.seconds, built=first.built)
        used.setdefault(m.name, m)
    path = marker_path(device, dtype, head_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {
        "fingerprint": fingerprint(),
        "env": build_env(),
        "steps": list(kinds),
        "modules": [dataclasses.asdict(m) for m in used.values()],
        "unrecorded": not modules.install(),
        "seconds": round(took, 1),
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    tmp.replace(path)
    built = sum(m.built for m in used.values())
    say(
        f"flashinfer: {len(used)} modules ({built} compiled) for "
        f"{str(dtype).removeprefix('torch.')}, head size {head_size} ready in {took:.1f} s "
        f"(steps: {', '.join(kinds)})"
    )
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_attention_flashinfer.warm")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--head-size", type=int, default=128)
    args = p.parse_args(argv)
    compile_kernels(
        torch.device(args.device),
        getattr(torch, args.dtype),
        args.head_size,
        say=lambda line: print(line, flush=True),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
