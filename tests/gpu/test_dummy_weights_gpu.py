"""On a GPU: random ("dummy") weights drawn on the device are the CPU's, value for value, in every
dtype, so that a random-weight engine's outputs on a GPU can be compared with transformers on the
same weights drawn anywhere."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pagoda.loader import init_dummy_

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


class _Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(1000, 3001, bias=True)  # not a multiple of any chunk
        self.norm = nn.LayerNorm(3001)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_dummy_weights_on_the_device_are_the_cpus(dtype: torch.dtype) -> None:
    cpu, gpu = _Two().to(dtype), _Two().to(dtype=dtype, device="cuda")
    init_dummy_(cpu, seed=3)
    # Chunks smaller than the parameter on the device: the chunking must not show either.
    init_dummy_(gpu, seed=3, chunk=1 << 16)
    for (name, a), (_, b) in zip(cpu.named_parameters(), gpu.named_parameters()):
        assert torch.equal(a, b.cpu()), name
    assert torch.equal(gpu.norm.weight, torch.ones_like(gpu.norm.weight))
    assert gpu.proj.weight.abs().max() > 0
