"""Per-request state the model runner keeps between steps, in persistent row-indexed arrays.

A request owns one row from its first scheduling until it finishes or is preempted. Token ids,
block table and sampling settings live in that row, so building a step's flat batch is a few
vectorised gathers over the scheduled rows, with no per-token Python.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sample.metadata import SamplingMetadata
from pagoda.sample.state import SamplingRows
from pagoda.step import NewRequestData


class InputBatch:
    def __init__(
        self,
        max_num_reqs: int,
        max_model_len: int,
        max_blocks_per_req: int,
        vocab_size: int,
        device: torch.device,
    ) -> None:
        self.max_num_reqs = max_num_reqs
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_prompt = np.zeros(max_num_reqs, dtype=np.int64)
        self.block_table = np.zeros((max_num_reqs, max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros(max_num_reqs, dtype=np.int64)
        # Rows of pooling requests: they are pooled, never sampled.
        self.pooling = np.zeros(max_num_reqs, dtype=bool)
        self.sampling = SamplingRows(max_num_reqs, vocab_size, device)
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_num_reqs - 1, -1, -1))

    def add(self, req: NewRequestData) -> int:
        if not self._free_rows:
            raise RuntimeError("more running requests than max_num_seqs; scheduler bug")
        row = self._free_rows.pop()
        self.row_of[req.req_id] = row
        n_prompt = len(req.prompt_token_ids)
        n = n_prompt + len(req.output_token_ids)
        self.token_ids[row, :n_prompt] = req.prompt_token_ids
        self.token_ids[row, n_prompt:n] = req.output_token_ids
        self.num_tokens[row] = n
        self.num_prompt[row] = n_prompt
        self.num_blocks[row] = 0
        self.pooling[row] = req.pooling_params is not None
        self.append_blocks(row, req.block_ids)
        if req.pooling_params is None:
            self.sampling.add(row, req.sampling_params, req.prompt_token_ids, req.output_token_ids)
        else:  # pooled, never sampled
            self.sampling.add_unsampled(row)
        return row

    def sampling_metadata(self, rows: np.ndarray) -> SamplingMetadata:
        return self.sampling.metadata(rows, self.token_ids, self.num_tokens, self.num_prompt)

    def append_sampled(self, rows: np.ndarray, sampled: torch.Tensor) -> np.ndarray:
        """Append each row's sampled token now (waits for the device); returns them."""
        self.sampling.record_sampled(rows, sampled)
        tokens = sampled.cpu().numpy()
        self.token_ids[rows, self.append_placeholders(rows)] = tokens
        return tokens

    def append_placeholders(self, rows: np.ndarray) -> np.ndarray:
        """Each row gains the token its step is sampling, still on the device: its id is -1 here
        until the step's output comes back (``StepOutput.get``). Returns the positions."""
        pos = self.num_tokens[rows].copy()
        self.token_ids[rows, pos] = -1
        self.num_tokens[rows] = pos + 1
        return pos

    def write_outputs(self, req_id: str, num_computed: int, token_ids: list[int]) -> None:
        """A pipeline stage that does not sample learns the request's output tokens from the
        scheduler (``CachedRequestData.new_token_ids``): they start at ``num_computed`` or, if
        that lies in the prompt, where the prompt ends."""
        row = self.row_of[req_id]
        pos = max(num_computed, int(self.num_prompt[row]))
        end = pos + len(token_ids)
        self.token_ids[row, pos:end] = token_ids
        self.num_tokens[row] = max(int(self.num_tokens[row]), end)

    def write_drafts(self, drafts: dict[str, list[int]]) -> None:
        """Put each request's scheduled drafts after its known tokens, where the step reads its
        input ids and the sampler its history; ``num_tokens`` does not count them."""
        for req_id, ids in drafts.items():
            row = self.row_of[req_id]
            n = int(self.num_tokens[row])
            self.token_ids[row, n : n + len(ids)] = ids

    def append_blocks(self, row: int, block_ids: list[int], offset: int = -1) -> None:
        """Append ``block_ids`` to the row's block table, at ``offset`` when it is >= 0 (the
        blocks from there on were returned)."""
        if offset >= 0:
            self.num_blocks[row] = min(int(self.num_blocks[row]), offset)
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
        self._free_rows.append(row)
