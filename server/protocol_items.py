"""The items of the Responses API's `input` (server/protocol_responses.py's body holds them):
messages, the model's function calls and their outputs, and reasoning — as a client writes
them, or sends them back as the API returned them — and the rules a conversation of them
keeps (each id once; every call answered, every output a call's).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import Discriminator, Field, Tag, TypeAdapter, field_validator, model_validator

from server.protocol_fields import Strict, only_parts

# an item's status, as the API gives it (and a client sends an item back)
ItemStatus = Literal["in_progress", "completed", "incomplete"]
# items of the API's input this server does not take, and why (an item of another type is refused by its type)
KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


class _SentBack(Strict):
    """An item or part a client may send back as the API returned it: the SDK's objects
    carry fields that newer versions of the API added, null where unused; a null field is
    not asked (any other unknown field is still refused)."""

    @model_validator(mode="before")
    @classmethod
    def _nulls_unasked(cls, data):
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class InputText(_SentBack):
    type: Literal["input_text"]
    text: str


class OutputText(_SentBack):
    """A part of an earlier answer, as this API returned it (sent back with its message)."""

    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


TextParts = Annotated[list[Annotated[Union[InputText, OutputText], Field(discriminator="type")]], Field(min_length=1)]


class InputMessage(_SentBack):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | TextParts
    # what the SDK sends back with an output message
    id: str | None = None
    status: ItemStatus | None = None

    _parts = field_validator("content", mode="before")(only_parts("input_text", "output_text"))

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "\n".join(part.text for part in self.content)


class FunctionCallItem(_SentBack):
    """A function call the model made in an earlier turn."""

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str  # a JSON object, as text
    id: str | None = None
    status: ItemStatus | None = None


class ReasoningTextPart(_SentBack):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(_SentBack):
    """An earlier answer's reasoning, as this API returned it (`--reasoning-parser`): the
    assistant turn it opens carries it to the chat template as `reasoning_content` (Qwen3's
    renders it in a tool loop; others drop it)."""

    type: Literal["reasoning"]
    id: str | None = None
    status: ItemStatus | None = None
    summary: list[dict[str, Any]] | None = None
    content: list[ReasoningTextPart] | None = None
    encrypted_content: str | None = None

    def text(self) -> str:
        return "\n".join(part.text for part in self.content or ())


class FunctionCallOutputItem(_SentBack):
    """A function call's result, which the next turn is answered with."""

    type: Literal["function_call_output"]
    call_id: str
    output: str | TextParts
    id: str | None = None
    status: ItemStatus | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "\n".join(part.text for part in self.output)


def item_kind(value) -> str:
    """An item's type; "message" where it has none (or one that is not a string, which the message refuses)."""
    kind = value.get("type", "message") if isinstance(value, dict) else "message"
    return kind if isinstance(kind, str) else "message"


def _item_model(value) -> str:
    """The item's model, by its type (named as errors.py leaves a union member out of a field's path)."""
    return {"function_call": "FunctionCallItem", "function_call_output": "FunctionCallOutputItem",
            "reasoning": "ReasoningItem"}.get(item_kind(value), "InputMessage")


InputItem = Annotated[Union[Annotated[InputMessage, Tag("InputMessage")],
                            Annotated[FunctionCallItem, Tag("FunctionCallItem")],
                            Annotated[FunctionCallOutputItem, Tag("FunctionCallOutputItem")],
                            Annotated[ReasoningItem, Tag("ReasoningItem")]],
                      Discriminator(_item_model)]

def conversation_error(items: list) -> tuple[str, str] | None:
    """What breaks OpenAI's rules in a conversation's items (its stored turns', then the
    request's input), and its error code: an item id given twice (the conversation's items
    sent back beside `previous_response_id` too), an output naming no earlier call, a call
    left without its output. None: they keep them."""
    seen: set[str] = set()
    calls: list[str] = []
    answered: set[str] = set()
    for item in items:
        if item.id is not None:
            if item.id in seen:
                return f"Duplicate item found with id '{item.id}' (send each item once: a continued " \
                       "conversation's items are not sent again)", "duplicate_item"
            seen.add(item.id)
        if isinstance(item, FunctionCallItem):
            calls.append(item.call_id)
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in calls:
                return f"No tool call found for function call output with call_id {item.call_id}.", "invalid_value"
            answered.add(item.call_id)
    unanswered = [call for call in calls if call not in answered]
    return (f"No tool output found for function call {unanswered[0]}.", "invalid_value") if unanswered else None


# a stored conversation's items (server/response_store.py), read back as input
CONVERSATION_ITEMS = TypeAdapter(list[InputItem])
