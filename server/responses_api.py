"""`POST /v1/responses`, OpenAI's Responses API, served as a chat completion of one choice
(server/protocol_responses.py converts the body; server/routes_openai.py's `start_chat`
runs it), its answer rendered as a `response` object or streamed as the API's typed events.

The response's id is its completion's: it is what `POST /v1/feedback` labels and
`DELETE /v1/chat/completions/{id}` forgets, as for a chat completion. Its output is a
message (the answer's text) and a `function_call` item per call, in that order; an answer
cut by `max_output_tokens` is `incomplete`. A stream opens each item as it begins and sends
the text (`response.output_text.delta`) and a call's arguments
(`response.function_call_arguments.delta`) as the parser passes them on: as decoded for a
call the grammar forces, whole once its closing tag arrives for one the model chose.
"""

from __future__ import annotations

import json
import re
import time

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from engine.sampling_params import InvalidParameter
from server.errors import APIError, validation_error
from server.parsing import parse_body
from server.protocol import ChatCompletionRequest
from server.protocol_responses import ResponsesRequest
from server.responses import Choices
from server.routes_openai import ChatRun, start_chat
from server.state import ServerState
from server.streams import event_stream_response, sse_json, until_disconnect
from server.tool_calls import ToolCallDelta, ToolCallParser

# the chat request's names (as a pattern) for what a Responses body calls otherwise: an error names the field sent
_PARAMS = ((r"\bmax_completion_tokens\b", "max_output_tokens"), (r"\bresponse_format\b", "text.format"),
           (r"\bmessages\[\d+\]", "input"),  # (its turns are not input's items one for one)
           (r"\btools\[(\d+)\]\.function\.", r"tools[\1]."), (r"\btool_choice\.allowed_tools\.", "tool_choice."))
_NO_LOGPROBS = "message.output_text.logprobs"


def responses_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.post("/v1/responses")
    async def responses(request: Request):
        return await serve_response(state, request)

    return router


async def serve_response(state: ServerState, request: Request):
    body: ResponsesRequest = await parse_body(request, ResponsesRequest)
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true.", "stream_options")
    if _NO_LOGPROBS in (body.include or ()) or body.top_logprobs:
        raise APIError(400, "log-probabilities are not offered by /v1/responses here; /v1/chat/completions gives "
                            "them ('logprobs': true)", "include" if body.top_logprobs is None else "top_logprobs")
    try:
        chat = ChatCompletionRequest.model_validate(body.chat_body())
        run = await start_chat(state, request, chat, id_prefix="resp")
    except ValidationError as exc:
        raise _named_as_sent(validation_error(exc)) from None
    except InvalidParameter as exc:
        raise _named_as_sent(APIError(400, str(exc), exc.param, exc.code)) from None
    except APIError as exc:
        raise _named_as_sent(exc) from None
    answer = Answer(run, body, int(time.time()))
    if body.stream:
        return event_stream_response(answer.events(), state.engine, [run.request_id])

    async def whole():
        choices = Choices(1, 1)
        async for output in run.outputs:
            choices.add(output)
        answer.add_text(choices.texts[0])  # (the calls' pieces: the parser keeps the calls whole)
        return answer.finish(choices.reasons[0], choices.completion_tokens)

    result = await until_disconnect(request, whole())
    return result if result is not None else Response(status_code=499)


def _named_as_sent(exc: APIError) -> APIError:
    """The error with the Responses API's field names where the chat request's were."""
    for chat_name, name in _PARAMS:
        if exc.param:
            exc.param = re.sub(chat_name, name, exc.param)
        exc.message = re.sub(chat_name, name, exc.message)
    return exc


def output_usage(prompt_tokens: int, output_tokens: int) -> dict:
    return {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class Answer:
    """One response's output as it is decoded: its text, its function calls, and the
    `response` object that describes it at each moment."""

    def __init__(self, run: ChatRun, body: ResponsesRequest, created: int):
        self.run, self.body, self.created = run, body, created
        self.parser: ToolCallParser | None = run.parsers[0] if run.parsers else None
        self.text = ""
        self.text_ended = False
        self.message_id = "msg_" + run.request_id.rsplit("-", 1)[-1]
        self.sequence = 0
        # a streamed call's id, name and arguments so far, by its index among the parser's calls
        self.streamed: dict[int, list] = {}

    def add_text(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Feeds decoded text; returns what of it is the answer's text, and the calls' pieces."""
        deltas: list[ToolCallDelta] = []
        if self.parser is not None:
            text, deltas = self.parser.feed(text)
        self.text += text
        return text, deltas

    def end_text(self) -> tuple[str, list[ToolCallDelta]]:
        """What the parser held back until the end (nothing without tools)."""
        if self.parser is None or self.text_ended:
            return "", []
        self.text_ended = True  # (the parser counts its calls when it finishes: once)
        rest, deltas = self.parser.finish()
        self.text += rest
        return rest, deltas

    def message(self, status: str) -> dict:
        return {"type": "message", "id": self.message_id, "status": status, "role": "assistant",
                "content": [self.text_part(self.text)] if status != "in_progress" else []}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def calls(self) -> list[dict]:
        return [{"type": "function_call", "id": f"fc_{call.id}", "call_id": call.id, "name": call.name,
                 "arguments": call.arguments, "status": "completed"}
                for call in (self.parser.calls if self.parser is not None else [])]

    def has_message(self) -> bool:
        """An answer of calls alone has no message item; any other has one, empty or not."""
        return bool(self.text) or not self.calls()

    def output(self, order: list) -> list[dict]:
        """The output items in `order` ("message", or a call's index; the calls not in it
        after), a call only streamed (never ended: the parser dropped it) as far as it came."""
        calls = self.calls()
        order = order + [k for k in range(len(calls)) if k not in order]
        if self.has_message() and "message" not in order:
            order = ["message"] + order
        items = []
        for key in order:
            if key == "message":
                items.append(self.message("completed"))
            elif key < len(calls):
                items.append(calls[key])
            else:
                call_id, name = self.streamed[key][:2]
                items.append({"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
                              "arguments": self.streamed[key][2], "status": "incomplete"})
        return items

    def response(self, status: str, output: list[dict], output_tokens: int | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        body, chat_params = self.body, self.run.params
        return {
            "id": self.run.request_id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": None, "reasoning": {"effort": None, "summary": None},
            "store": False, "temperature": chat_params.temperature, "top_p": chat_params.top_p,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text is not None and body.text.format is not None else {"type": "text"})},
            "tool_choice": _dumped(body.tool_choice) if body.tool_choice is not None else "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
            "user": body.user,
            "usage": output_usage(self.run.num_prompt_tokens, output_tokens) if output_tokens is not None else None,
        }

    def finish(self, reason: str | None, output_tokens: int, order: list | None = None) -> dict:
        """The whole `response` object, once decoding ended for `reason`; `order`: the items'
        as a stream opened them (by default the message first)."""
        self.end_text()
        cut = reason == "length"
        status = "incomplete" if cut else "completed"
        output = self.output(order or [])
        if cut and output and not _whole_call(output[-1]):  # the limit cut the last item
            output[-1]["status"] = "incomplete"
        return self.response(status, output, output_tokens, "max_output_tokens" if cut else None)

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + sse_json(data) + b"\n\n"

    async def events(self):
        """The API's stream: created, in progress, then each output item as it opens — the
        message's text and a call's arguments as they are decoded — then each item done and
        completed (or incomplete); an error is an `error` event, then `response.failed`."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        order: list = []  # the items in the order they opened: "message", or a call's index
        reason, tokens = None, 0
        try:
            async for output in self.run.outputs:
                for choice in output.outputs:
                    tokens += len(choice.token_ids)
                    reason = choice.finish_reason or reason
                    text, deltas = self.add_text(choice.text)
                    if choice.finish_reason:
                        rest, more = self.end_text()
                        text, deltas = text + rest, deltas + more
                    for event in self._pieces(order, text, deltas):
                        yield event
        except APIError as exc:
            error = {"code": exc.code or exc.type, "message": exc.message}
            yield self.event("error", code=error["code"], message=exc.message, param=exc.param)
            yield self.event("response.failed", response=self.response("failed", [], tokens, error=error))
            return
        if reason == "abort":  # a shutdown cut the answer short (a disconnected client reads nothing)
            error = {"code": "server_shutting_down",
                     "message": "the server is shutting down: this answer was cut short; send the request again"}
            yield self.event("error", param=None, **error)
            yield self.event("response.failed", response=self.response("failed", [], tokens, error=error))
            return
        whole = self.finish(reason, tokens, order)
        for index, item in enumerate(whole["output"]):
            for event in self._close_item(index, item, order):
                yield event
        yield self.event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                         response=whole)

    def _pieces(self, order: list, text: str, deltas: list[ToolCallDelta]):
        """The events of new text and calls' pieces, opening their items as they begin."""
        if text:
            if "message" not in order:
                order.append("message")
                yield from self._open_message(len(order) - 1)
            yield self.event("response.output_text.delta", item_id=self.message_id,
                             output_index=order.index("message"), content_index=0, delta=text, logprobs=[])
        for delta in deltas:
            if delta.id is not None:  # a call begins
                order.append(delta.index)
                self.streamed[delta.index] = [delta.id, delta.name, ""]
                yield self.event("response.output_item.added", output_index=len(order) - 1, item={
                    "type": "function_call", "id": f"fc_{delta.id}", "call_id": delta.id, "name": delta.name,
                    "arguments": "", "status": "in_progress"})
            if delta.arguments and delta.index in self.streamed:
                call = self.streamed[delta.index]
                call[2] += delta.arguments
                yield self.event("response.function_call_arguments.delta", item_id=f"fc_{call[0]}",
                                 output_index=order.index(delta.index), delta=delta.arguments)

    def _open_message(self, index: int):
        yield self.event("response.output_item.added", output_index=index, item=self.message("in_progress"))
        yield self.event("response.content_part.added", item_id=self.message_id, output_index=index,
                         content_index=0, part=self.text_part(""))

    def _close_item(self, index: int, item: dict, order: list):
        """The end events of the whole response's output item `item` (its opening ones too,
        where nothing of it streamed: an empty message)."""
        if item["type"] == "message":
            if "message" not in order:
                yield from self._open_message(index)
            yield self.event("response.output_text.done", item_id=self.message_id, output_index=index,
                             content_index=0, text=self.text, logprobs=[])
            yield self.event("response.content_part.done", item_id=self.message_id, output_index=index,
                             content_index=0, part=self.text_part(self.text))
        else:
            yield self.event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                             name=item["name"], arguments=item["arguments"])
        yield self.event("response.output_item.done", output_index=index, item=item)


def _whole_call(item: dict) -> bool:
    """A function call whose arguments are a whole JSON object (a limit may cut the answer
    after its call ended, in what the model wrote next)."""
    if item["type"] != "function_call":
        return False
    try:
        return isinstance(json.loads(item["arguments"]), dict)
    except ValueError:
        return False


def _dumped(choice):
    return choice if isinstance(choice, str) else choice.model_dump(exclude_none=True)
