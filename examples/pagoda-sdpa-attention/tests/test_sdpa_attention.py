"""The example backend passes Pagoda's attention conformance kit."""

from __future__ import annotations

import torch

from pagoda.testing import AttentionBackendConformance
from pagoda_sdpa_attention.backend import PagedSdpaBackend


class TestPagedSdpaConformance(AttentionBackendConformance):
    backend = PagedSdpaBackend  # the class itself; a registered name works too ("sdpa")
    dtypes = (torch.float32, torch.bfloat16)
    tolerances = {torch.bfloat16: (3e-2, 3e-2)}  # dtype -> (atol, rtol)
