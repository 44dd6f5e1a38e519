"""The OpenAI-compatible routes: `/v1/models`, `/v1/chat/completions`, `/v1/completions`.

A body is parsed and validated (server/parsing.py), turned into engine requests and
streamed back (server/streams.py) or rendered whole (server/responses.py). A client that
disconnects — streaming or not — aborts its request within one engine step.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import APIRouter, Request, Response

from engine.grammar_limits import on_compile_threads
from engine.sampling_params import SamplingParams
from server.errors import APIError
from server.guards import admit_sequences
from server.parsing import (check_model, check_unsupported, completion_prompts, ledger_prompt, make_request,
                            parse_body, render_chat)
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.reasoning import ReasoningSplitter, opens_reasoning
from server.responses import Choices, chat_completion, text_completion
from server.streams import (chat_events, completion_events, engine_stream, event_stream_response, merge,
                            until_disconnect)
from server.state import ServerState
from server.tool_calls import ToolCallParser
from trainer.ledger_db import ClientPrompt


def openai_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    def model_card(name: str):
        card = {"id": name, "object": "model", "created": state.created, "owned_by": "alchemist",
                "root": state.model_name, "max_model_len": state.max_model_len}
        adapter = served_adapter_card(state)
        if adapter is not None:
            card["adapter"] = adapter
        return card

    @router.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card(name) for name in state.model_names]}

    @router.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(state.model_names, model_id)
        return model_card(model_id)

    @router.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serve_chat_completion(state, request)

    @router.post("/v1/completions")
    async def completions(request: Request):
        return await serve_completion(state, request)

    return router


def served_adapter_card(state: ServerState) -> dict | None:
    """Which adapter the served weights hold: the live, trained one, or one served frozen."""
    if state.training is not None:
        return {"version": state.training.status().adapter_version, "frozen": False}
    adapter = state.served_adapter
    if adapter is None:
        return None
    return {"version": adapter.version, "path": adapter.path, "frozen": True}


def tools_and_sampling(state: ServerState, body: ChatCompletionRequest):
    """A chat's tools (their schemas compiled) and sampling parameters."""
    tools = body.tool_use()
    return tools, body.sampling_params(tools=tools, tool_call_token=state.tool_call_token,
                                       defaults=state.sampling_defaults)


@dataclass(frozen=True)
class ChatRun:
    """A chat request admitted and started in the engine."""

    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    outputs: AsyncIterator  # the engine's outputs (server/streams.py's engine_stream)
    parsers: list[ToolCallParser] | None  # one per choice when tools were offered
    splitters: list[ReasoningSplitter] | None = None  # one per choice with a reasoning parser (server/reasoning.py)


async def start_chat(state: ServerState, request: Request, body: ChatCompletionRequest,
                     id_prefix: str = "chatcmpl-") -> ChatRun:
    """Checks, renders and starts `body` in the engine, under a new id beginning `id_prefix`."""
    check_model(state.model_names, body.model)
    check_unsupported(body)
    # the CPU work of a request runs on worker threads (the tokenizer and llguidance let go of
    # the GIL): a 4 MB prompt, or a tool schema's or grammar's compiling, held the event loop
    # for seconds, and every other client with it (an outside pass)
    tools, params = await on_compile_threads(tools_and_sampling, state, body)
    admit_sequences(request, params.n)
    prompt_ids = await asyncio.to_thread(render_chat, state.tokenizer, body, tools)
    tail = body.prompt_tail(state.max_model_len, params.max_tokens)
    truncated = tail is not None and len(prompt_ids) > tail
    if truncated:
        prompt_ids = prompt_ids[-tail:]
    request_id = state.completion_id(id_prefix)
    # a prompt cut short is not the messages' rendering: no client prompt for the ledger's export
    client_prompt = ledger_prompt(state.tokenizer, body, tools) if state.keeps_client_prompt and not truncated \
        else None
    engine_request = make_request(state.engine, request_id, prompt_ids, params, body.train, "messages",
                                  client_prompt, await state.engine.check_grammar(params), body.cache_salt)
    state.metrics.count_constraints(params.grammar, tools)
    parsers = None
    if tools is not None:  # a forced call's layout is the grammar's, so its arguments can stream as decoded
        parsers = [ToolCallParser(tools.forced, state.metrics.count_tool_calls, tools.forced_names,
                                   named=tools.choice == "named", parallel=tools.parallel)
                   for _ in range(params.n)]
    splitters = None
    if state.reasoning_parser:
        in_reasoning = opens_reasoning(state.tokenizer.decode(prompt_ids[-8:]))
        splitters = [ReasoningSplitter(in_reasoning) for _ in range(params.n)]
    return ChatRun(request_id, params, len(prompt_ids), engine_stream(state.engine, engine_request), parsers,
                   splitters)


async def serve_chat_completion(state: ServerState, request: Request):
    body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
    run = await start_chat(state, request, body)
    n = run.params.n
    if body.stream:
        events = chat_events(run.request_id, body.model, run.outputs, n, run.num_prompt_tokens,
                             body.stream_options, state.tokens, run.parsers, run.splitters)
        return event_stream_response(events, state.engine, [run.request_id])

    async def whole():
        choices = Choices(n, n)
        async for output in run.outputs:
            choices.add(output)
        return chat_completion(run.request_id, body.model, int(time.time()), choices, run.num_prompt_tokens,
                               state.tokens, run.params.logprobs is not None, run.parsers, run.splitters)

    result = await until_disconnect(request, whole())
    return result if result is not None else Response(status_code=499)


async def serve_completion(state: ServerState, request: Request):
    body: CompletionRequest = await parse_body(request, CompletionRequest)
    check_model(state.model_names, body.model)
    check_unsupported(body)
    if body.suffix:
        raise APIError(400, "suffix is not supported (this server does not insert text between a prompt and a "
                            "suffix).", "suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of must equal n (returning the best of several samples is not supported).",
                       "best_of")
    params = await on_compile_threads(body.sampling_params, defaults=state.sampling_defaults)
    prompts = await asyncio.to_thread(completion_prompts, state.tokenizer, body.prompt, state.engine.vocab_size,
                                      body.prompt_tail(state.max_model_len, params.max_tokens))
    # one request of many prompts holds as many sequences
    admit_sequences(request, len(prompts) * params.n, "prompt" if len(prompts) > 1 else "n")
    request_id = state.completion_id("cmpl-")
    # with one prompt, the completion id is the training entry's id (for feedback)
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    # the ledger keeps a prompt as the client wrote it: not one sent as token ids, nor one cut short
    written = [body.prompt] if isinstance(body.prompt, str) else [p if isinstance(p, str) else None for p in body.prompt]
    matcher = await state.engine.check_grammar(params)  # compiled once, copied for the other prompts
    engine_requests = [make_request(state.engine, rid, prompt_ids, params, body.train, "prompt",
                                    ClientPrompt(text, as_written=text == client_text) if state.keeps_client_prompt
                                    else None, matcher if i == 0 or matcher is None else matcher.deep_copy(),
                                    body.cache_salt)
                       for i, (rid, (prompt_ids, text), client_text) in enumerate(zip(ids, prompts, written))]
    state.metrics.count_constraints(params.grammar, None)
    streams = [engine_stream(state.engine, r) for r in engine_requests]
    if body.stream:
        events = completion_events(request_id, body.model, streams, prompts, params.n, body.echo,
                                   body.logprobs, body.stream_options, state.tokens)
        return event_stream_response(events, state.engine, [r.request_id for r in engine_requests])

    async def whole():
        choices = Choices(len(prompts) * params.n, params.n)
        async for prompt_index, output in merge(streams):
            choices.add(output, prompt_index)
        return text_completion(request_id, body.model, int(time.time()), choices, prompts,
                               state.tokens, body.echo, body.logprobs is not None)

    result = await until_disconnect(request, whole())
    return result if result is not None else Response(status_code=499)
