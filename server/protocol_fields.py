"""The building blocks of the request bodies (server/protocol.py): strict objects,
integers, token ids and chat messages.

Strict: wrong types are rejected, not coerced ("5" is not a number), and unknown fields
are rejected, so that a typo does not pass silently.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


# vLLM's chat template controls: `continue_final_message` goes on with the last message, and
# `add_generation_prompt` (true unless sent, or unless `continue_final_message` is) opens a new
# one: both sent true is refused (server/parsing.py), and the schema says so
TEMPLATE_CONTROLS_SCHEMA = {"not": {
    "required": ["add_generation_prompt", "continue_final_message"],
    "properties": {"add_generation_prompt": {"const": True}, "continue_final_message": {"const": True}}}}


# `parallel_tool_calls`, and a `tool_choice` other than "none", need tools offered (OpenAI
# refuses them otherwise, and so does server/protocol.py): the schema says so
TOOLS_NEEDED_SCHEMA = {
    "if": {"anyOf": [{"required": ["parallel_tool_calls"], "properties": {"parallel_tool_calls": {"type": "boolean"}}},
                     {"required": ["tool_choice"], "properties": {"tool_choice": {"not": {"enum": [None, "none"]}}}}]},
    "then": {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}}


def non_empty_alternatives(schema: dict) -> None:
    """A union field's schema (`json_schema_extra`) says what the server refuses in every
    alternative: an empty string, or an empty array at any depth. The server's own check
    keeps its message; the schema only stops promising that an empty one is accepted."""
    def visit(node: dict) -> None:
        if node.get("type") == "string":
            node["minLength"] = 1
        elif node.get("type") == "array":
            node["minItems"] = 1
            visit(node.get("items", {}))

    for alternative in schema.get("anyOf", []):
        visit(alternative)


def _integral(value):
    """22.0 is the integer 22 in JSON (and in JSON Schema's `integer`); 22.5 stays a float, and is refused."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# an integer field: strict (no "5", no true), but a JSON number with no fraction is accepted;
# with bounds, INTEGRAL goes after the Field so that the schema keeps minimum/maximum
INTEGRAL = BeforeValidator(_integral)
Int = Annotated[int, INTEGRAL]


def documented(kind, **bounds):
    """`kind` with `bounds` in its schema alone (JSON Schema's keywords): the server's own
    check (engine/sampling_params.py) keeps its message; the document stops promising
    that a value it refuses is accepted (a fuzzer's valid examples, a client's validator)."""
    return Annotated[kind, Field(json_schema_extra=bounds)]


# output limits: the bound is in the schema, and checked by the request (its error names the field)
LimitFrom0 = documented(Int, minimum=0)
LimitFrom1 = documented(Int, minimum=1)
# token ids (their keys) to a bias of -100 .. 100
LogitBias = documented(dict[str, float], propertyNames={"pattern": "^[0-9]+$"},
                       additionalProperties={"type": "number", "minimum": -100, "maximum": 100})
# a token id: the served vocabulary's size bounds it in the OpenAPI document (server/openapi.py)
# and in the engine's checks
TokenId = Annotated[int, Field(ge=0, json_schema_extra={"x-token-id": True}), INTEGRAL]


# OpenAI's bounds on `metadata`: 16 pairs, keys of at most 64 characters, values of at most 512
Metadata = Annotated[dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]],
                     Field(max_length=16)]


class StreamOptions(Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI's random padding of stream events (against side channels): none is sent here
    include_obfuscation: bool | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str


def only_parts(*kinds: str):
    """A validator of a message's content: parts of other types (images, audio, files) are
    refused by their type, not as a list that should have been a string."""
    accepted = " and ".join(f"'{kind}'" for kind in kinds)

    def check(content):
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if isinstance(kind, str) and kind not in kinds:
                raise PydanticCustomError("unsupported_content_part", "content parts of type '{kind}' are not "
                                          "supported: only parts of type {accepted} are accepted",
                                          {"kind": kind, "accepted": accepted})
        return content

    return check


def only_object_types(field: str, *kinds: str):
    """A validator of a field that takes a string or objects told apart by their `type`: an
    object of another type is refused by its type (a union's first member would say only
    what it expected)."""
    accepted = " or ".join(f"'{kind}'" for kind in kinds)

    def check(value):
        kind = value.get("type", kinds[0]) if isinstance(value, dict) else kinds[0]
        if kind not in kinds:
            shown = f"'{kind}'" if isinstance(kind, str) else json.dumps(kind)[:80]
            raise PydanticCustomError("unknown_object_type", "{field} of type {kind} is not supported: its type "
                                      "must be {accepted}", {"field": field, "kind": shown, "accepted": accepted})
        return value

    return check


# OpenAI's `tool_choice` objects, on chat and the Responses API: one of another type is refused by its type
TOOL_CHOICE_TYPES = BeforeValidator(only_object_types("tool_choice", "function", "allowed_tools"))


def drop_unasked(data, names) -> object:
    """A body without the fields of `names` sent as null (a field not offered, sent null, is not asked)."""
    if isinstance(data, dict) and any(data.get(name, 0) is None for name in names):
        return {k: v for k, v in data.items() if not (k in names and v is None)}
    return data


class FunctionCall(Strict):
    name: str
    arguments: str  # a JSON object, as text


class MessageToolCall(Strict):
    """A tool call of an earlier assistant turn, as the API returned it."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall
    # streamed tool calls carry their position; clients (litellm) pass it back with the message
    index: Int | None = None


class ChatMessage(Strict):
    # a tool result names the call it answers, and only an assistant's turn may go without content (its
    # tool calls): the schema says so, server/protocol.py refuses the rest
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={"allOf": [
        {"anyOf": [{"properties": {"role": {"not": {"const": "tool"}}}},
                   {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}]},
        {"anyOf": [{"properties": {"role": {"const": "assistant"}}},
                   {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}}]}]})

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Annotated[str | Annotated[list[TextPart], Field(min_length=1)] | None,
                       BeforeValidator(only_parts("text"))] = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    refusal: str | None = None
    # an earlier answer's reasoning, as `--reasoning-parser` returned it (under vLLM's name or its
    # earlier one, DeepSeek's): given to the chat template as `reasoning_content` (Qwen3's renders
    # it for the turns after the last user message, a tool loop's; others drop it)
    reasoning: str | None = None
    reasoning_content: str | None = None
    # what the SDK sends back when a returned message is appended as is; not used here
    annotations: list[dict[str, Any]] | None = None
    audio: dict[str, Any] | None = None
    function_call: dict[str, Any] | None = None

    def template_dict(self) -> dict:
        """This turn as a chat template reads it (OpenAI's developer role is a system turn)."""
        entry: dict[str, Any] = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.name is not None:
            entry["name"] = self.name
        if self.tool_calls:
            entry["tool_calls"] = [call.model_dump(exclude={"index"}) for call in self.tool_calls]
        if self.tool_call_id is not None:
            entry["tool_call_id"] = self.tool_call_id
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning is not None:
            entry["reasoning_content"] = reasoning
        return entry

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(part.text for part in self.content)  # as vLLM joins them
