"""Running requests over HTTP: engine streams with typed errors mapped to HTTP, client
disconnects (which abort the request within one engine step), several streams merged
into one, and the SSE event streams of chat and text completions."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import AsyncIterator

import anyio
import orjson
from fastapi import Request
from sse_starlette import EventSourceResponse
from sse_starlette.sse import AppStatus, SendTimeoutError

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.outputs import ErrorKind
from engine.request import EngineRequest
from server.errors import APIError, error_body
from server.read_deadline import ABORT_CONNECTION
from server.reasoning import ReasoningSplitter
from server.responses import TextOffsets, chat_logprobs, chunk, completion_logprobs, finish_reason, usage
from server.token_shown import TokenShown
from server.tool_calls import ToolCallParser

# on SIGTERM, streams in flight get this long to finish before they are cut (uvicorn's
# graceful-shutdown timeout in serve.py is longer); this long before the cut, their
# requests are aborted, so that each ends with an error event saying so, then [DONE]
# (a request answered whole gets a 503 then)
STREAM_DRAIN_S = 8.0
ABORT_BEFORE_CUT_S = 1.5
# a client that takes nothing of its stream for this long (the sockets' buffers full) has left
# as far as the server can tell: its stream ends, its request is aborted and its place freed
STREAM_SEND_TIMEOUT_S = 60.0
logger = logging.getLogger(__name__)


class _EventStream(EventSourceResponse):
    """An SSE response whose client stopped reading ends, its connection aborted: its events
    and pings are bounded by sse-starlette's `send_timeout`, its closing send here (which
    sse-starlette leaves unbounded), and the socket is dropped rather than closed (a close
    waits to flush what the client never reads)."""

    async def __call__(self, scope, receive, send) -> None:
        async def closing_bounded(message) -> None:
            if message["type"] != "http.response.body" or message.get("more_body", False):
                return await send(message)
            with anyio.move_on_after(self.send_timeout) as waited:
                await send(message)
            if waited.cancel_called:
                raise SendTimeoutError()

        try:
            await super().__call__(scope, receive, closing_bounded)
        except* SendTimeoutError:
            logger.info("a client took nothing of its stream for %.0f s: the stream ended", self.send_timeout)
            abort = scope.get("extensions", {}).get(ABORT_CONNECTION)
            if abort is not None:
                abort()
                await asyncio.sleep(0)  # the connection's loss marks the answer's cycle disconnected first


def event_stream_response(events, async_engine: AsyncEngine, request_ids: list[str]) -> EventSourceResponse:
    """The SSE response of `events`, whose engine requests `request_ids` are aborted
    `ABORT_BEFORE_CUT_S` before a shutdown's grace would cut the stream mid-answer."""
    async def abort_before_cut() -> None:
        await _shutdown_cut()
        for request_id in request_ids:
            async_engine.abort(request_id)

    async def drained():
        aborting = asyncio.ensure_future(abort_before_cut())
        try:
            async for event in events:
                yield event
        finally:
            aborting.cancel()

    # events end in "\n\n", as OpenAI's do (a client that splits on it finds them), pings too
    return _EventStream(drained(), ping=15, sep="\n", shutdown_grace_period=STREAM_DRAIN_S,
                        send_timeout=STREAM_SEND_TIMEOUT_S)


def engine_stream(async_engine: AsyncEngine, request: EngineRequest):
    """The request's outputs; an engine error becomes an APIError (503: the engine
    stopped, retry elsewhere; 500: a step failed)."""
    async def stream():
        try:
            async for output in async_engine.generate(request):
                if output.error is not None:
                    if output.error.kind is ErrorKind.ENGINE_STOPPED:
                        raise APIError(503, "the server is shutting down or restarting; retry the request")
                    raise APIError(500, f"generation failed: {output.error.message}", type="server_error")
                yield output
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
    return stream()


async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _shutdown_cut() -> None:
    """Returns when a shutdown would soon cut a request in flight: `ABORT_BEFORE_CUT_S`
    before the end of the `STREAM_DRAIN_S` uvicorn's SIGTERM (or SIGINT) began — the moment
    a stream is stopped too (`event_stream_response`); sse-starlette's `AppStatus` says
    when a shutdown began, polled as sse-starlette polls it."""
    while not AppStatus.should_exit:
        await asyncio.sleep(0.5)
    await asyncio.sleep(STREAM_DRAIN_S - ABORT_BEFORE_CUT_S)


async def until_disconnect(request: Request, work) -> object:
    """Runs `work` (a coroutine); if the client disconnects first, cancels it (which
    aborts its engine requests) and returns None. A shutdown that would cut it first
    cancels it too, and answers 503 (`server_shutting_down`), as a stream ends: uvicorn
    would else cancel it when its graceful shutdown ran out, and send a plain-text 500."""
    arrived_in_shutdown = AppStatus.should_exit
    task = asyncio.ensure_future(work)
    disconnect = asyncio.ensure_future(_listen_for_disconnect(request))
    shutdown = asyncio.ensure_future(_shutdown_cut())
    try:
        done, _ = await asyncio.wait({task, disconnect, shutdown}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # the handler itself cancelled (uvicorn's graceful shutdown ran out)
        task.cancel()
        raise
    finally:
        disconnect.cancel()
        shutdown.cancel()
    if task in done:
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    if shutdown in done:
        why = "the request came after the shutdown began" if arrived_in_shutdown else "this answer was cut short"
        raise APIError(503, f"the server is shutting down: {why}; send the request again", code="server_shutting_down")
    return None


async def merge(streams: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Interleaves several async iterators, yielding (iterator index, item)."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(index, stream):
        try:
            async for item in stream:
                await queue.put((index, item))
        except BaseException as exc:  # noqa: BLE001 - re-raised in the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, done))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            index, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class _Usage:
    """`stream_options`: a final usage chunk, and optionally usage on every chunk."""

    def __init__(self, stream_options, prompt_tokens: int):
        self.include = bool(stream_options and stream_options.include_usage)
        self.continuous = self.include and stream_options.continuous_usage_stats
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0
        # prompt index -> its prompt tokens read from the prefix cache
        self.cached_tokens: dict[int, int] = {}

    def now(self) -> dict:
        return usage(self.prompt_tokens, self.completion_tokens, sum(self.cached_tokens.values()))


# characters orjson writes as they are, which line readers (httpx's, Python's
# str.splitlines) take for line breaks; escaped, as json.dumps writes them
_LINE_BREAKS = ((b"\xe2\x80\xa8", b"\\u2028"), (b"\xe2\x80\xa9", b"\\u2029"), (b"\xc2\x85", b"\\u0085"))


def sse_json(data: dict) -> bytes:
    """`data` as JSON with no line break left in it (orjson's, and those line readers take
    for one escaped), so that it fits one `data:` line of an event."""
    text = orjson.dumps(data)
    for raw, escaped in _LINE_BREAKS:
        text = text.replace(raw, escaped)
    return text


def _event(data: dict) -> bytes:
    """One SSE event, encoded: sse-starlette sends bytes as they are."""
    return b"data: " + sse_json(data) + b"\n\n"


DONE = b"data: [DONE]\n\n"


def _cut_short_event() -> bytes:
    """The error event of a stream whose answer a shutdown cut short (an aborted choice:
    only a shutdown's abort leaves a reader), sent before [DONE]; the SDK raises it."""
    return _event(error_body(503, "the server is shutting down: this answer was cut short; send the request again",
                             None, "server_shutting_down"))


def _streamed_finish_reason(reason: str | None, called_tools: bool = False) -> str | None:
    """A streamed choice's finish reason; none for one the server aborted (a shutdown: the
    stream then ends with an error event), where "stop" would pass the cut answer off as
    complete to a client reading finish reasons. A client that disconnected reads nothing."""
    return None if reason == "abort" else finish_reason(reason, called_tools)


def _chat_delta(parser: ToolCallParser | None, splitter: ReasoningSplitter | None, text: str,
                finished: bool) -> tuple[dict, bool]:
    """A choice's delta for its new text — its reasoning apart with a splitter
    (server/reasoning.py), content, and, when tools were offered, tool-call deltas
    (server/tool_calls.py) — and whether the choice ends as "tool_calls"."""
    delta: dict = {}
    if splitter is not None:
        reasoning, text = splitter.split(text, finished)
        if reasoning:  # under vLLM's name, and its earlier one (DeepSeek's)
            delta["reasoning"] = delta["reasoning_content"] = reasoning
    if parser is None:
        if text:
            delta["content"] = text
        return delta, False
    content, calls = parser.feed(text)
    if finished:
        rest, more = parser.finish()
        content, calls = content + rest, calls + more
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = [call.as_openai() for call in calls]
    return delta, parser.ends_as_tool_calls


async def chat_events(request_id: str, model: str, stream, n: int, num_prompt_tokens: int, stream_options,
                      tokens: TokenShown, parsers: list[ToolCallParser] | None = None,
                      splitters: list[ReasoningSplitter] | None = None):
    """SSE events of a streamed chat completion: a role chunk per choice, content (and,
    with `parsers`, one per choice, tool-call; with `splitters`, reasoning) deltas, finish
    reasons, the usage chunk, then [DONE] (an error becomes an error event)."""
    created = int(time.time())
    counts = _Usage(stream_options, num_prompt_tokens)
    parsers = parsers or [None] * n
    splitters = splitters or [None] * n
    cut = False

    def event(choices, usage_value=None):
        value = usage_value or (counts.now() if counts.continuous else None)
        return _event(chunk(request_id, "chat.completion.chunk", model, created, choices, value, counts.include))

    try:
        for i in range(n):  # a forced tool call's content is null, as OpenAI's
            content = None if parsers[i] is not None and parsers[i].forced else ""
            yield event([{"index": i, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                          "finish_reason": None}])
        closed = [False] * n  # a finished choice rides along in its request's later outputs: closed once
        async for output in stream:
            counts.cached_tokens[0] = output.metrics.num_cached_tokens
            for c in output.outputs:
                if closed[c.index]:
                    continue
                closed[c.index] = c.finish_reason is not None
                counts.completion_tokens += len(c.token_ids)
                delta, called_tools = _chat_delta(parsers[c.index], splitters[c.index], c.text,
                                                  c.finish_reason is not None)
                reason = _streamed_finish_reason(c.finish_reason, called_tools)
                cut = cut or c.finish_reason == "abort"
                if not delta and not reason and not c.logprobs:
                    continue
                choice = {"index": c.index, "delta": delta,
                          "logprobs": {"content": chat_logprobs(tokens, c.logprobs)} if c.logprobs else None,
                          "finish_reason": reason}
                if reason:
                    choice["stop_reason"] = c.stop_reason
                yield event([choice])
        if counts.include:
            yield event([], counts.now())
        if cut:
            yield _cut_short_event()
    except APIError as exc:
        yield _event(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))
    yield DONE


async def completion_events(request_id: str, model: str, streams, prompts: list[tuple[list[int], str]], n: int,
                            echo: bool, logprobs: int | None, stream_options, tokens: TokenShown):
    """SSE events of a streamed text completion (several prompts merged; choice k of
    prompt p is p * n + index)."""
    created = int(time.time())
    counts = _Usage(stream_options, sum(len(ids) for ids, _ in prompts))

    def event(choices, usage_value=None):
        value = usage_value or (counts.now() if counts.continuous else None)
        return _event(chunk(request_id, "text_completion", model, created, choices, value, counts.include))

    offsets = [TextOffsets() for _ in range(len(prompts) * n)]
    echoed = [False] * (len(prompts) * n)
    closed = [False] * (len(prompts) * n)  # (as in `chat_events`)
    cut = False
    try:
        async for prompt_index, output in merge(streams):
            prompt_ids, prompt_text = prompts[prompt_index]
            counts.cached_tokens[prompt_index] = output.metrics.num_cached_tokens
            for c in output.outputs:
                k = prompt_index * n + c.index
                if closed[k]:
                    continue
                closed[k] = c.finish_reason is not None
                counts.completion_tokens += len(c.token_ids)
                text, ids, values = c.text, list(c.token_ids), list(c.logprobs or [])
                if echo and not echoed[k] and (output.prompt_logprobs is not None or logprobs is None):
                    echoed[k] = True
                    text = prompt_text + text
                    ids = prompt_ids + ids
                    values = list(output.prompt_logprobs or [None] * len(prompt_ids)) + values
                reason = _streamed_finish_reason(c.finish_reason)
                cut = cut or c.finish_reason == "abort"
                if not text and not reason and (logprobs is None or not ids):
                    continue  # text held back (a stop string may begin): a chunk once there is some
                lp = completion_logprobs(tokens, values, ids, offsets[k]) if logprobs is not None else None
                yield event([{"index": k, "text": text, "logprobs": lp,
                              "finish_reason": reason, "stop_reason": c.stop_reason if reason else None}])
        if counts.include:
            yield event([], counts.now())
        if cut:
            yield _cut_short_event()
    except APIError as exc:
        yield _event(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))
    yield DONE
