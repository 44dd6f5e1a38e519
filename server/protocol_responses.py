"""The body of OpenAI's Responses API (`POST /v1/responses`), validated as strictly as the
chat body (server/protocol.py), and its conversion to the chat request it is served as.

A response is a chat completion of one choice: `instructions` are the system turn, `input`
a string (one user turn) or items (server/protocol_items.py) — messages, the model's function
calls and their outputs (what the SDK and OpenAI's Agents SDK send back each turn) — and
`text.format` is `response_format`. `previous_response_id` continues a stored response
(server/responses_stored.py): its conversation's items come before `input`, under this
request's `instructions` only (as OpenAI: the earlier instructions are not carried over).
`conversation` (OpenAI's Conversations API) is refused; `truncation: "auto"` drops a
conversation's oldest turns until it fits the context (server/responses_truncation.py). Fields that do not change generation here (metadata, user,
reasoning, service tier, `max_tool_calls`, which bounds calls of OpenAI's built-in tools, none
offered here, ...) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BeforeValidator, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from server.protocol_fields import (TOOL_CHOICE_TYPES, Int, LimitFrom1, Metadata, Strict, documented,
                                    drop_unasked)
from server.protocol_items import KNOWN_ITEMS, FunctionCallItem, InputItem, InputMessage, ReasoningItem, item_kind
from server.tool_calls import NAME_PATTERN

# fields of OpenAI's Responses API that this server does not offer, and what to send instead (null: not asked)
NOT_OFFERED = {
    "conversation": "the Conversations API is not offered here; continue a stored response with "
                    "'previous_response_id', or send the whole conversation as 'input'",
}


# the prefix of an input item's id, by type, where the client gave it none
_ITEM_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


class FunctionTool(Strict):
    type: Literal["function"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionChoice(Strict):
    type: Literal["function"]
    name: str


class AllowedToolsChoice(Strict):
    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: documented(list[FunctionChoice], minItems=1)


class TextFormat(Strict):
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={
        "if": {"properties": {"type": {"const": "json_schema"}}},
        "then": {"required": ["name", "schema"]}})

    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(pattern=NAME_PATTERN)] | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # ("schema" would shadow BaseModel's)
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_named(self):
        """A `json_schema` format has its schema and a name, as OpenAI requires."""
        for field, name in (("name", "name"), ("schema_", "schema")):
            if self.type == "json_schema" and getattr(self, field) is None:
                raise PydanticCustomError("format_incomplete", "a text.format of type json_schema needs '{name}'",
                                          {"name": name})
        return self


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesStreamOptions(Strict):
    include_obfuscation: bool | None = None


def _a_boolean(value):
    if not isinstance(value, bool):
        raise PydanticCustomError("bool_type", "Input should be a valid boolean")
    return value


class ResponsesRequest(Strict):
    # an input is required unless a stored conversation is continued (OpenAI's rule; `input_error`)
    model_config = ConfigDict(**Strict.model_config, json_schema_extra={
        "if": {"properties": {"previous_response_id": {"type": "null"}}},
        "then": {"required": ["input"], "properties": {"input": {"anyOf": [{"type": "string"},
                                                                            {"type": "array", "minItems": 1}]}}}})

    model: str
    # with `previous_response_id` it may be left out (the conversation goes on as it stands)
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: LimitFrom1 | None = None
    temperature: documented(float, minimum=0, maximum=2) | None = None
    top_p: documented(float, exclusiveMinimum=0, maximum=1) | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Annotated[Literal["none", "auto", "required"] | FunctionChoice | AllowedToolsChoice | None,
                           TOOL_CHOICE_TYPES] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool | None = False
    stream_options: ResponsesStreamOptions | None = None
    top_logprobs: documented(Int, minimum=0, maximum=0) | None = None
    # a stored response this one continues (server/response_store.py)
    previous_response_id: Annotated[str, Field(min_length=1)] | None = None
    # false: this response is not stored (it cannot be retrieved or continued)
    store: bool | None = None
    # OpenAI's, without effect here
    metadata: Metadata | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    # vLLM's (server/protocol.py)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    prompt_cache_retention: str | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    # false or absent: a literal's check alone takes 0 and 0.0 as false (they equal it)
    background: Annotated[Literal[False], BeforeValidator(_a_boolean)] | None = None
    max_tool_calls: documented(Int, minimum=1) | None = None
    # alchemist: false keeps this request out of online training
    train: bool = True

    @model_validator(mode="before")
    @classmethod
    def _unasked(cls, data):
        """A null field this server does not offer is not asked (errors.py names one sent)."""
        return drop_unasked(data, NOT_OFFERED)

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value):
        for i, item in enumerate(value if isinstance(value, list) else ()):
            kind = item_kind(item)
            if isinstance(kind, str) and kind not in KNOWN_ITEMS:
                raise PydanticCustomError("unsupported_item", "input[{i}] is an item of type '{kind}', which is not "
                                          "supported: messages, function calls and their outputs, and reasoning are",
                                          {"i": i, "kind": kind})
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value):
        for i, tool in enumerate(value if isinstance(value, list) else ()):
            kind = tool.get("type") if isinstance(tool, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError("unsupported_tool", "tools[{i}] is of type '{kind}', which is not offered: "
                                          "this server offers function tools", {"i": i, "kind": kind})
        return value

    def chat_body(self, context: list | None = None) -> dict:
        """The chat completion request this response is served as (a dict for
        ChatCompletionRequest, so that one validation path checks both); `context`: the
        items of the conversation it continues (`conversation_items`), before its input."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(context or []), "train": self.train}
        for ours, theirs in (("max_output_tokens", "max_completion_tokens"), ("temperature", "temperature"),
                             ("top_p", "top_p")):
            if getattr(self, ours) is not None:
                body[theirs] = getattr(self, ours)
        if self.cache_salt is not None:
            body["cache_salt"] = self.cache_salt
        if self.tools and self.parallel_tool_calls is not None:  # (the Responses API takes it without tools)
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tools:
            body["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                             for tool in self.tools]
        if self.tool_choice is not None:
            body["tool_choice"] = self._chat_tool_choice()
        text_format = self.text.format if self.text is not None else None
        if text_format is not None and text_format.type != "text":
            body["response_format"] = {"type": text_format.type}
            if text_format.type == "json_schema":
                body["response_format"]["json_schema"] = {
                    "name": text_format.name,
                    **text_format.model_dump(by_alias=True, include={"description", "schema_", "strict"},
                                             exclude_none=True)}
        return body

    def input_items(self, response_key: str) -> list[dict]:
        """This request's input as `GET /v1/responses/{id}/input_items` lists it: items with
        ids (`<kind>_<response_key>_in<index>` where the client gave none), a message's text
        as parts."""
        items = self.input_models()
        listed = []
        for index, item in enumerate(items):
            entry = item.model_dump(exclude_none=True)
            entry.setdefault("id", f"{_ITEM_ID_PREFIXES[entry['type']]}_{response_key}_in{index}")
            if entry["type"] != "reasoning":
                entry.setdefault("status", "completed")
            if isinstance(entry.get("content"), str):
                part = "output_text" if entry["role"] == "assistant" else "input_text"
                entry["content"] = [{"type": part, "text": entry["content"]}]
            for part in entry.get("content") or ():
                if part["type"] == "output_text":
                    part.setdefault("annotations", [])
            listed.append(entry)
        return listed

    def input_error(self) -> tuple[str, str] | None:
        """What is wrong with `input` (a message and its code), where nothing continues: it
        is then required, and not empty."""
        if self.previous_response_id is not None:
            return None
        if self.input is None:
            return "Missing required parameter: 'input'.", "missing_required_parameter"
        if self.input == []:
            return ("Invalid value for 'input': List should have at least 1 item after validation, not 0 (an "
                    "empty input continues only a stored response, given as 'previous_response_id').",
                    "invalid_value")
        return None

    def input_models(self) -> list:
        """`input` as items (a string is one user message; none, no item)."""
        if isinstance(self.input, str):
            return [InputMessage(role="user", content=self.input)]
        return list(self.input or ())

    def _chat_tool_choice(self):
        choice = self.tool_choice
        if isinstance(choice, FunctionChoice):
            return {"type": "function", "function": {"name": choice.name}}
        if isinstance(choice, AllowedToolsChoice):
            named = [{"type": "function", "function": {"name": tool.name}} for tool in choice.tools]
            return {"type": "allowed_tools", "allowed_tools": {"mode": choice.mode, "tools": named}}
        return choice

    def _messages(self, context: list) -> list[dict]:
        """`instructions`, then `context` and `input`, as chat turns: an assistant's reasoning
        opens its turn and its function calls join it (one turn of reasoning, text and
        calls), their outputs are tool turns."""
        messages: list[dict] = [{"role": "system", "content": self.instructions}] if self.instructions else []
        items = [*context, *self.input_models()]
        reasoning = None  # a reasoning item's text, for the assistant turn it opens
        for item in items:
            if isinstance(item, ReasoningItem):
                reasoning = item.text()
                messages.append({"role": "assistant", "content": None, "reasoning_content": reasoning})
            elif isinstance(item, InputMessage):
                if item.role == "assistant" and reasoning is not None and messages[-1].get("content") is None \
                        and "tool_calls" not in messages[-1]:
                    messages[-1]["content"] = item.text()  # the message its reasoning opened
                else:
                    messages.append({"role": item.role, "content": item.text()})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if not (messages and messages[-1]["role"] == "assistant"):
                    messages.append({"role": "assistant", "content": None})
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
            if not isinstance(item, ReasoningItem):
                reasoning = None
        return messages
