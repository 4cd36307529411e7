"""transformers as the throughput benchmark's peers, on the same weights and prompts as Pagoda.

- ``cb``: continuous batching. ``generate_batch`` takes one ``max_new_tokens`` for every prompt,
  so the requests go through the manager underneath it (``init_continuous_batching``, then
  ``add_request`` with each request's own ``max_new_tokens`` and EOS disabled): every request
  stops at exactly its own length, as in Pagoda. The manager's warm-up (CUDA graph capture) runs
  before the clock starts, as ``generate_batch`` does it.
- ``static``: ``generate`` with ``cache_implementation="static"`` (compiled on a GPU), in
  left-padded batches in prompt order. A batch runs until its longest request is done; each
  request keeps and counts only its own tokens, so the work past a request's end is the cost of
  static batching. One untimed call per batch shape compiles first.
"""

from __future__ import annotations

import gc
import time
from typing import Any

from pagoda.bench.report import throughput_figures

_CB_PAGE = 256  # tokens per page of transformers' paged cache (its default in 5.x)


def load_hf_model(hf_dir: str, dtype: Any, device: Any) -> Any:
    # NOTE: transformers is slow to import: only where it is used.
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype, device_map=str(device)).eval()


def release(device: Any) -> None:
    """Give the memory of engines no longer referenced back, so the next one has the GPU alone."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def run_cb(
    hf_dir: str, dtype: Any, device: Any, prompts: list[list[int]], out_lens: list[int]
) -> dict[str, Any]:
    # NOTE: transformers is slow to import: only where it is used.
    from transformers import ContinuousBatchingConfig, GenerationConfig

    t0 = time.perf_counter()
    model = load_hf_model(hf_dir, dtype, device)
    load_s = time.perf_counter() - t0
    gen = GenerationConfig(do_sample=False, max_new_tokens=max(out_lens), eos_token_id=-1)
    cb: dict[str, Any] = {}
    if device.type != "cuda":
        # On a CPU it would size its cache from free host memory (gigabytes, slow to fill).
        pages = sum(-(-(len(p) + o) // _CB_PAGE) for p, o in zip(prompts, out_lens))
        cb = {"num_blocks": pages + 1, "max_batch_tokens": 2048}
    manager = model.init_continuous_batching(
        generation_config=gen,
        continuous_batching_config=ContinuousBatchingConfig(**cb),
        **_workload_hints(prompts, out_lens),
    )
    try:
        t0 = time.perf_counter()
        manager.warmup()
        warmup_s = time.perf_counter() - t0
        manager.start()
        attn = model.config._attn_implementation
        t0 = time.perf_counter()
        order = {}
        for i, (p, o) in enumerate(zip(prompts, out_lens)):
            rid = f"bench-{i}"
            manager.add_request(p, request_id=rid, max_new_tokens=o, eos_token_id=-1)
            order[rid] = i
        got: dict[int, int] = {}
        while len(got) < len(prompts):
            result = manager.get_result(timeout=1)
            if result is None:
                if not manager.is_running():
                    raise RuntimeError(
                        f"continuous batching stopped with {len(prompts) - len(got)} of "
                        f"{len(prompts)} requests unfinished"
                    )
                continue
            if result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id}: {result.error}")
                got[order[result.request_id]] = len(result.generated_tokens)
        elapsed = time.perf_counter() - t0
    finally:
        manager.stop(block=True, timeout=120)
        manager.destroy()
    del manager, model
    release(device)
    lens = [got[i] for i in range(len(prompts))]
    out = throughput_figures(elapsed, sum(map(len, prompts)), sum(lens), load_s)
    out.update(
        warmup_s=round(warmup_s, 3),
        exact_output_lengths=lens == out_lens,
        attn_implementation=attn,
        cache=cb or "auto",
    )
    return out


def _workload_hints(prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    """What ``generate_batch`` tells the manager to size its batches, where this version has it."""
    try:
        # NOTE: transformers is slow to import: only where it is used.
        from transformers.generation.continuous_batching.utils import WorkloadHints
    except ImportError:
        return {}
    hints = WorkloadHints(
        max_prompt_length=max(map(len, prompts)),
        max_generated_length=max(out_lens),
        num_requests=len(prompts),
    )
    return {"workload_hints": hints}


def run_static(
    hf_dir: str,
    dtype: Any,
    device: Any,
    prompts: list[list[int]],
    out_lens: list[int],
    pad_id: int,
    batch_size: int,
) -> dict[str, Any]:
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    t0 = time.perf_counter()
    model = load_hf_model(hf_dir, dtype, device)
    load_s = time.perf_counter() - t0
    # One cache length for every batch, so compiled graphs are reused rather than rebuilt.
    cache_len = max(map(len, prompts)) + max(out_lens)
    n = len(prompts)
    batch_size = min(batch_size, n)
    batches = [list(range(s, min(s + batch_size, n))) for s in range(0, n, batch_size)]

    # transformers compiles the decode step of a static cache on a GPU; where that fails, the
    # peer runs eagerly and says so rather than giving no figure.
    compile_error = None
    disable_compile = device.type != "cuda"

    def generate(rows: list[int], new: int) -> int:
        chosen = [prompts[i] for i in rows]
        out = _generate_static(model, chosen, new, pad_id, cache_len, disable_compile)
        return out.shape[1]

    def warm_up() -> None:  # every batch shape once, untimed
        for size in sorted({len(b) for b in batches}):
            generate(next(b for b in batches if len(b) == size), 4)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    try:
        warm_up()
    except Exception as e:
        if disable_compile:
            raise
        compile_error, disable_compile = f"{type(e).__name__}: {e}"[:500], True
        torch._dynamo.reset()
        warm_up()
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    exact, n_out = True, 0
    for rows in batches:
        new = max(out_lens[i] for i in rows)
        exact &= generate(rows, new) == new
        n_out += sum(out_lens[i] for i in rows)  # each request's own tokens, the rest dropped
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    model = None  # the closure's reference too
    if device.type == "cuda":
        torch._dynamo.reset()  # compiled graphs hold the model's memory
    release(device)
    out = throughput_figures(elapsed, sum(map(len, prompts)), n_out, load_s)
    computed = sum(len(b) * max(out_lens[i] for i in b) for b in batches)
    out.update(
        warmup_s=round(warmup_s, 3),
        exact_output_lengths=exact,
        batch_size=batch_size,
        compiled=not disable_compile,
        compile_error=compile_error,
        decoded_tokens=computed,  # rows x steps, including the steps past a request's end
    )
    return out


def _generate_static(
    model: Any,
    prompts: list[list[int]],
    new: int,
    pad_id: int,
    cache_len: int,
    disable_compile: bool,
) -> Any:
    """``new`` greedy tokens for each prompt, in one left-padded batch on a static cache."""
    # NOTE: torch is imported only where this runs, so importing this module stays light.
    import torch

    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for r, p in enumerate(prompts):  # left padding, as generate wants for decoder-only models
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            do_sample=False,
            max_new_tokens=new,
            min_new_tokens=new,  # EOS ignored: no row stops early
            pad_token_id=pad_id,
            cache_implementation="static",
            max_cache_len=cache_len,
            disable_compile=disable_compile,
        )
    return out[:, width:]
