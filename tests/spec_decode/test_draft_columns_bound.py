"""A proposer returns at most k draft columns (``k' <= k``, k = num_speculative_tokens) in every
scheduling mode: the engine refuses more with an error naming the bound, as the guide says,
instead of taking k + 1 columns and dropping the last."""

from __future__ import annotations

import numpy as np
import pytest

from pagoda.spec_decode import Drafts


def test_k_columns_or_fewer_are_taken() -> None:
    ids = np.array([[5, 6, 7], [8, -1, -1]], dtype=np.int64)
    assert Drafts(ids).counts(100, np.array([3, 3]), 3).tolist() == [3, 1]
    assert Drafts(ids[:, :2]).counts(100, np.array([3, 1]), 3).tolist() == [2, 1]


def test_more_than_k_columns_is_an_error_naming_the_bound() -> None:
    ids = np.array([[5, 6, 7, 9]], dtype=np.int64)
    with pytest.raises(ValueError, match=r"4 draft columns, more than .*num_speculative_tokens=3"):
        Drafts(ids).counts(100, np.array([3]), 3)


def test_the_runner_checks_the_bound_with_k() -> None:
    import inspect

    from pagoda.worker import spec_propose

    assert "drafts.counts(spec.vocab_size, batch.max_num_drafts, k)" in inspect.getsource(
        spec_propose
    )
