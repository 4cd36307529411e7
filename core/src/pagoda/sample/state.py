"""Sampling settings of the running requests in persistent row-indexed arrays, and each step's
``SamplingMetadata`` built from them by vectorised gathers over the rows that sample.

A feature's tensors are built only when a row of the step uses it. Penalties keep per-row state
on the device ([rows, vocab] output token counts and prompt-token mask), allocated when the first
request with a penalty arrives and updated from the sampled ids without leaving the device.
"""

from __future__ import annotations

import numpy as np
import torch

from pagoda.sample.metadata import Penalties, SamplingMetadata
from pagoda.sample.rows import BadWords, RaggedRows
from pagoda.sampling_params import SamplingParams

_U64 = np.uint64


def _mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a bijection of uint64 that scrambles every bit."""
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


def seeded_uniform(seeds: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """One uniform in [0, 1) per (seed, token position): a counter-based generator.

    NOTE: a seeded row's draw depends on nothing but its seed and the position it samples, so a
    seeded request gives the same tokens whatever else is in the batch, and after preemption.
    """
    golden = _U64(0x9E3779B97F4A7C15)
    x = _mix64(_mix64(seeds.astype(np.uint64) + golden) ^ positions.astype(np.uint64))
    return (x >> _U64(11)).astype(np.float64) * 2.0**-53


class SamplingRows:
    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device) -> None:
        r = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        self.greedy = np.ones(r, dtype=bool)
        self.temperature = np.ones(r, dtype=np.float32)
        self.top_k = np.zeros(r, dtype=np.int64)  # 0: no limit
        self.top_p = np.ones(r, dtype=np.float32)
        self.min_p = np.zeros(r, dtype=np.float32)
        self.seeded = np.zeros(r, dtype=bool)
        self.seed = np.zeros(r, dtype=np.uint64)
        self.logprobs = np.full(r, -1, dtype=np.int64)  # -1: not asked
        self.prompt_logprobs = np.full(r, -1, dtype=np.int64)
        self.min_tokens = np.zeros(r, dtype=np.int64)
        self.stop_ids = RaggedRows(r)  # blocked while the output is shorter than min_tokens
        self.allowed = RaggedRows(r)
        self.bias = RaggedRows(r, with_values=True)
        self.bad_words = BadWords(r)
        self.penalized = np.zeros(r, dtype=bool)
        self.presence = np.zeros(r, dtype=np.float32)
        self.frequency = np.zeros(r, dtype=np.float32)
        self.repetition = np.ones(r, dtype=np.float32)
        # Greedy rows whose metadata is plain (``SamplingMetadata.plain``) at every step: a step
        # of only such rows needs no metadata but ``all_greedy``.
        self.plain = np.ones(r, dtype=bool)
        self._no_history = np.full((r, 1), -1, dtype=np.int64)  # (see ``add``)
        self._counts: torch.Tensor | None = None  # [rows, vocab] float32 output token counts
        self._prompt_mask: torch.Tensor | None = None  # [rows, vocab] bool

    def add(
        self, row: int, sp: SamplingParams, prompt_ids: list[int], output_ids: list[int]
    ) -> None:
        """Take over a request's settings; ``output_ids`` is what it generated before (resumed)."""
        greedy = sp.is_greedy
        self.greedy[row] = greedy
        self.temperature[row] = 1.0 if greedy else sp.temperature
        self.top_k[row] = sp.top_k if not greedy and sp.top_k < self.vocab_size else 0
        self.top_p[row] = 1.0 if greedy else sp.top_p
        self.min_p[row] = 0.0 if greedy else sp.min_p
        self.seeded[row] = sp.seed is not None
        self.seed[row] = (sp.seed or 0) % (1 << 64)
        self.logprobs[row] = -1 if sp.logprobs is None else sp.logprobs
        # A resumed request with output has delivered its prompt logprobs already.
        asks = sp.prompt_logprobs is not None and not output_ids
        self.prompt_logprobs[row] = sp.prompt_logprobs if asks else -1
        self.min_tokens[row] = sp.min_tokens
        self.stop_ids.set(row, sorted(sp.all_stop_token_ids) if sp.min_tokens else [])
        self.allowed.set(row, sp.allowed_token_ids or [])
        bias = sp.logit_bias or {}
        self.bias.set(row, list(bias), list(bias.values()))
        self.bad_words.set(row, sp.bad_words_token_ids)
        self.presence[row] = sp.presence_penalty
        self.frequency[row] = sp.frequency_penalty
        self.repetition[row] = sp.repetition_penalty
        self.penalized[row] = (
            sp.presence_penalty != 0 or sp.frequency_penalty != 0 or sp.repetition_penalty != 1
        )
        if self.penalized[row]:
            self._reset_penalty_state(row, prompt_ids, output_ids)
        # NOTE: the greedy row's own metadata at its first output position, where every setting
        # it has acts (min_tokens too), says which fields it fills at some step; built over no
        # token history (whether a row has bad words decides ``banned``, its history the ids).
        if greedy:
            first = np.zeros(1, dtype=np.int64)  # as many tokens as prompt tokens
            alone = self._settings(np.array([row]), self._no_history, first, first)
            self.plain[row] = alone.plain
        else:
            self.plain[row] = False

    def add_unsampled(self, row: int) -> None:
        """Take over a row for a request that is never sampled (a pooling request): the
        settings :meth:`add` gives a greedy request that asks for nothing else, written without
        working them out. Steps read some fields of every row they schedule (whether any needs
        its token history, prompt logprobs, plainness), so a former request's must not stay."""
        self.greedy[row] = True
        self.temperature[row] = 1.0
        self.top_k[row] = 0
        self.top_p[row] = 1.0
        self.min_p[row] = 0.0
        self.seeded[row] = False
        self.seed[row] = 0
        self.logprobs[row] = -1
        self.prompt_logprobs[row] = -1
        self.min_tokens[row] = 0
        for ragged in (self.stop_ids, self.allowed, self.bias):
            if ragged.has[row]:
                ragged.set(row, ())
        if self.bad_words.has[row]:
            self.bad_words.set(row, ())
        self.presence[row] = 0.0
        self.frequency[row] = 0.0
        self.repetition[row] = 1.0
        self.penalized[row] = False
        self.plain[row] = True

    def _reset_penalty_state(self, row: int, prompt_ids: list[int], output_ids: list[int]) -> None:
        if self._counts is None:
            shape = (len(self.temperature), self.vocab_size)
            self._counts = torch.zeros(shape, dtype=torch.float32, device=self.device)
            self._prompt_mask = torch.zeros(shape, dtype=torch.bool, device=self.device)
        self._counts[row].zero_()
        if output_ids:
            ids = torch.tensor(output_ids, device=self.device)
            self._counts[row].index_add_(0, ids, torch.ones(len(output_ids), device=self.device))
        self._prompt_mask[row].zero_()
        self._prompt_mask[row, torch.tensor(prompt_ids, device=self.device)] = True

    def record_sampled(self, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """Count the tokens just sampled for ``rows``, on the device: [n], or [n, w] with -1
        past what a row emitted (a step that verified drafts)."""
        if self._counts is None or not self.penalized[rows].any():
            return
        if sampled.dim() == 2:
            flat = sampled.reshape(-1)
            rows_t = self._to_dev(np.repeat(rows, sampled.shape[1]))
            weights = (flat >= 0).to(torch.float32)
            self._counts.index_put_((rows_t, flat.clamp(min=0)), weights, accumulate=True)
            return
        ones = torch.ones(len(rows), dtype=torch.float32, device=self.device)
        self._counts.index_put_((self._to_dev(rows), sampled), ones, accumulate=True)

    def needs_token_history(self, rows: np.ndarray) -> bool:
        """Whether sampling ``rows`` reads their earlier token ids on the host (bad words)."""
        return bool(self.bad_words.has[rows].any())

    def _to_dev(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)

    def metadata(
        self,
        rows: np.ndarray,
        token_ids: np.ndarray,
        num_tokens: np.ndarray,
        num_prompt: np.ndarray,
        offsets: np.ndarray | None = None,
    ) -> SamplingMetadata:
        """The settings of ``rows``, which sample the token at position ``num_tokens[row]``.

        ``offsets`` (aligned with ``rows``, which may then repeat a row) moves each sampled
        position ``offsets[i]`` further: speculative verification scores a request's draft
        positions as consecutive rows, whose history (in ``token_ids``) holds the drafts before
        them.
        """
        if self.plain[rows].all():
            return SamplingMetadata.greedy()
        n_tok = num_tokens[rows] if offsets is None else num_tokens[rows] + offsets
        md = self._settings(rows, token_ids, n_tok, num_prompt[rows])
        if not md.all_greedy:
            self._random(md, rows, n_tok)
        return md

    def _settings(
        self, rows: np.ndarray, token_ids: np.ndarray, n_tok: np.ndarray, n_prompt: np.ndarray
    ) -> SamplingMetadata:
        """The metadata of ``rows`` but for the random draw: whether all are greedy, logprobs
        and the constraints. ``n_tok``, ``n_prompt``: aligned with ``rows``."""
        md = SamplingMetadata(all_greedy=bool(self.greedy[rows].all()), all_random=False)
        k = int(self.logprobs[rows].max())
        if k >= 0:
            md.max_num_logprobs = k
        self._constraints(md, rows, token_ids, n_tok, n_prompt)
        return md

    def _constraints(
        self,
        md: SamplingMetadata,
        rows: np.ndarray,
        token_ids: np.ndarray,
        n_tok: np.ndarray,
        n_prompt: np.ndarray,
    ) -> None:
        """``n_tok``, ``n_prompt``: aligned with ``rows``."""
        dev = self.device
        banned_idx: list[np.ndarray] = []
        banned_ids: list[np.ndarray] = []
        short = np.nonzero(n_tok - n_prompt < self.min_tokens[rows])[0]
        if len(short):
            idx, ids, _ = self.stop_ids.pairs(rows[short])
            banned_idx.append(short[idx])
            banned_ids.append(ids)
        with_bad = np.nonzero(self.bad_words.has[rows])[0]
        if len(with_bad):
            idx, ids = self.bad_words.banned(
                rows[with_bad], token_ids, n_tok[with_bad], n_prompt[with_bad]
            )
            banned_idx.append(with_bad[idx])
            banned_ids.append(ids)
        # NOTE: set whenever a row has bad words or is short of min_tokens, matched or not
        # (``add`` reads a row's plainness from it).
        if banned_idx:
            md.banned = (
                self._to_dev(np.concatenate(banned_idx)),
                self._to_dev(np.concatenate(banned_ids)),
            )
        with_allowed = self.allowed.has[rows]
        if with_allowed.any():
            idx, ids, _ = self.allowed.pairs(rows)
            mask = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device=dev)
            mask[self._to_dev(np.nonzero(with_allowed)[0])] = True
            mask[self._to_dev(idx), self._to_dev(ids)] = False
            md.allowed_mask = mask
        if self.bias.has[rows].any():
            idx, ids, values = self.bias.pairs(rows)
            md.logit_bias = (self._to_dev(idx), self._to_dev(ids), self._to_dev(values))
        if self.penalized[rows].any():
            rows_t = self._to_dev(rows)
            md.penalties = Penalties(
                presence=self._to_dev(self.presence[rows]),
                frequency=self._to_dev(self.frequency[rows]),
                repetition=self._to_dev(self.repetition[rows]),
                output_counts=self._counts[rows_t],
                prompt_mask=self._prompt_mask[rows_t],
            )

    def _random(self, md: SamplingMetadata, rows: np.ndarray, n_tok: np.ndarray) -> None:
        greedy = self.greedy[rows]
        md.all_random = not greedy.any()
        md.temperature = self._to_dev(self.temperature[rows])
        if not md.all_random:
            md.greedy_mask = self._to_dev(greedy)
        top_k = self.top_k[rows]
        if top_k.any():
            md.top_k = self._to_dev(np.where(top_k > 0, top_k, self.vocab_size))
            md.max_top_k = int(top_k.max())
        top_p = self.top_p[rows]
        if (top_p < 1.0).any():
            md.top_p = self._to_dev(top_p)
        min_p = self.min_p[rows]
        if (min_p > 0.0).any():
            md.min_p = self._to_dev(min_p)
        # Unseeded rows draw from torch's default CPU generator (the engine seeds it).
        uniform = torch.rand(len(rows), dtype=torch.float64).numpy()
        seeded = self.seeded[rows]
        if seeded.any():
            uniform[seeded] = seeded_uniform(self.seed[rows[seeded]], n_tok[seeded])
        md.uniform = self._to_dev(uniform)
