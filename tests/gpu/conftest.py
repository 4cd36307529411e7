"""The GPU tier runs many engines in one process, one module after another: each module must give
the device's memory back, or every later engine finds too little for its KV cache and fails for
a reason that is not its own."""

from __future__ import annotations

import gc

import pytest
import torch

#: Bytes a module may leave allocated once its engines are gone (FlashInfer's workspace, shared
#: by every engine of the process: 256 MiB; small per-device caches); an engine's KV cache or
#: weights are far more.
LEFT_OVER = 1 << 30


@pytest.fixture(scope="module", autouse=True)
def device_memory_returns(request: pytest.FixtureRequest):
    """After every module (its module-scoped engines torn down first): nothing big allocated."""
    yield
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return
    before = torch.cuda.memory_allocated()
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated()
    assert after <= LEFT_OVER, (
        f"{request.module.__name__} left {after / 2**30:.2f} GiB allocated on the device "
        f"({before / 2**30:.2f} GiB before a full garbage collection): an engine it built is "
        "still referenced (shut engines down: llm.engine.shutdown())"
    )
