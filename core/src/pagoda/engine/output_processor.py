"""Turns the engine core's token ids into ``RequestOutput``s: text, stop strings, logprobs,
n > 1."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagoda.engine.detokenizer import IncrementalDetokenizer, TokenTexts, find_stop_string
from pagoda.outputs import (
    CompletionOutput,
    Logprob,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestOutput,
)
from pagoda.sampling_params import SamplingParams
from pagoda.step import EngineCoreOutput, LogprobsArrays


@dataclass
class _SeqState:
    """One sequence the core runs (a request, or one of the n samples of a request)."""

    parent: _RequestState
    index: int
    params: SamplingParams
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    logprobs: list[PositionLogprobs] | None = None  # when params.logprobs is set
    cumulative_logprob: float = 0.0

    def completion(self) -> CompletionOutput:
        asked = self.logprobs is not None
        return CompletionOutput(
            self.index,
            self.text,
            list(self.token_ids),
            self.finish_reason,
            self.stop_reason,
            list(self.logprobs) if asked else None,
            self.cumulative_logprob if asked else None,
        )


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[_SeqState] = field(default_factory=list)
    num_cached_tokens: int = 0
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    # Its caller reads only the finished output (``LLM.generate``, a non-streaming server
    # request; vLLM's ``FINAL_ONLY`` output kind): none is built before. An output copies every
    # token and logprob so far, at every step it is built.
    final_only: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.seqs)

    def output(self) -> RequestOutput:
        return RequestOutput(
            self.request_id,
            self.prompt,
            self.prompt_token_ids,
            [s.completion() for s in self.seqs],
            self.finished,
            self.num_cached_tokens,
            None if self.prompt_logprobs is None else list(self.prompt_logprobs),
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.token_texts = TokenTexts(tokenizer)
        self._requests: dict[str, _RequestState] = {}
        self._seqs: dict[str, _SeqState] = {}  # core request id -> sequence
        # Pooling requests: request id -> (prompt, prompt token ids); one core request each.
        self._pooling: dict[str, tuple[str | None, list[int]]] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        seq_ids_and_params: list[tuple[str, SamplingParams]],
        final_only: bool = False,
    ) -> None:
        state = _RequestState(request_id, prompt, prompt_token_ids, final_only=final_only)
        for index, (seq_id, params) in enumerate(seq_ids_and_params):
            detok = IncrementalDetokenizer(
                self.tokenizer, prompt_token_ids, params.skip_special_tokens
            )
            seq = _SeqState(state, index, params, detok)
            if params.logprobs is not None:
                seq.logprobs = []
            if params.prompt_logprobs is not None:
                state.prompt_logprobs = [None]
            state.seqs.append(seq)
            self._seqs[seq_id] = seq
        self._requests[request_id] = state

    def add_pooling(self, request_id: str, prompt: str | None, prompt_token_ids: list[int]) -> None:
        """A pooling request: its one output comes when it finishes."""
        self._pooling[request_id] = (prompt, prompt_token_ids)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests or request_id in self._pooling

    def seq_ids(self, request_id: str) -> list[str]:
        if request_id in self._pooling:
            return [request_id]
        state = self._requests.get(request_id)
        return [] if state is None else [k for k, s in self._seqs.items() if s.parent is state]

    def process_outputs(
        self, outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput | PoolingRequestOutput], list[str]]:
        """Returns the request outputs that changed (of a ``final_only`` request, only the
        finished one; of a pooling request, its one output), and the core sequences to abort
        because a stop string ended them here."""
        changed: dict[str, _RequestState] = {}
        to_abort: list[str] = []
        pooled: list[RequestOutput | PoolingRequestOutput] = []
        for out in outputs:
            if out.request_id in self._pooling:
                if out.finished:
                    prompt, ids = self._pooling.pop(out.request_id)
                    pooled.append(
                        PoolingRequestOutput(
                            out.request_id,
                            PoolingOutput(out.pooling_output),
                            ids,
                            True,
                            out.num_cached_tokens,
                            prompt,
                        )
                    )
                continue
            seq = self._seqs.get(out.request_id)
            if seq is None or seq.finish_reason is not None:
                continue
            seq.parent.num_cached_tokens = max(seq.parent.num_cached_tokens, out.num_cached_tokens)
            prompt_lps = out.new_prompt_logprobs
            if prompt_lps is not None and seq.parent.prompt_logprobs is not None:
                # A chunk recomputed after preemption replaces what it covers.
                new = self._positions(prompt_lps.arrays)
                seq.parent.prompt_logprobs[prompt_lps.start + 1 :] = new
            if not out.new_token_ids and out.finish_reason is None:
                continue
            new_lps = None
            if out.new_logprobs is not None and seq.logprobs is not None:
                new_lps = self._positions(out.new_logprobs)
            stops = seq.params.stop
            stopped_here = False
            for i, token in enumerate(out.new_token_ids):
                seq.token_ids.append(token)
                if new_lps is not None:
                    seq.logprobs.append(new_lps[i])
                    seq.cumulative_logprob += new_lps[i][token].logprob
                delta = seq.detok.add_token(token)
                if not delta:
                    continue
                seq.text += delta
                hit = (
                    find_stop_string(
                        seq.text, len(delta), stops, seq.params.include_stop_str_in_output
                    )
                    if stops
                    else None
                )
                if hit is not None:
                    seq.stop_reason, cut = hit
                    seq.text = seq.text[:cut]
                    seq.finish_reason = "stop"
                    stopped_here = True
                    break
            if stopped_here:
                if out.finish_reason is None:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None and seq.finish_reason is None:
                seq.finish_reason = out.finish_reason
                seq.stop_reason = out.stop_reason
            if seq.finish_reason is not None:
                del self._seqs[out.request_id]
            changed[seq.parent.request_id] = seq.parent
        results = pooled
        for rid, state in changed.items():
            if state.finished:
                results.append(state.output())
                del self._requests[rid]
            elif not state.final_only:
                results.append(state.output())
        return results, to_abort

    def _positions(self, arrays: LogprobsArrays) -> list[PositionLogprobs]:
        """vLLM's shape: per position, the chosen token with its rank, then the top k."""
        text = self.token_texts
        out = []
        for ids, lps, rank in zip(
            arrays.token_ids.tolist(), arrays.logprobs.tolist(), arrays.ranks.tolist()
        ):
            position = {ids[0]: Logprob(lps[0], rank, text(ids[0]))}
            for r, (token, lp) in enumerate(zip(ids[1:], lps[1:]), start=1):
                position.setdefault(token, Logprob(lp, r, text(token)))
            out.append(position)
        return out

    def abort(self, request_id: str) -> list[str]:
        """Forget a request; returns its core sequence ids (for the core to abort)."""
        if self._pooling.pop(request_id, None) is not None:
            return [request_id]
        ids = self.seq_ids(request_id)
        for seq_id in ids:
            del self._seqs[seq_id]
        self._requests.pop(request_id, None)
        return ids

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pooling)
