"""Structured output in the OpenAI API: ``response_format``, vLLM's ``structured_outputs`` and
``guided_*`` fields, and forced tool calls (``tool_choice`` ``required`` or a named function),
turned into the engine's :class:`StructuredOutputsParams`; and forced calls' output as
``tool_calls``.

A forced call constrains the output to JSON: a named function's output is its arguments (an
object of its ``parameters`` schema); ``required`` gives an array of ``{"name", "parameters"}``
objects, one per call, each for one of the tools. ``tool_choice: auto`` (the default with
``tools``) needs a tool-call parser that finds calls in free text (``chat_parsers.py``); it is
refused by name unless the server enables it (``--enable-auto-tool-choice``).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError

from pagoda.sampling_params import StructuredOutputsParams

GUIDED_FIELDS = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class JSONSchemaFormat(_Body):
    name: str = Field("response", min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the output always follows the schema here, strict or not


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class _FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"] = "function"
    function: _FunctionName


_TOOLS = TypeAdapter(list[Tool])
_CHOICE = TypeAdapter(Literal["none", "auto", "required"] | NamedToolChoice)


@dataclass
class ToolCallPlan:
    """What a forced tool call expects of the output."""

    tools: list[Tool]
    function: str | None  # the named function; None: ``required`` or ``auto``
    parallel: bool = True  # ``required``, ``auto``: more than one call allowed
    auto: bool = False  # ``auto``: free text, calls found by the tool-call parser

    def tool_calls(self, text: str) -> list[dict[str, Any]] | None:
        """The OpenAI ``tool_calls`` of a finished output (JSON the grammar produced), or None
        if the output is not complete JSON (cut by ``max_tokens``)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.function is not None:
            calls = [(self.function, text)]
        else:
            calls = [(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in value]
        return [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for name, arguments in calls
        ]

    @property
    def finish_reason(self) -> str:
        return "stop" if self.function is not None else "tool_calls"


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def tool_plan(
    tools: Any, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolCallPlan | None:
    """The forced call a chat request asks for, or None (no tools, or ``tool_choice: none``).
    Raises ``ValueError`` naming the field."""
    if tools is None:
        if tool_choice not in (None, "none"):
            raise ValueError("`tool_choice` needs `tools`")
        return None
    try:
        parsed = _TOOLS.validate_python(tools)
    except ValidationError as e:
        raise ValueError(
            f"`tools` is not a list of function tools: {e.errors()[0]['msg']}"
        ) from None
    if not parsed:
        raise ValueError("`tools` must not be empty")
    try:
        choice = _CHOICE.validate_python("auto" if tool_choice is None else tool_choice)
    except ValidationError:
        raise ValueError(
            "`tool_choice` must be none, auto, required or {'type': 'function', 'function': "
            "{'name': ...}}"
        ) from None
    if choice == "none":
        return None
    for tool in parsed:
        _check_parameters(tool)
    if choice == "auto":
        return ToolCallPlan(parsed, None, parallel_tool_calls is not False, auto=True)
    if isinstance(choice, NamedToolChoice):
        names = [t.function.name for t in parsed]
        if choice.function.name not in names:
            raise ValueError(
                f"`tool_choice` names function {choice.function.name!r}, which is not in "
                f"`tools` ({', '.join(names)})"
            )
        return ToolCallPlan(parsed, choice.function.name)
    return ToolCallPlan(parsed, None, parallel_tool_calls is not False)


_SCHEMA_TYPES = {"object", "array", "string", "number", "integer", "boolean", "null"}


def _check_schema(schema: Any, where: str) -> None:
    """The shape of a JSON schema, checked enough to refuse what no parser or grammar can use:
    ``ValueError`` naming the place."""
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise ValueError(f"{where} is not a JSON schema (an object)")
    kinds = schema.get("type")
    for kind in kinds if isinstance(kinds, list) else [] if kinds is None else [kinds]:
        if kind not in _SCHEMA_TYPES:
            raise ValueError(f"{where}: `type` {kind!r} is not a JSON schema type")
    props = schema.get("properties")
    if props is not None:
        if not isinstance(props, dict):
            raise ValueError(f"{where}: `properties` must be an object")
        for key, sub in props.items():
            _check_schema(sub, f"{where}.properties.{key}")
    required = schema.get("required")
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(r, str) for r in required)
    ):
        raise ValueError(f"{where}: `required` must be a list of property names")
    items = schema.get("items")
    if items is not None:
        _check_schema(items, f"{where}.items")


def _check_parameters(tool: Tool) -> None:
    params = tool.function.parameters
    if params is None:
        return
    where = f"`tools` function {tool.function.name!r}: `parameters`"
    _check_schema(params, where)
    if params.get("type", "object") != "object":
        raise ValueError(f"{where} must describe an object (`type` object)")


def tool_constraint(plan: ToolCallPlan) -> StructuredOutputsParams:
    if plan.function is not None:
        tool = next(t for t in plan.tools if t.function.name == plan.function)
        return StructuredOutputsParams(json=_parameters(tool))
    call = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    "parameters": _parameters(t),
                },
                "required": ["name", "parameters"],
            }
            for t in plan.tools
        ]
    }
    calls: dict[str, Any] = {"type": "array", "items": call, "minItems": 1}
    if not plan.parallel:
        calls["maxItems"] = 1
    return StructuredOutputsParams(json=calls)


def request_constraint(
    req: Any, plan: ToolCallPlan | None = None
) -> StructuredOutputsParams | None:
    """The one constraint a request asks for, from whichever field gives it; ``ValueError``
    naming the fields if several do."""
    found = _constraints(req, plan)
    if len(found) > 1:
        names = ", ".join(f"`{n}`" for n, _ in found)
        raise ValueError(f"give one output constraint; this request has {names}")
    return found[0][1] if found else None


def constraint_field(req: Any, plan: ToolCallPlan | None = None) -> str | None:
    """The request field that gives its constraint (``response_format``, ``guided_json``,
    ``tool_choice``, ...), for errors that name what the client sent; None if none does."""
    found = _constraints(req, plan)
    return found[0][0] if len(found) == 1 else None


def _constraints(req: Any, plan: ToolCallPlan | None) -> list[tuple[str, StructuredOutputsParams]]:
    found: list[tuple[str, StructuredOutputsParams]] = []
    rf = req.response_format
    if rf is not None:
        fmt = ResponseFormat.model_validate(rf) if isinstance(rf, dict) else rf
        if fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True)))
        elif fmt.type == "json_schema":
            if fmt.json_schema is None:
                raise ValueError("`response_format` of type json_schema needs `json_schema`")
            schema = fmt.json_schema.schema_ or {"type": "object"}
            found.append(("response_format", StructuredOutputsParams(json=schema)))
    if req.structured_outputs is not None:
        so = req.structured_outputs
        try:
            params = (
                so if isinstance(so, StructuredOutputsParams) else StructuredOutputsParams(**so)
            )
        except TypeError as e:
            raise ValueError(f"`structured_outputs`: {e}") from None
        found.append(("structured_outputs", params))
    for name, kind in GUIDED_FIELDS.items():
        value = getattr(req, name)
        if value is not None:
            found.append((name, StructuredOutputsParams(**{kind: value})))
    if plan is not None and not plan.auto:
        found.append(("tool_choice", tool_constraint(plan)))
    return found


def chat_message(
    plan: ToolCallPlan | None, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """A finished choice's ``message`` and ``finish_reason``: a forced call's output as
    ``tool_calls`` (its text as content if it did not complete)."""
    calls = None if plan is None else plan.tool_calls(text)
    if calls is None:
        return {"role": "assistant", "content": text}, finish_reason
    return {"role": "assistant", "content": None, "tool_calls": calls}, plan.finish_reason


def stream_tool_delta(
    plan: ToolCallPlan, text: str, finish_reason: str | None
) -> tuple[dict[str, Any], str | None]:
    """The one ``delta`` a stream sends for a forced call's finished output (the calls whole)."""
    message, finish = chat_message(plan, text, finish_reason)
    if "tool_calls" not in message:
        return {"content": text}, finish
    calls = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return {"tool_calls": calls}, finish
