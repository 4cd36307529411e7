"""Per-request state the model runner keeps between steps, in persistent row-indexed arrays.

A request owns one row from its first scheduling until it finishes or is preempted. Token ids,
block table and sampling settings live in that row, so building a step's flat batch is a few
vectorised gathers over the scheduled rows, with no per-token Python.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sampling_params import SamplingParams
from pagoda.scheduler.output import NewRequestData


class InputBatch:
    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_req: int) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        self.temperature = np.ones(max_num_reqs, dtype=np.float32)
        self.greedy = np.ones(max_num_reqs, dtype=bool)
        self.top_k = np.zeros(max_num_reqs, dtype=np.int64)
        self.top_p = np.ones(max_num_reqs, dtype=np.float32)
        self.min_p = np.zeros(max_num_reqs, dtype=np.float32)
        self.seeds = np.full(max_num_reqs, -1, dtype=np.int64)
        self.generators: dict[int, torch.Generator] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, req: NewRequestData, device: torch.device) -> int:
        if not self._free_rows:
            raise RuntimeError("more running requests than max_num_seqs; scheduler bug")
        row = self._free_rows.pop()
        self.row_of[req.req_id] = row
        n_prompt = len(req.prompt_token_ids)
        n = n_prompt + len(req.output_token_ids)
        self.token_ids[row, :n_prompt] = req.prompt_token_ids
        self.token_ids[row, n_prompt:n] = req.output_token_ids
        self.num_tokens[row] = n
        self.num_blocks[row] = 0
        self.append_blocks(row, req.block_ids)
        self._set_sampling(row, req.sampling_params, device)
        return row

    def _set_sampling(self, row: int, sp: SamplingParams, device: torch.device) -> None:
        self.greedy[row] = sp.is_greedy
        self.temperature[row] = 1.0 if sp.is_greedy else sp.temperature
        self.top_k[row] = sp.top_k
        self.top_p[row] = sp.top_p
        self.min_p[row] = sp.min_p
        if sp.seed is not None and not sp.is_greedy:
            self.seeds[row] = sp.seed
            self.generators[row] = torch.Generator(device=device)
        else:
            self.seeds[row] = -1

    def seeded_generators(
        self, rows: np.ndarray, positions: np.ndarray
    ) -> dict[int, torch.Generator]:
        """Generators for the seeded rows among ``rows`` (batch index -> generator).

        NOTE: each draw is seeded from (request seed, token position), so a seeded request gives
        the same tokens whatever else is in the batch, and again after preemption.
        """
        out = {}
        for i, row in enumerate(rows.tolist()):
            gen = self.generators.get(row)
            if gen is not None:
                gen.manual_seed((int(self.seeds[row]) * 1_000_003 + int(positions[i])) % (1 << 63))
                out[i] = gen
        return out

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if not block_ids:
            return
        start = int(self.num_blocks[row])
        end = start + len(block_ids)
        self.block_table[row, start:end] = block_ids
        self.num_blocks[row] = end

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is None:
            return
        self.generators.pop(row, None)
        self._free_rows.append(row)
