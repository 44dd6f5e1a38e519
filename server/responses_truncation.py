"""OpenAI's `truncation: "auto"` for the Responses API: a conversation longer than the
context loses turns from its beginning until its prompt fits.

A turn begins with a user message (the items before the first one are a turn too); its
calls, their outputs and its reasoning go with it. System and developer messages stay
wherever they are (a client's persona and rules, sent as items, are not what goes first),
and so does the newest turn: where even that does not fit, the whole prompt's 400 says so.
The prompt must leave room for `max_output_tokens`, as every request's must.
The fitting cut is found by a binary search over the turns (fitting only gets easier as
turns go), each probe a rendering of the chat template, not a started request.
"""

from __future__ import annotations

import asyncio

from engine.grammar_limits import on_compile_threads
from server.parsing import render_chat
from server.protocol import ChatCompletionRequest
from server.protocol_items import InputMessage
from server.protocol_responses import ResponsesRequest
from server.routes_openai import tools_and_sampling
from server.state import ServerState


def turn_cuts(items: list) -> list[list]:
    """The conversation `items` without its first 0, 1, … turns, down to its newest turn
    (system and developer messages always kept)."""
    kept_always = {i for i, item in enumerate(items)
                   if isinstance(item, InputMessage) and item.role in ("system", "developer")}
    others = [i for i in range(len(items)) if i not in kept_always]
    starts = [i for i in others if isinstance(items[i], InputMessage) and items[i].role == "user"]
    points = sorted({others[0], *starts}) if others else [0]
    return [[item for i, item in enumerate(items) if i in kept_always or i >= point] for point in points]


async def fit_to_context(state: ServerState, body: ResponsesRequest, items: list) -> list:
    """`items` (the conversation's, then the request's input) without as many of their
    oldest turns as the prompt needs to fit `body`'s limits."""
    cuts = turn_cuts(items)

    def chat_of(kept: list) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(body.model_copy(update={"input": kept}).chat_body())

    tools, params = await on_compile_threads(tools_and_sampling, state, chat_of(items))
    longest = state.max_model_len - max(params.max_tokens or 0, 1)  # (as the engine checks a prompt)

    async def fits(index: int) -> bool:
        prompt = await asyncio.to_thread(render_chat, state.tokenizer, chat_of(cuts[index]), tools)
        return len(prompt) <= longest

    if await fits(0) or not await fits(len(cuts) - 1):  # (where nothing fits, the whole prompt's 400 says so)
        return items
    low, high = 0, len(cuts) - 1  # cuts[low] does not fit, cuts[high] does
    while high - low > 1:
        middle = (low + high) // 2
        if await fits(middle):
            high = middle
        else:
            low = middle
    return cuts[high]
