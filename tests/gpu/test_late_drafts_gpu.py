"""On a GPU: the device waits for drafts the host writes after the wait was enqueued
(``pagoda.worker.late_drafts``), and copies the drafts written then, not those of the moment
the wait was enqueued; a request with fewer than ``k`` drafts gets filler after its own. The
first launch for a number of requests has its drafts written before the wait, so that the
launches behind it, new to the process, do not wait out the bound on the host."""

from __future__ import annotations

import time

import pytest
import torch

from pagoda.worker.late_drafts import LateDrafts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_the_device_waits_for_the_drafts_the_host_writes_later():
    late = LateDrafts(max_reqs=4, k=3, device=torch.device("cuda"))
    dev, written = late.enqueue(2)  # the first launch of two requests: drafts written already
    assert written is not None and written.tolist() == [[0] * 3] * 2 and not late.open
    start = time.perf_counter()
    # (launches this process has not made before: the host is not held here)
    after = (dev.to(torch.float64) * 3).cumsum(0)
    torch.cuda.synchronize()
    assert time.perf_counter() - start < 5.0 and after.abs().sum().item() == 0
    late.release(["a", "b"], {"a": [1, 2, 3]})  # nothing open: nothing written
    for step in range(4):  # both host regions, twice
        dev, written = late.enqueue(2)
        assert written is None and late.open
        after = (dev.to(torch.float64) * 3).cumsum(0)
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.02)
        assert not done.query()  # the stream is held at the wait
        late.release(["a", "b", "c"], {"a": [10 + step, 11, 12], "b": [20 + step]})
        done.synchronize()
        assert dev.tolist() == [[10 + step, 11, 12], [20 + step] * 3]
        assert after[-1].tolist() == [3 * (30 + 2 * step), 3 * (31 + step), 3 * (32 + step)]
        assert not late.check()  # the wait did not give up
    dev, written = late.enqueue(3)  # a new number of requests: written first again
    assert written is not None and not late.open
    torch.cuda.synchronize()
    assert dev.tolist() == [[0] * 3] * 3
    assert late.launches == 6 and not late.check()
