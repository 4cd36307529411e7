"""Build a model runner's per-row sampling state for sampler tests, without a model."""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sampling_params import SamplingParams
from pagoda.step import NewRequestData
from pagoda.worker.input_batch import InputBatch


def make_batch(
    params: list[SamplingParams],
    prompts: list[list[int]],
    outputs: list[list[int]] | None = None,
    vocab: int = 64,
    max_num_reqs: int | None = None,
    device: str = "cpu",
) -> tuple[InputBatch, np.ndarray]:
    """An InputBatch holding one request per params entry; returns it and their rows."""
    outputs = outputs or [[] for _ in params]
    ib = InputBatch(max_num_reqs or len(params), 256, 1, vocab, torch.device(device))
    for i, (sp, prompt, out) in enumerate(zip(params, prompts, outputs, strict=True)):
        ib.add(NewRequestData(str(i), prompt, out, sp, [], 0))
    return ib, np.array([ib.row_of[str(i)] for i in range(len(params))])
