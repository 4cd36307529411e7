"""Request bodies of the OpenAI-compatible API, validated field by field.

Unknown fields are refused (a typo must not be silently ignored), and so are fields OpenAI
defines that this server does not implement yet; each error names the field.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from pagoda.entrypoints.openai.structured import (
    ResponseFormat,
    ToolCallPlan,
    constraint_field,
    request_constraint,
    tool_plan,
)
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams

# Fields OpenAI defines that Pagoda does not implement yet -> what would make them work.
_UNSUPPORTED = {
    "tools": "tool calling is only on /v1/chat/completions",
    "tool_choice": "tool calling is only on /v1/chat/completions",
    "functions": "the deprecated `functions` is not supported; use `tools`",
    "function_call": "the deprecated `function_call` is not supported; use `tool_choice`",
    "parallel_tool_calls": "tool calling is only on /v1/chat/completions",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
    "suffix": "suffix (insertion) is not supported",
    "web_search_options": "web search is not supported",
}

NonNegInt = Annotated[int, Field(ge=0)]
# Fields of _UNSUPPORTED that one endpoint implements (its request class names them).
_NONE: tuple[str, ...] = ()


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Body):
    """Sampling fields shared by completions and chat, OpenAI's and vLLM's extras."""

    _SUPPORTED_HERE: ClassVar[tuple[str, ...]] = _NONE

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = Field(None, ge=-1, lt=2**63)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[NonNegInt] | None = None
    bad_words: list[str] | None = None
    priority: int = Field(0, ge=-(2**63), lt=2**63)  # int64, as the engine's wire carries it
    request_id: str | None = Field(None, min_length=1, max_length=256)
    # Structured output: OpenAI's, vLLM's, and vLLM's older names (see ``structured.py``).
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Declared so that each gets its own clear error (see _UNSUPPORTED).
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    audio: Any = None
    prediction: Any = None
    suffix: Any = None
    web_search_options: Any = None

    @field_validator(*_UNSUPPORTED, mode="after")
    @classmethod
    def _refuse_unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        name = info.field_name or ""
        harmless = (
            value is None
            or name in cls._SUPPORTED_HERE
            or (name == "tool_choice" and value == "none")
        )
        if not harmless:
            raise ValueError(f"`{name}` is not supported by this server: {_UNSUPPORTED[name]}")
        return value

    @field_validator("stop")
    @classmethod
    def _stop_strings_not_empty(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_id_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not key.isdigit():
                raise ValueError(f"logit_bias keys are token ids; got {key!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("`stream_options` is only allowed with `stream` set to true")
        return self

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """vLLM's option: usage so far in every chunk of a stream."""
        return self.include_usage and self.stream_options.continuous_usage_stats  # type: ignore[union-attr]

    def output_constraint(self) -> StructuredOutputsParams | None:
        """The structured-output constraint the request asks for (``ValueError`` naming the
        field if it is malformed, or if several fields give one)."""
        return request_constraint(self)

    def constraint_field(self) -> str | None:
        """The field that gives the constraint, for errors that name it."""
        return constraint_field(self)

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters; raises ``ValueError`` naming a field for a bad combination."""
        fields = self.model_fields_set
        kwargs: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            if name in fields and getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        return SamplingParams(
            n=self.n,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            max_tokens=max_tokens,
            min_tokens=self.min_tokens,
            logprobs=logprobs,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=None
            if self.logit_bias is None
            else {int(k): v for k, v in self.logit_bias.items()},
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            structured_outputs=self.output_constraint(),
            **kwargs,
        )


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(None, ge=1)
    add_special_tokens: bool = True

    @field_validator("prompt")
    @classmethod
    def _prompt_not_empty(cls, value: Any) -> Any:
        if isinstance(value, list) and not value:
            raise ValueError("prompt must not be an empty list")
        return value

    @model_validator(mode="after")
    def _best_of_is_n(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("`best_of` other than `n` is not supported by this server")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt of the batch: text or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers

    @field_validator("content")
    @classmethod
    def _text_and_image_parts(cls, value: str | list[dict[str, Any]] | None) -> Any:
        if isinstance(value, list):
            for part in value:
                kind = part.get("type")
                if kind == "image_url":
                    _image_url(part)
                    continue
                if kind != "text":
                    raise ValueError(
                        f"content parts of type {kind!r} are not supported; this server takes"
                        " text and image_url parts"
                    )
                TextPart.model_validate(part)
        return value

    def image_urls(self) -> list[str]:
        """The URLs of its ``image_url`` parts, in order."""
        if not isinstance(self.content, list):
            return []
        return [_image_url(p) for p in self.content if p.get("type") == "image_url"]

    def template_dict(self, image_text: str = "") -> dict[str, Any]:
        """The message as chat templates read it; each image part becomes ``image_text`` (the
        model's placeholder) in the text."""
        content = self.content
        if isinstance(content, list):
            content = "".join(
                image_text if part.get("type") == "image_url" else part["text"] for part in content
            )
        role = "system" if self.role == "developer" else self.role
        out: dict[str, Any] = {"role": role, "content": content or ""}
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        return out


def _image_url(part: dict[str, Any]) -> str:
    """An ``image_url`` part's URL (``{"image_url": {"url": ...}}`` or ``{"image_url": ...}``)."""
    value = part.get("image_url")
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise ValueError("an image_url part needs image_url.url, a non-empty string")
    return url


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier call as chat templates read it (vLLM's way): ``arguments`` an object, not its
    JSON text; ``function``'s fields also at the top (some templates read ``call.name``)."""
    if not isinstance(call.get("function"), dict):
        return call  # not OpenAI's shape: the template sees it as sent
    function = dict(call["function"])
    args = function.get("arguments")
    if isinstance(args, str):
        try:
            function["arguments"] = json.loads(args)
        except ValueError:
            pass  # the template gets the text as it came
    return {**call, **function, "function": function}


class ChatCompletionRequest(_SamplingFields):
    _SUPPORTED_HERE: ClassVar[tuple[str, ...]] = ("tools", "tool_choice", "parallel_tool_calls")
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless server.trust_request_chat_template

    @model_validator(mode="after")
    def _logprob_fields(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("`top_logprobs` needs `logprobs` set to true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError(
                "`continue_final_message` and `add_generation_prompt` cannot both be true"
            )
        return self

    @property
    def tool_plan(self) -> ToolCallPlan | None:
        """The tool calls asked for: forced (``tool_choice`` required or a named function) or
        found by the parser (``auto``)."""
        return tool_plan(self.tools, self.tool_choice, self.parallel_tool_calls)

    def output_constraint(self) -> StructuredOutputsParams | None:
        return request_constraint(self, self.tool_plan)

    def constraint_field(self) -> str | None:
        return constraint_field(self, self.tool_plan)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # refused unless server.trust_request_chat_template

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[NonNegInt]


class LoadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoRAAdapterRequest(_Body):
    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None  # (vLLM's; the name is enough)
