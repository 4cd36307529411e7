"""The launch staging regions: slices hold what was staged, regions alternate by launch, and a
region comes back only after the event recorded when it was left."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locked memory: CUDA"),
]


def test_staged_slices_hold_their_arrays_and_alternate_by_launch() -> None:
    from pagoda.worker.pinned_stage import PinnedStage

    stage = PinnedStage(nbytes=1 << 12)
    a = np.arange(10, dtype=np.int64)
    b = np.array([[1, 2], [3, 4]], dtype=np.int32)
    ta, tb = stage.host(a), stage.host(b)
    assert ta.is_pinned() and tb.is_pinned()
    assert ta.tolist() == a.tolist() and tb.tolist() == b.tolist()
    assert ta.data_ptr() != tb.data_ptr()
    first = ta.data_ptr()
    stage.next_launch()  # the other region
    tc = stage.host(a)
    assert abs(tc.data_ptr() - first) >= 1 << 12
    stage.next_launch()  # back to the first one, from its start
    assert stage.host(a).data_ptr() == first
    assert stage.host(np.zeros(1 << 13, dtype=np.int8)) is None  # too big: the caller pins
    out = torch.empty(10, dtype=torch.int64, device="cuda")
    out.copy_(stage.host(a), non_blocking=True)
    torch.cuda.synchronize()
    assert out.tolist() == a.tolist()
