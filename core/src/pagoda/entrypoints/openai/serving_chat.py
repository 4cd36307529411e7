"""``/v1/chat/completions``: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from jinja2 import TemplateError

from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.input_processor import ProcessedPrompt
from pagoda.engine.request_stream import OutputKind
from pagoda.entrypoints.openai.chat_parsers import ServerParsers
from pagoda.entrypoints.openai.chat_template import TemplateSandbox, request_template
from pagoda.entrypoints.openai.errors import APIError
from pagoda.entrypoints.openai.limits import check_count, check_sampling_limits
from pagoda.entrypoints.openai.logprobs import chat_logprobs
from pagoda.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from pagoda.entrypoints.openai.serving import (
    Serving,
    bad_value,
    error_of,
    new_id,
    now,
    off_loop,
    sse,
    usage,
)
from pagoda.entrypoints.openai.structured import chat_message, stream_tool_delta
from pagoda.multimodal import MediaSource
from pagoda.multimodal.media import fetch_image
from pagoda.outputs import CompletionOutput, RequestOutput


class ServingChat(Serving):
    def __init__(self, engine: AsyncLLM, model_names: list[str]) -> None:
        super().__init__(engine, model_names)
        server = engine.config.server
        self.trust_request_template = server.trust_request_chat_template
        self.sandbox = TemplateSandbox(
            server.request_chat_template_timeout_s, server.request_chat_template_max_chars
        )
        self.parsers = ServerParsers.of(server)

    async def render(
        self,
        messages: list[ChatMessage],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        chat_template: str | None = None,
    ) -> dict[str, Any]:
        """The prompt text and token ids of a conversation, rendered and tokenized off the event
        loop; 400 if the template refuses it, or if the request brings a template of its own and
        the operator did not allow that."""
        template, kwargs = request_template(
            chat_template, template_kwargs, self.trust_request_template
        )
        kwargs["add_generation_prompt"] = add_generation_prompt
        if continue_final_message:
            kwargs["continue_final_message"] = True
        proc = self.engine.engine.input_processor.mm_processor
        image_text = "" if proc is None else proc.placeholder_text
        conversation = [m.template_dict(image_text) for m in messages]
        if template is not None:
            return await self._render_request_template(template, conversation, kwargs)
        try:
            return await off_loop(self.engine.engine.apply_chat_template, conversation, **kwargs)
        except (TemplateError, ValueError, TypeError) as e:
            raise APIError(
                f"the chat template cannot render these messages: {e}", param="messages"
            ) from e

    async def _render_request_template(
        self, template: str, conversation: list[dict[str, Any]], kwargs: dict[str, Any]
    ) -> dict[str, Any]:
        specials = {
            k: v for k, v in self.tokenizer.special_tokens_map.items() if isinstance(v, str)
        }
        cont = kwargs.pop("continue_final_message", False)
        context = {**specials, **kwargs, "messages": conversation}
        text = await asyncio.to_thread(self.sandbox.render, template, context)
        if cont:  # as transformers does: the text ends where the final message's content ends
            final = (conversation[-1]["content"] or "").strip()
            end = text.rfind(final) if final else -1
            if end < 0:
                raise APIError(
                    "continue_final_message: the final message's content is not in the "
                    "rendered chat template",
                    param="continue_final_message",
                )
            text = text[: end + len(final)]
        ids = await off_loop(self.tokenizer.encode, text, add_special_tokens=False)
        return {"prompt": text, "prompt_token_ids": ids}

    async def _with_images(self, prompt: dict[str, Any], urls: list[str]) -> ProcessedPrompt:
        """The rendered prompt with its messages' images (data URIs, allowed local files,
        http(s) when the server fetches), processed by the model's processor; 400 naming what
        is wrong (a bad image, scheme or limit, or a model that takes no images)."""
        processor = self.engine.engine.input_processor
        server = self.engine.config.server
        source = MediaSource(
            server.allowed_local_media_path, server.allow_remote_media, server.media_fetch_timeout_s
        )

        def process() -> ProcessedPrompt:
            if processor.mm_processor is None:
                raise ValueError(
                    f"model {processor.info.name!r} takes text only; it cannot read image_url parts"
                )
            limit = processor.mm_limits.get("image", 0)
            if len(urls) > limit:
                raise ValueError(
                    f"the messages have {len(urls)} images, more than"
                    f" limit_mm_per_prompt['image']={limit}"
                )
            images = [fetch_image(url, source, processor.media_limits) for url in urls]
            return processor.process({**prompt, "multi_modal_data": {"image": images}})

        try:
            return await off_loop(process)
        except (ValueError, TypeError) as e:
            raise APIError(str(e), param="messages") from e

    async def create(self, req: ChatCompletionRequest) -> JSONResponse | StreamingResponse:
        lora = await self.adapter_of(req.model)
        model = self.check_model(req.model)
        check_count("messages", len(req.messages), self.limits.max_messages, "max_messages")
        check_sampling_limits(req, self.limits)
        try:
            plan = req.tool_plan  # tool calls: the template shows the model its tools
            self.parsers.check(plan)
        except ValueError as e:
            raise bad_value(e) from e
        template_kwargs = req.chat_template_kwargs
        if plan is not None:
            tools = [t.model_dump(exclude_none=True) for t in plan.tools]
            template_kwargs = {"tools": tools, **(template_kwargs or {})}
        prompt = await self.render(
            req.messages,
            req.add_generation_prompt,
            req.continue_final_message,
            template_kwargs,
            req.chat_template,
        )
        urls = [url for m in req.messages for url in m.image_urls()]
        if urls:  # images: fetched and processed off the event loop
            prompt = await self._with_images(prompt, urls)
            num_prompt = len(prompt.prompt_token_ids)
        else:
            num_prompt = len(prompt["prompt_token_ids"])
        try:
            params = req.sampling_params(
                self.max_tokens(req.requested_max_tokens, num_prompt, "messages"),
                req.num_logprobs,
            )
        except ValueError as e:
            raise bad_value(e) from e
        grammar = self.parsers.constraint(plan)
        if grammar is not None:
            if params.structured_outputs is not None:
                raise APIError(
                    "give one output constraint; the server holds `tool_choice` auto's calls "
                    "to a grammar, and this request gives another",
                    param="tool_choice",
                )
            params.structured_outputs = grammar
        if self.parsers.keeps_special_tokens(plan):
            params.skip_special_tokens = False
        rid = new_id("chatcmpl", req.request_id)
        kind = OutputKind.DELTA if req.stream else OutputKind.FINAL_ONLY
        submitted = [(rid, prompt, params)]
        field = "tools" if grammar is not None else req.constraint_field()
        (outputs,) = await self.submit(submitted, kind, req.priority, field, lora_request=lora)
        if req.stream:
            return StreamingResponse(
                self._stream(req, rid, model, num_prompt, outputs),
                media_type="text/event-stream",
            )
        final = None
        try:
            async for out in outputs:
                final = out
        except Exception as e:
            raise self.error_of(e) from e
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        assert final is not None
        choices = []
        for c in final.outputs:
            parser = self.parsers.choice(plan)
            if parser is not None:
                message = parser.message(c.text)
                finish_reason = "tool_calls" if parser.called else c.finish_reason
            else:
                message, finish_reason = chat_message(plan, c.text, c.finish_reason)
            choices.append(
                {
                    "index": c.index,
                    "message": message,
                    "logprobs": self._logprobs(req, c),
                    "finish_reason": finish_reason,
                    "stop_reason": c.stop_reason,
                }
            )
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return JSONResponse(
            {
                "id": rid,
                "object": "chat.completion",
                "created": now(),
                "model": model,
                "choices": choices,
                "usage": usage(num_prompt, completion_tokens),
            }
        )

    def _logprobs(self, req: ChatCompletionRequest, c: CompletionOutput) -> dict[str, Any] | None:
        if req.num_logprobs is None or c.logprobs is None:
            return None
        return chat_logprobs(
            c.token_ids, c.logprobs, req.num_logprobs, lambda t: self.tokenizer.decode([t])
        )

    async def _stream(
        self,
        req: ChatCompletionRequest,
        rid: str,
        model: str,
        num_prompt: int,
        outputs: AsyncIterator[RequestOutput],
    ) -> AsyncIterator[str]:
        created = now()

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> str:
            body = {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": model,
                "choices": choices,
                **extra,
            }
            return sse(body)

        ended: set[int] = set()
        completion_tokens = 0
        plan = req.tool_plan
        calls_text = [""] * req.n  # a forced tool call's output, sent whole when it ends
        parsers = [self.parsers.choice(plan) for _ in range(req.n)]
        forced = plan is not None and not plan.auto
        # Logprobs of tokens whose text a parser or a forced call holds back: sent with it.
        held: list[list[dict[str, Any]] | None] = [None] * req.n
        try:
            # The role comes first, in a chunk of its own per choice, as OpenAI sends it.
            yield chunk(
                [
                    {
                        "index": i,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                    for i in range(req.n)
                ]
            )
            async for out in outputs:
                for c in out.outputs:
                    if c.index in ended or (not c.text and not c.token_ids and not c.finished()):
                        continue
                    completion_tokens += len(c.token_ids)
                    if c.finished():
                        ended.add(c.index)
                    delta = {"content": c.text} if c.text else {}
                    finish_reason = c.finish_reason
                    logprobs = self._logprobs(req, c)
                    if logprobs is not None:
                        held[c.index] = (held[c.index] or []) + logprobs["content"]
                    parser = parsers[c.index]
                    if parser is not None:
                        delta = parser.feed(c.text, final=c.finished())
                        if not delta and not c.finished():
                            continue
                        if c.finished() and parser.called:
                            finish_reason = "tool_calls"
                    if forced:
                        calls_text[c.index] += c.text
                        if not c.finished():
                            continue
                        delta, finish_reason = stream_tool_delta(
                            plan, calls_text[c.index], c.finish_reason
                        )
                    choice = {
                        "index": c.index,
                        "delta": delta,
                        "logprobs": None if held[c.index] is None else {"content": held[c.index]},
                        "finish_reason": finish_reason,
                    }
                    held[c.index] = None
                    if c.finished():
                        choice["stop_reason"] = c.stop_reason
                    if req.continuous_usage:
                        yield chunk([choice], usage=usage(num_prompt, completion_tokens))
                    else:
                        yield chunk([choice])
            if req.include_usage:
                yield chunk([], usage=usage(num_prompt, completion_tokens))
        except Exception as e:
            yield sse(error_of(e).body())
        finally:
            await outputs.aclose()  # type: ignore[attr-defined]
        yield sse("[DONE]")
