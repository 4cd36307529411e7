"""Compile FlashInfer's kernels for one (device, dtype, head size) ahead of the first step.

``python -m pagoda_attention_flashinfer.warm --device cuda:0 --dtype bfloat16 --head-size 128``
builds the modules Pagoda's FlashInfer backend runs (the paged prefill wrapper, and the decode
wrapper with tensor cores, which CUDA graphs replay too) by planning and running each once on a
tiny cache, then records that they are built (:func:`marker_path`), which is what
``FlashInferBackend.is_compiled`` reads. The engine runs this in a child process.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import sys
import time
from pathlib import Path

import torch


def marker_path(device: torch.device, dtype: torch.dtype, head_size: int) -> Path:
    """Where a finished compile for this configuration is recorded (in Pagoda's cache)."""
    from pagoda.loader import cache_dir

    major, minor = torch.cuda.get_device_capability(device)
    version = importlib.metadata.version("flashinfer-python")
    name = f"{version}-sm{major}{minor}-{str(dtype).removeprefix('torch.')}-h{head_size}.json"
    return cache_dir() / "flashinfer-compiled" / name


def is_compiled(device: torch.device, dtype: torch.dtype, head_size: int) -> bool:
    """Whether a compile was recorded and FlashInfer's compile cache it filled is still there."""
    path = marker_path(device, dtype, head_size)
    try:
        jit_dir = Path(json.loads(path.read_text())["jit_dir"])
        return any(jit_dir.rglob("*.so"))
    except (OSError, ValueError, KeyError):
        return False


def compile_kernels(device: torch.device, dtype: torch.dtype, head_size: int) -> float:
    """Build (or load from FlashInfer's cache) every module the backend uses; returns seconds."""
    import flashinfer
    from flashinfer.jit import env

    from pagoda_attention_flashinfer.backend import _WORKSPACE_BYTES

    start = time.perf_counter()
    page, heads, kv_heads, pages = 16, 4, 2, 2
    workspace = torch.empty(_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    cache = torch.randn(pages, 2, page, kv_heads, head_size, device=device).to(dtype)
    i32 = dict(dtype=torch.int32)
    kv_indptr = torch.tensor([0, pages], **i32)
    kv_indices = torch.arange(pages, device=device, dtype=torch.int32)
    last = torch.tensor([page], **i32)
    common = dict(
        num_qo_heads=heads,
        num_kv_heads=kv_heads,
        page_size=page,
        q_data_type=dtype,
        kv_data_type=dtype,
        sm_scale=head_size**-0.5,
    )
    kv = (cache[:, 0], cache[:, 1])
    prefill = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    q_len = 3
    prefill.plan(
        torch.tensor([0, q_len], **i32),
        kv_indptr,
        kv_indices,
        last,
        head_dim_qk=head_size,
        causal=True,
        **common,
    )
    prefill.run(torch.randn(q_len, heads, head_size, device=device).to(dtype), kv)
    decode = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD", use_tensor_cores=True)
    decode.plan(kv_indptr, kv_indices, last, head_dim=head_size, **common)
    decode.run(torch.randn(1, heads, head_size, device=device).to(dtype), kv)
    torch.cuda.synchronize(device)
    took = time.perf_counter() - start
    path = marker_path(device, dtype, head_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"jit_dir": str(env.FLASHINFER_JIT_DIR), "seconds": round(took, 1)}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record) + "\n")
    tmp.replace(path)
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pagoda_attention_flashinfer.warm")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
    p.add_argument("--head-size", type=int, default=128)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    took = compile_kernels(device, getattr(torch, args.dtype), args.head_size)
    print(f"flashinfer: kernels for {args.dtype}, head size {args.head_size} ready in {took:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
