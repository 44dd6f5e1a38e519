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
import re
from typing import Literal

from fastapi import APIRouter, Query, Request

from server.errors import APIError, shown
from server.protocol_items import CONVERSATION_ITEMS
from server.protocol_responses import ResponsesRequest
from server.response_store import StoredResponse
from server.routes_admin import owner_elsewhere
from server.state import ServerState

logger = logging.getLogger(__name__)

# the most items one page of input_items lists (OpenAI's bound)
MAX_PAGE = 100
# the ids this server gives responses (server/state.py's completion_id): only such an id can be stored anywhere
_ISSUED_ID = re.compile(r"resp_(r\d+-)?[0-9a-f]{32}")


def stored_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/v1/responses/{response_id}")
    async def get_response(response_id: str, request: Request):
        if request.query_params.get("stream", "false").lower() not in ("false", "0"):  # (the SDK's stream=True)
            raise APIError(400, "a stored response is not streamed again here: retrieve it whole", "stream",
                           "invalid_value")
        stored = await _stored_here(state, request, response_id)
        return stored.response if isinstance(stored, StoredResponse) else stored

    @router.get("/v1/responses/{response_id}/input_items")
    async def input_items(response_id: str, request: Request, limit: int = Query(20, ge=1, le=MAX_PAGE),
                          order: Literal["asc", "desc"] = "desc", after: str | None = None):
        stored = await _stored_here(state, request, response_id)
        if not isinstance(stored, StoredResponse):
            return stored
        items = stored.input_items
        return page(items if order == "asc" else items[::-1], limit, after)

    return router


def page(items: list[dict], limit: int, after: str | None) -> dict:
    """One page of `items` (in the order asked; their ids unique), from the one after item `after`."""
    if after is not None:
        ids = [item["id"] for item in items]
        if after not in ids:
            raise APIError(400, f"no input item {after!r} in this response's input", "after", "invalid_value")
        items = items[ids.index(after) + 1:]
    shown = items[:limit]
    return {"object": "list", "data": shown, "first_id": shown[0]["id"] if shown else None,
            "last_id": shown[-1]["id"] if shown else None, "has_more": len(items) > limit}


async def _stored_here(state: ServerState, request: Request, response_id: str):
    """The stored response, or the answer of the replica that keeps it (a 404 if none does)."""
    stored = await asyncio.to_thread(state.responses.get, response_id) if state.responses is not None else None
    if stored is not None:
        return stored
    owner = _owner_elsewhere(state, request, response_id)
    if owner is not None:
        return await state.peers.forward(owner, request, b"")
    raise APIError(404, f"No response found with id '{shown(response_id)}'.", "response_id", "not_found")


def _owner_elsewhere(state: ServerState, request: Request, response_id: str) -> int | None:
    """The other replica that would keep `response_id` (None: this one, or none could: an
    id this server never issues is asked of no replica)."""
    return owner_elsewhere(state, request, response_id) if _ISSUED_ID.fullmatch(response_id) else None


async def _from_replica(state: ServerState, request: Request, owner: int, response_id: str) -> StoredResponse | None:
    """A response another replica keeps, with all its input items; None if it keeps none."""
    answer = await state.peers.ask(owner, request, f"/v1/responses/{response_id}", method="GET")
    items, params = [], {"order": "asc", "limit": MAX_PAGE}
    while answer.is_success:
        listed = await state.peers.ask(owner, request, f"/v1/responses/{response_id}/input_items", method="GET",
                                       params=params)
        if not listed.is_success:
            answer = listed
            break
        body = listed.json()
        items += body["data"]
        if not body["has_more"]:
            response = answer.json()
            return StoredResponse(response, items, response.get("previous_response_id"))
        params["after"] = body["last_id"]
    if answer.status_code == 404:
        return None
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
    missing: str | None = body.previous_response_id
    while missing is not None:
        found, missing = await asyncio.to_thread(state.responses.chain, missing)
        owner = _owner_elsewhere(state, request, missing) if not found else None
        if owner is not None:  # a turn another replica served
            turn = await _from_replica(state, request, owner, missing)
            found, missing = ([turn], turn.previous_id) if turn is not None else ([], missing)
        if not found and turns and body.truncation == "auto":  # (an older turn pruned or deleted: dropped)
            break
        if not found:
            which = "" if missing == body.previous_response_id else f" (response '{missing}', which it continues)"
            raise APIError(400, f"Previous response with id '{shown(body.previous_response_id)}' not found{which}: "
                                "never stored, deleted, or pruned.", "previous_response_id",
                           "previous_response_not_found")
        turns += found
    items = [item for turn in reversed(turns) for item in (*turn.input_items, *turn.response["output"])
             if not _cut_call(item)]
    return CONVERSATION_ITEMS.validate_python(items)


def _cut_call(item: dict) -> bool:
    """A function call a limit cut before its arguments ended (`incomplete`): no call was
    made, and its text is no JSON a chat template could render as one."""
    return item.get("type") == "function_call" and item.get("status") == "incomplete"


async def keep_response(state: ServerState, body: ResponsesRequest, response: dict, response_key: str) -> None:
    """Stores a finished response unless it asked not to be (`"store": false`); one that
    could not be stored (too large, or the store failed: logged) says `"store": false`, and
    the answer is still given."""
    if state.responses is None or not response["store"]:
        return
    stored = StoredResponse(response, body.input_items(response_key), body.previous_response_id)
    try:
        kept = await asyncio.to_thread(state.responses.put, stored)
    except Exception:  # (sqlite3's errors, a full disk): the answer matters more than its copy
        logger.exception("response %s could not be stored: it cannot be retrieved or continued", response["id"])
        kept = False
    else:
        if not kept:
            logger.warning("response %s is larger than server.max_stored_response_bytes: not stored", response["id"])
    response["store"] = kept
