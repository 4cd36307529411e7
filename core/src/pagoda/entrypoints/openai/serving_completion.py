"""``/v1/completions``: one or a batch of prompts, text or token ids, streamed or not."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse

from pagoda.engine.request_stream import OutputKind
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.limits import check_count, check_sampling_limits
from pagoda.entrypoints.openai.logprobs import CompletionLogprobs
from pagoda.entrypoints.openai.protocol import CompletionRequest
from pagoda.entrypoints.openai.serving import (
    Serving,
    bad_value,
    error_of,
    merge,
    new_id,
    now,
    off_loop,
    sse,
    usage,
)
from pagoda.outputs import CompletionOutput, RequestOutput


class _Prompt:
    """One prompt of the batch, as submitted."""

    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text = text
        self.token_ids = token_ids


class ServingCompletion(Serving):
    async def create(self, req: CompletionRequest) -> JSONResponse | StreamingResponse:
        lora = await self.adapter_of(req.model)
        model = self.check_model(req.model)
        limit = self.limits.max_prompts_per_request
        check_count("prompt", len(req.prompts()), limit, "max_prompts_per_request")
        check_sampling_limits(req, self.limits)
        prompts = [await self._prepare(p, req) for p in req.prompts()]
        num_lp = req.logprobs
        params = []
        for p in prompts:
            try:
                sp = req.sampling_params(
                    self.max_tokens(req.max_tokens, len(p.token_ids), "prompt"), num_lp
                )
            except ValueError as e:
                raise bad_value(e) from e
            if req.echo and num_lp is not None:
                sp.prompt_logprobs = num_lp
            params.append(sp)
        rid = new_id("cmpl", req.request_id)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        requests = [
            (f"{rid}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids}, sp)
            for i, (p, sp) in enumerate(zip(prompts, params))
        ]
        merged = merge(
            await self.submit(
                requests, kind, req.priority, req.constraint_field(), lora_request=lora
            )
        )
        if req.stream:
            return StreamingResponse(
                self._stream(req, rid, model, prompts, merged), media_type="text/event-stream"
            )
        try:
            return JSONResponse(await self._full(req, rid, model, prompts, merged))
        except Exception as e:
            raise self.error_of(e) from e
        finally:
            await merged.aclose()  # type: ignore[attr-defined]

    async def _prepare(self, prompt: str | list[int], req: CompletionRequest) -> _Prompt:
        """Tokenize (or check and decode) one prompt, off the event loop."""
        if isinstance(prompt, str):
            ids = await off_loop(
                self.tokenizer.encode, prompt, add_special_tokens=req.add_special_tokens
            )
            return _Prompt(prompt, ids)
        vocab = self.engine.info.shape.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise APIError(f"prompt token ids must be in [0, {vocab})", param="prompt")
        return _Prompt(await off_loop(self.tokenizer.decode, prompt), list(prompt))

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    async def _full(
        self,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[_Prompt],
        merged: AsyncIterator[tuple[int, RequestOutput]],
    ) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merged:
            finals[i] = out
        choices = []
        completion_tokens = 0
        for i in sorted(finals):
            out = finals[i]
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                choices.append(self._choice(req, i, prompts[i], out, c, first=True))
        body = {
            "id": rid,
            "object": "text_completion",
            "created": now(),
            "model": model,
            "choices": choices,
            "usage": usage(sum(len(p.token_ids) for p in prompts), completion_tokens),
        }
        return body

    def _choice(
        self,
        req: CompletionRequest,
        prompt_index: int,
        prompt: _Prompt,
        out: RequestOutput,
        c: CompletionOutput,
        first: bool,
        logprobs: CompletionLogprobs | None = None,
    ) -> dict[str, Any]:
        """A choice (whole, or one delta of a stream); ``first``: the first piece of it."""
        echo = req.echo and first
        text = (prompt.text if echo else "") + c.text
        lp = None
        if req.logprobs is not None:
            logprobs = logprobs or CompletionLogprobs(self._token_text)
            ids, positions = list(c.token_ids), list(c.logprobs or [])
            if echo:
                prompt_positions = out.prompt_logprobs or [None] * len(prompt.token_ids)
                ids = prompt.token_ids + ids
                positions = list(prompt_positions) + positions
            lp = logprobs.format(ids, positions)
        return {
            "index": prompt_index * req.n + c.index,
            "text": text,
            "logprobs": lp,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }

    async def _stream(
        self,
        req: CompletionRequest,
        rid: str,
        model: str,
        prompts: list[_Prompt],
        merged: AsyncIterator[tuple[int, RequestOutput]],
    ) -> AsyncIterator[str]:
        created = now()
        started: set[int] = set()
        ended: set[int] = set()
        offsets: dict[int, CompletionLogprobs] = {}
        completion_tokens = 0
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        try:
            async for i, out in merged:
                for c in out.outputs:
                    index = i * req.n + c.index
                    if index in ended or (not c.text and not c.token_ids and not c.finished()):
                        continue
                    completion_tokens += len(c.token_ids)
                    first = index not in started
                    started.add(index)
                    if c.finished():
                        ended.add(index)
                    lp = offsets.setdefault(index, CompletionLogprobs(self._token_text))
                    choice = self._choice(req, i, prompts[i], out, c, first, lp)
                    chunk = {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [choice],
                    }
                    if req.continuous_usage:
                        chunk["usage"] = usage(prompt_tokens, completion_tokens)
                    yield sse(chunk)
            if req.include_usage:
                yield sse(
                    {
                        "id": rid,
                        "object": "text_completion",
                        "created": created,
                        "model": model,
                        "choices": [],
                        "usage": usage(prompt_tokens, completion_tokens),
                    }
                )
        except Exception as e:
            yield sse(error_of(e).body())
        finally:
            await merged.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")
