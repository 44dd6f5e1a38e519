"""The Responses API's bodies (`POST /v1/responses`, a stored response and its input items)
as pydantic models, as server/response_schemas.py describes the other routes' (its rules
hold here: the schema fuzzer checks every response against them)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputText(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict]
    logprobs: list[dict]


class OutputMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["assistant"]
    content: list[OutputText]


class ReasoningText(BaseModel):
    type: Literal["reasoning_text"]
    text: str


class OutputReasoning(BaseModel):
    """With a reasoning parser (`--reasoning-parser`): the answer's <think> section."""

    type: Literal["reasoning"]
    id: str
    status: ItemStatus
    summary: list[dict]
    content: list[ReasoningText]


class OutputFunctionCall(BaseModel):
    type: Literal["function_call"]
    id: str
    call_id: str  # what the call's `function_call_output` item names
    name: str
    arguments: str  # a JSON object, as text
    status: ItemStatus


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int]
    output_tokens: int
    output_tokens_details: dict[str, int]
    total_tokens: int


class ResponseError(BaseModel):
    code: str | None
    message: str


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ModelResponse(BaseModel):
    """A whole response of OpenAI's Responses API; with `"stream": true` the body is instead a
    text/event-stream of the API's typed events (`response.created` ... `response.completed`),
    each `data` an object with its `type` and `sequence_number`."""

    id: str  # the completion's id: what POST /v1/feedback labels
    object: Literal["response"]
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None
    incomplete_details: IncompleteDetails | None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]]
    parallel_tool_calls: bool
    previous_response_id: str | None  # the stored response it continued
    reasoning: dict
    store: bool
    temperature: float | None
    top_p: float | None
    text: dict
    tool_choice: str | dict
    tools: list[dict]
    truncation: Literal["auto", "disabled"]
    metadata: dict[str, str]
    user: str | None
    usage: ResponseUsage | None


class ListedMessage(BaseModel):
    type: Literal["message"]
    id: str
    status: ItemStatus
    role: Literal["user", "assistant", "system", "developer"]
    content: list[dict]  # input_text parts (output_text in an assistant's)


class ListedFunctionCallOutput(BaseModel):
    type: Literal["function_call_output"]
    id: str
    call_id: str
    output: str | list[dict]
    status: ItemStatus


class ListedReasoning(BaseModel):
    type: Literal["reasoning"]
    id: str
    summary: list[dict] | None = None
    content: list[ReasoningText] | None = None


class InputItemList(BaseModel):
    """A stored response's input (OpenAI's `input_items`), a page at a time: `limit` items
    (1..100, 20 by default) in `order` (desc by default), from the one after item `after`."""

    object: Literal["list"]
    data: list[Annotated[ListedMessage | OutputFunctionCall | ListedFunctionCallOutput | ListedReasoning,
                         Field(discriminator="type")]]
    first_id: str | None
    last_id: str | None
    has_more: bool
