"""What a proposer is handed after a verification step (``draft_after_verify``): the requests
that verified drafts and own their row, each with its own hidden rows, whether or not they are
one slice of the step's rows."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from pagoda.worker.spec_verify import draft_after_verify


def _handed(nd: list[int], counts: list[int], pending: tuple[str, ...] = ()):
    got = []
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    n = len(counts)
    req_ids = [f"r{i}" for i in range(n)]
    rows_t = torch.arange(int(qsl[-1]), dtype=torch.float32)[:, None]  # row j holds j
    spec = SimpleNamespace(
        hidden_feed=SimpleNamespace(pending={r: None for r in pending}),
        input_batch=SimpleNamespace(row_of={r: 10 + i for i, r in enumerate(req_ids)}),
        buffers=SimpleNamespace(as_device=lambda a: torch.from_numpy(np.ascontiguousarray(a))),
        proposer=SimpleNamespace(draft_after_verify=got.append),
    )
    out = SimpleNamespace(
        hidden_feed=(rows_t, qsl, 100 * np.arange(n, dtype=np.int64)),
        req_ids=req_ids,
        sample_idx=np.arange(n, dtype=np.int64),
        sample_rows=10 + np.arange(n, dtype=np.int64),
    )
    tokens = torch.arange(n * 3, dtype=torch.int64).view(n, 3)
    emitted = torch.arange(1, n + 1, dtype=torch.int64)
    draft_after_verify(spec, out, np.asarray(nd), tokens, emitted)
    return got[0] if got else None


def test_requests_with_drafts_get_their_own_rows_around_one_without() -> None:
    b = _handed(nd=[2, 0, 2], counts=[3, 1, 3])  # the middle request verified nothing
    assert b.req_ids == ["r0", "r2"]
    assert b.rows.tolist() == [10, 12] and b.first.tolist() == [0, 200]
    assert b.num_rows.tolist() == [3, 3] and b.hidden_loc.tolist() == [0, 3, 6]
    assert b.new_hidden_states[:, 0].tolist() == [0, 1, 2, 4, 5, 6]
    assert b.tokens.tolist() == [[0, 1, 2], [6, 7, 8]] and b.num_emitted.tolist() == [1, 3]


def test_a_step_where_every_request_verified_hands_its_rows_as_they_are() -> None:
    b = _handed(nd=[1, 3], counts=[2, 4])
    assert b.req_ids == ["r0", "r1"] and b.hidden_loc.tolist() == [0, 2, 6]
    assert b.new_hidden_states[:, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_requests_with_rows_waiting_are_left_to_their_next_proposal() -> None:
    b = _handed(nd=[2, 2, 2], counts=[3, 3, 3], pending=("r0",))
    assert b.req_ids == ["r1", "r2"] and b.first.tolist() == [100, 200]
    assert b.new_hidden_states[:, 0].tolist() == [3, 4, 5, 6, 7, 8]
    assert _handed(nd=[0, 0], counts=[1, 1]) is None
