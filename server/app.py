"""The OpenAI-compatible HTTP front: routes, request parsing, response shaping.

Bodies are parsed here (strict pydantic models in `protocol.py`), turned into token ids
and `SamplingParams`, and handed to the `AsyncEngine`. Streaming responses are SSE; a
client that disconnects — streaming or not — aborts its request within one engine step.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from sse_starlette.sse import EventSourceResponse

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.outputs import TokenLogprob
from engine.sampling_params import InvalidParameter, SamplingParams
from server.errors import APIError, error_body, install_error_handlers, validation_error
from server.guards import GuardConfig, RequestGuard
from server.metrics import ServingMetrics
from server.protocol import ChatCompletionRequest, CompletionRequest, FeedbackRequest, RollbackRequest
from trainer.adapter_store import AdapterLoadError
from trainer.trainer import AdapterMismatchError, FeedbackError

# JSON cannot carry -inf; vLLM reports this floor instead
_MIN_LOGPROB = -9999.0
# on SIGTERM, streams in flight get this long to finish before they are cut (uvicorn's
# graceful-shutdown timeout in serve.py is longer)
STREAM_DRAIN_S = 8.0


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: ServingMetrics
    # the online trainer, when training is on
    trainer: object | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# -- request parsing -------------------------------------------------------------------

async def parse_body(request: Request, model: type[BaseModel]):
    raw = await request.body()
    if not raw.strip():
        raise APIError(400, "The request body is empty; send a JSON object.", code="invalid_json")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            raise APIError(400, f"We could not parse the JSON body of your request: {first.get('msg')}.",
                           code="invalid_json") from None
        if first.get("type") == "model_type":
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json") from None
        raise validation_error(exc) from None


def check_model(state: ServerState, name: str) -> None:
    if name != state.model_name:
        raise APIError(404, f"The model `{name}` does not exist. Available: `{state.model_name}`.", "model",
                       "model_not_found")


def build_params(body) -> SamplingParams:
    try:
        return body.sampling_params()
    except InvalidParameter as exc:
        raise APIError(400, str(exc), exc.param, "invalid_value") from None


def validate_for_engine(state: ServerState, prompt_ids: list[int], params: SamplingParams, param: str) -> None:
    try:
        state.engine.engine.validate(prompt_ids, params)
    except InvalidParameter as exc:
        raise APIError(400, str(exc), param if exc.param in ("prompt", "messages") else exc.param,
                       "context_length_exceeded" if "context length" in str(exc) else "invalid_value") from None


def render_chat(state: ServerState, body: ChatCompletionRequest) -> list[int]:
    if getattr(state.tokenizer, "chat_template", None) is None:
        raise APIError(400, "This model has no chat template; use /v1/completions.", "messages")
    messages = []
    for message in body.messages:
        entry = {"role": "system" if message.role == "developer" else message.role, "content": message.text()}
        if message.name is not None:
            entry["name"] = message.name
        messages.append(entry)
    try:
        text = state.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - template errors (e.g. role order) are the user's to fix
        raise APIError(400, f"The chat template rejected the messages: {exc}", "messages") from None
    return state.tokenizer(text, add_special_tokens=False)["input_ids"]


def check_unsupported(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true.", "stream_options")


# -- running requests ------------------------------------------------------------------

async def _listen_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(request: Request, work) -> object:
    """Runs `work` (a coroutine); if the client disconnects first, cancels it (which
    aborts its engine requests) and returns None."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_listen_for_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
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


def record_spec(state: ServerState, prompt_ids: list[int], params: SamplingParams, train: bool):
    """Whether this request's prefill is recorded for training. Scoring requests
    (prompt logprobs, max_tokens 0) are not."""
    if state.trainer is None or params.prompt_logprobs is not None or params.max_tokens == 0:
        return None
    return state.trainer.record_spec(len(prompt_ids), train)


def engine_stream(state: ServerState, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  record=None):
    async def stream():
        try:
            async for output in state.engine.generate(request_id, prompt_ids, params, record):
                if output.error:
                    if output.error.startswith(EngineDeadError.__name__):
                        raise APIError(503, "the server is shutting down; retry on another replica")
                    raise APIError(500, f"generation failed: {output.error}", type="server_error")
                yield output
        except EngineDeadError as exc:
            raise APIError(503, str(exc)) from None
    return stream()


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _finish_reason(reason: str | None) -> str | None:
    return "stop" if reason == "abort" else reason


def _lp(value: float) -> float:
    return max(value, _MIN_LOGPROB)


# -- logprob formats --------------------------------------------------------------------

def chat_logprobs(state: ServerState, logprobs: list[TokenLogprob]) -> list[dict]:
    def entry(token_id, value):
        text = state.token_text(token_id)
        return {"token": text, "logprob": _lp(value), "bytes": list(text.encode("utf-8"))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs]


def completion_logprobs(state: ServerState, logprobs: list[TokenLogprob | None], token_ids: list[int],
                        offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = state.token_text(token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
        if lp is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(_lp(lp.logprob))
            top = {state.token_text(t): _lp(v) for t, v in lp.top}
            top.setdefault(text, _lp(lp.logprob))
            tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": offsets}


# -- the app -----------------------------------------------------------------------------

def build_app(state: ServerState, guard: GuardConfig | None = None) -> FastAPI:
    app = FastAPI(title="alchemist", docs_url=None, redoc_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, config=guard or GuardConfig(), count_response=state.metrics.count_response)
    app.state.alchemist = state

    @app.get("/health")
    async def health():
        if not state.engine.is_alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card():
        return {"id": state.model_name, "object": "model", "created": state.created, "owned_by": "alchemist",
                "root": state.model_name, "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(state, model_id)
        return model_card()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        check_model(state, body.model)
        check_unsupported(body)
        params = build_params(body)
        prompt_ids = render_chat(state, body)
        validate_for_engine(state, prompt_ids, params, "messages")
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        stream = engine_stream(state, request_id, prompt_ids, params, record_spec(state, prompt_ids, params,
                                                                                   body.train))
        if body.stream:
            return EventSourceResponse(_chat_events(state, request_id, stream, params, len(prompt_ids),
                                                    body.stream_options), ping=15,
                                       shutdown_grace_period=STREAM_DRAIN_S)
        result = await until_disconnect(request, _chat_response(state, request_id, stream, params,
                                                                 len(prompt_ids)))
        return result if result is not None else Response(status_code=499)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        check_model(state, body.model)
        check_unsupported(body)
        if body.suffix is not None:
            raise APIError(400, "suffix is not supported.", "suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of must equal n (returning the best of several samples is not supported).",
                           "best_of")
        params = build_params(body)
        prompts = _completion_prompts(state, body.prompt)
        for prompt_ids, _ in prompts:
            validate_for_engine(state, prompt_ids, params, "prompt")
        request_id = f"cmpl-{uuid.uuid4().hex}"
        if len(prompts) == 1:  # the completion id is the training entry's id (for feedback)
            ids = prompts[0][0]
            streams = [engine_stream(state, request_id, ids, params, record_spec(state, ids, params, body.train))]
        else:
            streams = [engine_stream(state, f"{request_id}-{i}", ids, params, record_spec(state, ids, params,
                                                                                         body.train))
                       for i, (ids, _) in enumerate(prompts)]
        if body.stream:
            return EventSourceResponse(_completion_events(state, request_id, streams, prompts, body, params,
                                                          body.stream_options), ping=15,
                                       shutdown_grace_period=STREAM_DRAIN_S)
        result = await until_disconnect(request, _completion_response(state, request_id, streams, prompts,
                                                                       body, params))
        return result if result is not None else Response(status_code=499)

    @app.post("/v1/feedback")
    async def feedback(request: Request):
        body: FeedbackRequest = await parse_body(request, FeedbackRequest)
        if state.trainer is None:
            raise APIError(400, "training is off on this server (start it with --train-mode dpo); feedback is "
                                "not used", code="feedback_not_used")
        try:
            state.trainer.submit_feedback(body.id, body.chosen, body.rejected, body.choice_index)
        except FeedbackError as err:
            raise APIError(err.status, err.message, err.param, err.code) from None
        state.engine.notify()
        return {"id": body.id, "object": "feedback", "status": "accepted"}

    @app.get("/v1/adapters")
    async def adapters():
        return adapter_status(state)

    @app.post("/v1/adapters/rollback")
    async def rollback(request: Request):
        body: RollbackRequest = await parse_body(request, RollbackRequest)
        checkpointer = adapter_checkpointer(state)
        try:
            snapshot = await asyncio.to_thread(checkpointer.store.load, body.version)
        except AdapterLoadError as exc:
            saved = [v.version for v in checkpointer.store.versions()]
            if body.version not in saved:
                raise APIError(404, f"adapter version {body.version} is not saved; saved versions: {saved}",
                               "version", "version_not_found") from None
            raise APIError(409, f"saved adapter version {body.version} cannot be loaded: {exc}", "version",
                           "version_unreadable") from None
        try:
            await state.engine.run_on_device(state.trainer.rollback, snapshot)
        except AdapterMismatchError as exc:
            raise APIError(409, str(exc), "version", "version_incompatible") from None
        except EngineDeadError:
            raise APIError(503, "the server is shutting down") from None
        return adapter_status(state)

    return app


def adapter_trainer(state: ServerState):
    if state.trainer is None:
        raise APIError(400, "training is off on this server, so there is no adapter (start it with "
                            "--train-mode cpt|dpo)", code="adapters_not_used")
    return state.trainer


def adapter_checkpointer(state: ServerState):
    if adapter_trainer(state).checkpointer is None:
        raise APIError(400, "adapters are not saved on this server (start it with --adapter-dir DIR)",
                       code="adapter_dir_not_set")
    return state.trainer.checkpointer


def adapter_status(state: ServerState) -> dict:
    """GET /v1/adapters: the live version, the saved ones, and the training counters."""
    trainer = adapter_trainer(state)
    stats, checkpointer = trainer.stats, trainer.checkpointer
    saved = checkpointer.store.versions() if checkpointer else []
    loss = stats.last_loss
    return {
        "object": "adapter",
        "version": trainer.optimizer.version,
        "restored_from": trainer.restored_from,
        "mode": trainer.mode,
        "adapter_dir": str(checkpointer.store.root) if checkpointer else None,
        "save_every": checkpointer.save_every if checkpointer else None,
        "saved": [{"version": v.version, "path": str(v.path), "created": int(v.created)} for v in saved],
        "training": {
            "trained_entries": sum(stats.trained_entries.values()),
            "train_tokens": stats.train_tokens,
            "last_loss": loss if loss == loss else None,
            "skipped_steps": trainer.optimizer.skipped_steps,
            "failed_jobs": stats.failed_jobs,
            "stale_entries": stats.stale_entries,
            "activation_cache_bytes": trainer.cache.bytes,
        },
    }


def _completion_prompts(state: ServerState, prompt) -> list[tuple[list[int], str]]:
    """(token ids, text) per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty.", "prompt")
    if all(isinstance(p, int) for p in prompt):
        prompt = [prompt]
    result = []
    for p in prompt:
        if isinstance(p, str):
            result.append((state.tokenizer(p)["input_ids"], p))
        else:
            if not p:
                raise APIError(400, "prompt must not be empty.", "prompt")
            if any(t < 0 for t in p):
                raise APIError(400, "prompt token ids must be non-negative.", "prompt")
            result.append((list(p), state.tokenizer.decode(p)))
    return result


# -- chat responses ------------------------------------------------------------------------

async def _chat_response(state, request_id, stream, params: SamplingParams, num_prompt_tokens: int):
    texts = [""] * params.n
    token_counts = [0] * params.n
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(params.n)]
    reasons: list[str | None] = [None] * params.n
    stop_reasons: list = [None] * params.n
    async for output in stream:
        for c in output.outputs:
            texts[c.index] += c.text
            token_counts[c.index] += len(c.token_ids)
            if c.logprobs:
                logprobs[c.index].extend(c.logprobs)
            if c.finish_reason:
                reasons[c.index], stop_reasons[c.index] = c.finish_reason, c.stop_reason
    choices = [{
        "index": i,
        "message": {"role": "assistant", "content": texts[i]},
        "logprobs": {"content": chat_logprobs(state, logprobs[i])} if params.logprobs is not None else None,
        "finish_reason": _finish_reason(reasons[i]),
        "stop_reason": stop_reasons[i],
    } for i in range(params.n)]
    return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(num_prompt_tokens, sum(token_counts))}


async def _chat_events(state, request_id, stream, params: SamplingParams, num_prompt_tokens: int,
                       stream_options):
    created = int(time.time())
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and stream_options.continuous_usage_stats
    completion_tokens = 0

    def chunk(choices, usage_value=None):
        data = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": state.model_name, "choices": choices}
        if include_usage:
            data["usage"] = usage_value or (usage(num_prompt_tokens, completion_tokens) if continuous else None)
        return {"data": json.dumps(data)}

    try:
        for i in range(params.n):
            yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                          "finish_reason": None}])
        async for output in stream:
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                if not c.text and not c.finish_reason and not c.logprobs:
                    continue
                choice = {"index": c.index, "delta": {"content": c.text} if c.text else {},
                          "logprobs": {"content": chat_logprobs(state, c.logprobs)} if c.logprobs else None,
                          "finish_reason": _finish_reason(c.finish_reason)}
                if c.finish_reason:
                    choice["stop_reason"] = c.stop_reason
                yield chunk([choice])
        if include_usage:
            yield chunk([], usage(num_prompt_tokens, completion_tokens))
    except APIError as exc:
        yield {"data": json.dumps(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))}
    yield {"data": "[DONE]"}


# -- text completion responses --------------------------------------------------------------

async def _completion_response(state, request_id, streams, prompts, body: CompletionRequest,
                               params: SamplingParams):
    n = params.n
    total = len(prompts) * n
    texts = [""] * total
    token_ids: list[list[int]] = [[] for _ in range(total)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(total)]
    reasons: list = [None] * total
    stop_reasons: list = [None] * total
    prompt_logprobs: dict[int, list] = {}
    async for prompt_index, output in merge(streams):
        if output.prompt_logprobs is not None:
            prompt_logprobs[prompt_index] = output.prompt_logprobs
        for c in output.outputs:
            k = prompt_index * n + c.index
            texts[k] += c.text
            token_ids[k].extend(c.token_ids)
            if c.logprobs:
                logprobs[k].extend(c.logprobs)
            if c.finish_reason:
                reasons[k], stop_reasons[k] = c.finish_reason, c.stop_reason
    choices = []
    for k in range(total):
        prompt_ids, prompt_text = prompts[k // n]
        text, lp = texts[k], None
        if body.echo:
            text = prompt_text + text
        if body.logprobs is not None:
            ids, values = token_ids[k], logprobs[k]
            if body.echo:
                ids = prompt_ids + ids
                values = list(prompt_logprobs.get(k // n) or [None] * len(prompt_ids)) + values
            lp = completion_logprobs(state, values, ids, 0)
        choices.append({"index": k, "text": text, "logprobs": lp, "finish_reason": _finish_reason(reasons[k]),
                        "stop_reason": stop_reasons[k]})
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": state.model_name,
            "choices": choices, "usage": usage(prompt_tokens, sum(len(t) for t in token_ids))}


async def _completion_events(state, request_id, streams, prompts, body: CompletionRequest,
                             params: SamplingParams, stream_options):
    created = int(time.time())
    n = params.n
    include_usage = bool(stream_options and stream_options.include_usage)
    continuous = include_usage and stream_options.continuous_usage_stats
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    completion_tokens = 0

    def chunk(choices, usage_value=None):
        data = {"id": request_id, "object": "text_completion", "created": created, "model": state.model_name,
                "choices": choices}
        if include_usage:
            data["usage"] = usage_value or (usage(prompt_tokens, completion_tokens) if continuous else None)
        return {"data": json.dumps(data)}

    offsets = [0] * (len(prompts) * n)
    echoed = [False] * (len(prompts) * n)
    try:
        async for prompt_index, output in merge(streams):
            prompt_ids, prompt_text = prompts[prompt_index]
            for c in output.outputs:
                k = prompt_index * n + c.index
                completion_tokens += len(c.token_ids)
                text, ids, values = c.text, list(c.token_ids), list(c.logprobs or [])
                if body.echo and not echoed[k] and (output.prompt_logprobs is not None or body.logprobs is None):
                    echoed[k] = True
                    text = prompt_text + text
                    ids = prompt_ids + ids
                    values = list(output.prompt_logprobs or [None] * len(prompt_ids)) + values
                if not text and not c.finish_reason and not ids:
                    continue
                lp = None
                if body.logprobs is not None:
                    lp = completion_logprobs(state, values, ids, offsets[k])
                offsets[k] += len(text)
                yield chunk([{"index": k, "text": text, "logprobs": lp,
                              "finish_reason": _finish_reason(c.finish_reason), "stop_reason": c.stop_reason}])
        if include_usage:
            yield chunk([], usage(prompt_tokens, completion_tokens))
    except APIError as exc:
        yield {"data": json.dumps(error_body(exc.status, exc.message, exc.param, exc.code, exc.type))}
    yield {"data": "[DONE]"}
