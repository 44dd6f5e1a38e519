"""Stored responses over HTTP (server/response_store.py keeps them): `GET /v1/responses/{id}`,
`GET /v1/responses/{id}/input_items` (OpenAI's list: `limit` 1..100, `order`, `after`),
keeping a finished response, and the conversation a `previous_response_id` continues.

Among data-parallel replicas without a shared store (no adapter directory), a response is
kept by the replica that served it, which its id names: a GET is answered by that
replica, and a conversation's turns are gathered from each turn's own.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

from fastapi import APIRouter, Query, Request

from server.errors import APIError
from server.protocol_responses import CONVERSATION_ITEMS, ResponsesRequest
from server.response_store import StoredResponse
from server.state import ServerState

logger = logging.getLogger(__name__)

# the most items one page of input_items lists (OpenAI's bound)
MAX_PAGE = 100


def stored_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        return (await _stored_or_404(state, request, response_id)).response

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        items = (await _stored_or_404(state, request, response_id)).input_items
        return page(items if order == "asc" else items[::-1], limit, after)

    return router


def page(items: list[dict], limit: int, after: str | None) -> dict:
    """One page of `items` (in the order asked), from the one after item `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in this response's input", "after", "invalid_value")
        items = items[ids.index(after) + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


async def _stored_or_404(state: ServerState, request: Request, response_id: str) -> StoredResponse:
    stored = await load_stored(state, request, response_id)
    if stored is None:
        raise APIError(404, f"No response found with id '{response_id}'.", "response_id", "not_found")
    return stored


async def load_stored(state: ServerState, request: Request, response_id: str) -> StoredResponse | None:
    """A stored response: this server's, or (replicas, each with a store of its own) the
    replica's that served it; None if none keeps it."""
    if state.responses is None:
        return None
    stored = await asyncio.to_thread(state.responses.get, response_id)
    if stored is not None or state.peers is None or state.peers.is_local(request):
        return stored
    owner = state.replica.owner_of(response_id)
    if owner == state.replica.rank:
        return None
    answer = await state.peers.ask(owner, request, f"/v1/responses/{response_id}", method="GET")
    if answer.status_code == 404:
        return None
    items, after = [], None
    while answer.is_success:
        listed = await state.peers.ask(owner, request, f"/v1/responses/{response_id}/input_items?order=asc&limit="
                                       f"{MAX_PAGE}" + (f"&after={after}" if after else ""), method="GET")
        if not listed.is_success:
            answer = listed
            break
        body = listed.json()
        items += body["data"]
        if not body["has_more"]:
            response = answer.json()
            return StoredResponse(response, items, response.get("previous_response_id"))
        after = body["last_id"]
    raise APIError(503, f"replica {owner}, which keeps response {response_id!r}, answered {answer.status_code}; "
                        "send the request again", code="replica_unavailable", headers={"Retry-After": "1"})


async def conversation_before(state: ServerState, request: Request, body: ResponsesRequest) -> list:
    """The items a request continues (`previous_response_id`): each earlier turn's input,
    then its output, oldest first; none without one. A 400 where a turn is not stored."""
    if body.previous_response_id is None:
        return []
    if state.responses is None:
        raise APIError(400, "responses are not stored on this server (server.max_stored_responses = 0): send the "
                            "whole conversation as 'input'", "previous_response_id", "previous_response_not_found")
    turns: list[StoredResponse] = []
    next_id: str | None = body.previous_response_id
    while next_id is not None:
        stored = await load_stored(state, request, next_id)
        if stored is None:
            missing = "" if next_id == body.previous_response_id else f" (response {next_id!r}, which it continues)"
            raise APIError(400, f"Previous response with id '{body.previous_response_id}' not found{missing}: "
                                "never stored, deleted, or pruned.", "previous_response_id",
                           "previous_response_not_found")
        turns.append(stored)
        next_id = stored.previous_id
    items = [item for turn in reversed(turns) for item in (*turn.input_items, *turn.response["output"])]
    return CONVERSATION_ITEMS.validate_python(items)


async def keep_response(state: ServerState, body: ResponsesRequest, response: dict, response_key: str) -> None:
    """Stores a finished response unless it asked not to be (`"store": false`); a store
    that cannot be written is logged, and the answer still given."""
    if state.responses is None or not response["store"]:
        return
    stored = StoredResponse(response, body.input_items(response_key), body.previous_response_id)
    try:
        await asyncio.to_thread(state.responses.put, stored)
    except Exception:  # (sqlite3's errors, a full disk): the answer matters more than its copy
        logger.exception("response %s could not be stored: it cannot be retrieved or continued", response["id"])
