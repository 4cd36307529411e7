"""On a GPU: the device waits for drafts the host writes after the wait was enqueued
(``pagoda.worker.late_drafts``), and copies the drafts written then, not those of the moment
the wait was enqueued; a request with fewer than ``k`` drafts gets filler after its own."""

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
    for step in range(4):  # both host regions, twice
        dev = late.enqueue(2)
        after = (dev * 1).sum()  # work behind the wait
        done = torch.cuda.Event()
        done.record()
        time.sleep(0.02)
        assert not done.query()  # the stream is held at the wait
        late.release(["a", "b", "c"], {"a": [10 + step, 11, 12], "b": [20 + step]})
        done.synchronize()
        assert dev.tolist() == [[10 + step, 11, 12], [20 + step] * 3]
        assert int(after) == 10 + step + 23 + 3 * (20 + step)
        assert not late.check()  # the wait did not give up
    assert late.launches == 4 and not late.open
