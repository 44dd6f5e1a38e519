"""`POST /v1/responses`, OpenAI's Responses API, served as a chat completion of one choice
(server/protocol_responses.py converts the body; server/routes_openai.py's `start_chat`
runs it), its answer rendered as a `response` object or streamed as the API's typed events.

The response's id is its completion's: it is what `POST /v1/feedback` labels and
`DELETE /v1/responses/{id}` forgets, as for a chat completion. A finished response is
stored unless it says `"store": false`, and `previous_response_id` continues one
(server/responses_stored.py). Its output is messages (the
answer's text) and a `function_call` item per call; an answer cut by `max_output_tokens`
is `incomplete`. With a reasoning parser (server/reasoning.py), the answer's <think> section is a
`reasoning` item before them (`response.reasoning_text.delta` as it streams). Items come in the order
written (a run of text is a message); a stream
opens each as it begins, sends its text
(`response.output_text.delta`) or a call's arguments (`response.function_call_arguments.delta`)
as the parser passes them on — as decoded for a call the grammar forces, whole once its
closing tag arrives for one the model chose — and ends it before the next opens.
"""

from __future__ import annotations

import json
import re
import time

from fastapi import APIRouter, Request, Response
from pydantic import ValidationError

from engine.sampling_params import InvalidParameter
from server.errors import APIError, validation_error
from server.parsing import check_unsupported, parse_body
from server.protocol import ChatCompletionRequest
from server.protocol_items import conversation_error
from server.protocol_responses import ResponsesRequest
from server.reasoning import ReasoningSplitter
from server.responses_stored import conversation_before, keep_response
from server.responses_truncation import fit_to_context
from server.routes_openai import ChatRun, start_chat
from server.state import ServerState
from server.streams import event_stream_response, sse_json, until_disconnect
from server.tool_calls import ToolCallParser

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
    check_unsupported(body)
    wrong = body.input_error()
    if wrong is not None:
        message, code = wrong
        raise APIError(400, message, "input", code)
    if _NO_LOGPROBS in (body.include or ()) or body.top_logprobs:
        raise APIError(400, "log-probabilities are not offered by /v1/responses here; /v1/chat/completions gives "
                            "them ('logprobs': true)", "include" if body.top_logprobs is None else "top_logprobs")
    context = await conversation_before(state, request, body)
    broken = conversation_error([*context, *body.input_models()])
    if broken is not None:
        message, code = broken
        raise APIError(400, message, "input", code)
    served = body
    try:
        if body.truncation == "auto":  # the conversation, flat, without the oldest turns that do not fit
            fitted = await fit_to_context(state, body, [*context, *body.input_models()])
            served, context = body.model_copy(update={"input": fitted}), []
        chat = ChatCompletionRequest.model_validate(served.chat_body(context))
        run = await start_chat(state, request, chat, id_prefix="resp_")
    except ValidationError as exc:
        raise _named_as_sent(validation_error(exc)) from None
    except InvalidParameter as exc:
        raise _named_as_sent(APIError(400, str(exc), exc.param, exc.code)) from None
    except APIError as exc:
        raise _named_as_sent(exc) from None
    answer = Answer(run, body, int(time.time()), stored=state.responses is not None and body.store is not False)
    keep = lambda response: keep_response(state, body, response, answer.key)  # noqa: E731
    if body.stream:
        return event_stream_response(answer.events(keep), state.engine, [run.request_id])

    async def whole():
        async for _ in answer.decoded():  # as a stream is fed: the same pieces, the same items
            pass
        response = answer.finish()[0]
        await keep(response)
        return response

    result = await until_disconnect(request, whole())
    return result if result is not None else Response(status_code=499)


def _named_as_sent(exc: APIError) -> APIError:
    """The error with the Responses API's field names where the chat request's were."""
    for chat_name, name in _PARAMS:
        if exc.param:
            exc.param = re.sub(chat_name, name, exc.param)
        exc.message = re.sub(chat_name, name, exc.message)
    return exc


def output_usage(prompt_tokens: int, output_tokens: int, cached_tokens: int = 0) -> dict:
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


class Answer:
    """One response's output as it is decoded: its items in the order written (runs of text
    as messages, function calls), the stream's events of each piece, and the `response`
    object that describes it at each moment. A stream and a whole answer feed it the same
    pieces, so both have the same items."""

    def __init__(self, run: ChatRun, body: ResponsesRequest, created: int, stored: bool = False):
        """`stored`: the finished response will be stored (the object says so)."""
        self.run, self.body, self.created, self.stored = run, body, created, stored
        self.parser: ToolCallParser | None = run.parsers[0] if run.parsers else None
        self.parser_ended = False
        self.splitter: ReasoningSplitter | None = run.splitters[0] if run.splitters else None
        # {"type": "message", "id", "text"} or {"type": "function_call", "index" (among the parser's calls),
        # "call_id", "name", "arguments"}, in the order written; the last one is open while `is_open`
        self.items: list[dict] = []
        self.is_open = False
        self.sequence = 0
        self.key = re.split("[-_]", run.request_id)[-1]  # what the ids of its items end with
        self.reason: str | None = None  # why decoding ended
        self.output_tokens = 0
        self.cached_tokens = 0  # prompt tokens read from the prefix cache

    async def decoded(self):
        """Feeds the engine's outputs as they come; yields the stream's events of each."""
        async for output in self.run.outputs:
            self.cached_tokens = output.metrics.num_cached_tokens
            for choice in output.outputs:
                self.output_tokens += len(choice.token_ids)
                self.reason = choice.finish_reason or self.reason
                yield self.feed(choice.text, final=choice.finish_reason is not None)

    def feed(self, text: str, final: bool = False) -> list[bytes]:
        """Decoded text in (`final`: the last); the stream's events of what it adds."""
        events = []
        if self.splitter is not None:  # the reasoning apart (server/reasoning.py)
            reasoning, text = self.splitter.split(text, final)
            if reasoning:
                events += self._reasoned(reasoning)
        content, deltas = self.parser.feed(text) if self.parser is not None else (text, [])
        if final and self.parser is not None and not self.parser_ended:
            self.parser_ended = True  # (the parser counts its calls when it finishes: once)
            rest, more = self.parser.finish()
            content, deltas = content + rest, deltas + more
        if content:
            if not (self.is_open and self.items[-1]["type"] == "message"):
                messages = sum(item["type"] == "message" for item in self.items)
                events += self._open({"type": "message", "text": "",
                                      "id": f"msg_{self.key}" + (f"_{messages}" if messages else "")})
            self.items[-1]["text"] += content
            events.append(self.event("response.output_text.delta", item_id=self.items[-1]["id"],
                                     output_index=len(self.items) - 1, content_index=0, delta=content, logprobs=[]))
        for delta in deltas:
            if delta.id is not None:  # a call begins
                events += self._open({"type": "function_call", "index": delta.index, "call_id": delta.id,
                                      "name": delta.name, "arguments": ""})
            position = next((i for i, item in enumerate(self.items) if item.get("index") == delta.index), None)
            if delta.arguments and position is not None:
                self.items[position]["arguments"] += delta.arguments
                events.append(self.event("response.function_call_arguments.delta", output_index=position,
                                         item_id=f"fc_{self.items[position]['call_id']}", delta=delta.arguments))
        return events

    def _reasoned(self, text: str) -> list[bytes]:
        """The events of reasoning `text`: a reasoning item's, opened if the last is not one."""
        events = [] if self.is_open and self.items[-1]["type"] == "reasoning" else \
            self._open({"type": "reasoning", "id": f"rs_{self.key}", "text": ""})
        self.items[-1]["text"] += text
        return events + [self.event("response.reasoning_text.delta", item_id=self.items[-1]["id"],
                                    output_index=len(self.items) - 1, content_index=0, delta=text)]

    def _open(self, item: dict) -> list[bytes]:
        """Closes the item before (the API ends one before the next begins), opens `item`."""
        events = self._close(self.rendered(self.items[-1], "completed")) if self.is_open else []
        self.items.append(item)
        self.is_open = True
        index = len(self.items) - 1
        events.append(self.event("response.output_item.added", output_index=index,
                                 item=self.rendered(item, "in_progress")))
        if item["type"] in ("message", "reasoning"):
            part = self.text_part("") if item["type"] == "message" else {"type": "reasoning_text", "text": ""}
            events.append(self.event("response.content_part.added", item_id=item["id"], output_index=index,
                                     content_index=0, part=part))
        return events

    def _close(self, rendered: dict) -> list[bytes]:
        """The end events of the open item, whole as `rendered`."""
        self.is_open = False
        index = len(self.items) - 1
        if rendered["type"] == "message":
            text = rendered["content"][0]["text"]
            events = [self.event("response.output_text.done", item_id=rendered["id"], output_index=index,
                                 content_index=0, text=text, logprobs=[]),
                      self.event("response.content_part.done", item_id=rendered["id"], output_index=index,
                                 content_index=0, part=self.text_part(text))]
        elif rendered["type"] == "reasoning":
            part = rendered["content"][0]
            events = [self.event("response.reasoning_text.done", item_id=rendered["id"], output_index=index,
                                 content_index=0, text=part["text"]),
                      self.event("response.content_part.done", item_id=rendered["id"], output_index=index,
                                 content_index=0, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=rendered["id"],
                                 output_index=index, name=rendered["name"], arguments=rendered["arguments"])]
        return events + [self.event("response.output_item.done", output_index=index, item=rendered)]

    def rendered(self, item: dict, status: str) -> dict:
        """An item as the API shows it."""
        if item["type"] == "message":
            return {"type": "message", "id": item["id"], "status": status, "role": "assistant",
                    "content": [self.text_part(item["text"])] if status != "in_progress" else []}
        if item["type"] == "reasoning":
            return {"type": "reasoning", "id": item["id"], "status": status, "summary": [],
                    "content": [{"type": "reasoning_text", "text": item["text"]}] if status != "in_progress" else []}
        return {"type": "function_call", "id": f"fc_{item['call_id']}", "call_id": item["call_id"],
                "name": item["name"], "arguments": item["arguments"] if status != "in_progress" else "",
                "status": status}

    @staticmethod
    def text_part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def response(self, status: str, output: list[dict], output_tokens: int | None = None,
                 incomplete: str | None = None, error: dict | None = None) -> dict:
        body, chat_params = self.body, self.run.params
        return {
            "id": self.run.request_id, "object": "response", "created_at": self.created, "status": status,
            "error": error, "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "model": body.model, "output": output,
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": self.stored, "temperature": chat_params.temperature, "top_p": chat_params.top_p,
            "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                                if body.text is not None and body.text.format is not None else {"type": "text"})},
            "tool_choice": _dumped(body.tool_choice) if body.tool_choice is not None else "auto",
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": body.truncation or "disabled", "metadata": body.metadata or {},
            "user": body.user,
            "usage": (output_usage(self.run.num_prompt_tokens, output_tokens, self.cached_tokens)
                      if output_tokens is not None else None),
        }

    def finish(self) -> tuple[dict, list[bytes]]:
        """The whole `response` object once decoding ended, and the events that end its
        output (the last item's, or an empty message's where nothing was written)."""
        events = self.feed("", final=True)
        if not self.items:  # an answer of nothing is an empty message
            events += self._open({"type": "message", "id": f"msg_{self.key}", "text": ""})
        cut = self.reason == "length"
        output = [self.rendered(item, "completed") for item in self.items]
        if cut and not _whole_call(output[-1]):  # the limit cut the last item
            output[-1]["status"] = "incomplete"
        if self.is_open:
            events += self._close(output[-1])
        return self.response("incomplete" if cut else "completed", output, self.output_tokens,
                             "max_output_tokens" if cut else None), events

    def event(self, kind: str, **fields) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + sse_json(data) + b"\n\n"

    async def events(self, keep=None):
        """The API's stream: created, in progress, then each output item as it is written —
        opened, its text or arguments as decoded, done before the next opens — then
        completed (or incomplete); an error is an `error` event, then `response.failed`.
        `keep(response)` is awaited with the finished response before its last event (a
        client that continues it on that event finds it stored)."""
        yield self.event("response.created", response=self.response("in_progress", []))
        yield self.event("response.in_progress", response=self.response("in_progress", []))
        try:
            async for events in self.decoded():
                for event in events:
                    yield event
        except APIError as exc:
            error = {"code": exc.code or exc.type, "message": exc.message}
            yield self.event("error", code=error["code"], message=exc.message, param=exc.param)
            yield self.event("response.failed", response=self.response("failed", [], self.output_tokens, error=error))
            return
        if self.reason == "abort":  # a shutdown cut the answer short (a disconnected client reads nothing)
            error = {"code": "server_shutting_down",
                     "message": "the server is shutting down: this answer was cut short; send the request again"}
            yield self.event("error", param=None, **error)
            yield self.event("response.failed", response=self.response("failed", [], self.output_tokens, error=error))
            return
        whole, ending = self.finish()
        for event in ending:
            yield event
        if keep is not None:
            await keep(whole)
        yield self.event("response.incomplete" if whole["status"] == "incomplete" else "response.completed",
                         response=whole)


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
