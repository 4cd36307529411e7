"""A norm folded into the next projection: the rows' scales (``pagoda.ops.norm_scale``) and
the rows scaled by them (``scale_rows``) are ``rms_norm`` with a weight of ones."""

from __future__ import annotations

import pytest
import torch

from pagoda import ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scaled_rows_are_the_norm_with_unit_weight(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = (torch.randn(37, 64, generator=gen) * torch.rand(37, 1, generator=gen) * 9).to(dtype)
    scale = ops.norm_scale(x, 1e-6)
    assert scale.dtype == torch.float32 and scale.shape == (37,)
    want = ops.rms_norm(x, torch.ones(64, dtype=dtype), 1e-6)
    assert torch.equal(ops.scale_rows(x, scale), want)
    # (each row its own scale: the rows differ in size by up to 9x here)
    assert scale.max() / scale.min() > 3
