"""The routes beside the OpenAI ones: `/health`, `/version`, `/metrics`, `POST /v1/feedback`, the
deletion of what the server keeps of a completion (`DELETE /v1/feedback/{id}`, its label;
`DELETE /v1/chat/completions/{id}`, the request and its label, as OpenAI's stored
completions are deleted), and the adapter routes (`GET /v1/adapters`,
`POST /v1/adapters/rollback`).

The trainer answers in typed results (`FeedbackResult`, `TrainerStatus`); the HTTP
statuses they become are decided here. Among data-parallel replicas, what concerns the
whole server or another replica is asked of the others (server/fanout.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import importlib.metadata

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import EngineDeadError
from server.errors import APIError, error_body, shown
from server.fanout import METRICS_PEER_TIMEOUT_S, STATUS_PEER_TIMEOUT_S, merge_metrics
from server.parsing import parse_body
from server.protocol_training import FeedbackRequest, RollbackRequest
from server.state import ServerState, Training
from trainer.adapter_store import AdapterLoadError, AdapterMismatchError, AdapterNotSaved
from trainer.feedback import FeedbackOutcome, FeedbackResult
from trainer.ledger import LedgerUnavailable
from trainer.replica_messages import RollbackSuperseded

_FEEDBACK_STATUS = {FeedbackOutcome.INVALID: 400, FeedbackOutcome.UNKNOWN: 404, FeedbackOutcome.CONFLICT: 409,
                    FeedbackOutcome.UNAVAILABLE: 503}
# seconds a client waits before sending again what the feedback ledger could not write
LEDGER_RETRY_AFTER_S = 1


def admin_router(state: ServerState) -> APIRouter:
    router = APIRouter()

    @router.get("/health")
    async def health():
        if not state.engine.is_alive:
            return JSONResponse(error_body(503, "the engine is not running"), status_code=503)
        return {"status": "ok"}

    @router.get("/version")
    async def version():
        try:
            return {"version": importlib.metadata.version("alchemist")}
        except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
            return {"version": "unknown"}

    @router.get("/metrics", response_class=Response)
    async def metrics(request: Request):
        own = state.metrics.render()
        if state.peers is None or state.peers.is_local(request):
            return Response(own, media_type=CONTENT_TYPE_LATEST)
        answers = await state.peers.ask_each(request, "/metrics", METRICS_PEER_TIMEOUT_S)
        texts = [own.decode() if rank == state.peers.rank else answers[rank] and answers[rank].text
                 for rank in range(state.peers.world_size)]
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @router.post("/v1/feedback")
    async def feedback(request: Request):
        try:
            body: FeedbackRequest = await parse_body(request, FeedbackRequest)
        except APIError as refused:  # malformed: counted with the labels the trainer refused
            if state.training is not None:
                state.training.feedback.count(FeedbackResult(FeedbackOutcome.INVALID, refused.message))
            raise
        owner = owner_elsewhere(state, request, body.id)
        if owner is not None:  # the label trains where its recording is
            return await state.peers.forward(owner, request, await request.body())
        if state.training is None:
            raise APIError(400, "training is off on this server (start it with --train-mode dpo or grpo); "
                                "feedback is not used", code="feedback_not_used")
        # a label's texts are tokenized on a worker thread, never on the event loop
        result = await asyncio.to_thread(state.training.feedback.submit, body.label())
        if not result.accepted:
            retry = {"Retry-After": str(LEDGER_RETRY_AFTER_S)} if result.outcome is FeedbackOutcome.UNAVAILABLE \
                else None
            raise APIError(_FEEDBACK_STATUS[result.outcome], result.message, result.param, result.code,
                           headers=retry)
        state.engine.notify()
        if result.skipped:  # valid, but nothing to learn from: say so
            return {"id": body.id, "object": "feedback", "status": "skipped", "message": result.message}
        return {"id": body.id, "object": "feedback", "status": "accepted"}

    @router.delete("/v1/feedback/{completion_id}")
    async def delete_feedback(completion_id: str, request: Request):
        owner = owner_elsewhere(state, request, completion_id)
        if owner is not None:
            return await state.peers.forward(owner, request, b"")
        return await forget(state, completion_id, label_only=True)

    @router.delete("/v1/chat/completions/{completion_id}")
    async def delete_completion(completion_id: str, request: Request):
        owner = owner_elsewhere(state, request, completion_id)
        if owner is not None:
            return await state.peers.forward(owner, request, b"")
        return await forget(state, completion_id, label_only=False)

    @router.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str, request: Request):
        owner = owner_elsewhere(state, request, response_id)
        if owner is not None:
            return await state.peers.forward(owner, request, b"")
        if not response_id.startswith(("resp_", "resp-")):  # (resp-: before OpenAI's ids; a chat's: its route)
            raise APIError(404, f"no response '{shown(response_id)}': a response's id begins 'resp_'", "id",
                           "not_found")
        return await forget_response(state, response_id)

    add_adapter_routes(router, state)
    return router


def add_adapter_routes(router: APIRouter, state: ServerState) -> None:
    """`GET /v1/adapters` and `POST /v1/adapters/rollback`."""

    @router.get("/v1/adapters")
    async def adapters(request: Request):
        if state.training is None and state.served_adapter is not None:
            adapter = state.served_adapter
            return {"object": "adapter", "version": adapter.version, "mode": "off", "frozen": True,
                    "path": adapter.path, "name": adapter.name or state.model_name}
        return await server_status(request, whole=not (state.peers is not None and state.peers.is_local(request)))

    async def server_status(request: Request, whole: bool) -> dict:
        """This replica's `/v1/adapters`, or (`whole`) the server's: every replica's, merged."""
        status = adapter_status(state)
        status["replicas"] = [await replica_card(state)]
        if state.peers is None or not whole:
            return status
        answers = await state.peers.ask_all(request, "/v1/adapters", method="GET", timeout_s=STATUS_PEER_TIMEOUT_S)
        return whole_server_status([a.json() if a is not None else status for a in answers])

    @router.post("/v1/adapters/rollback")
    async def rollback(request: Request):
        body: RollbackRequest = await parse_body(request, RollbackRequest)
        if state.peers is not None and not state.peers.is_local(request) and state.peers.rank != 0:
            return await state.peers.forward(0, request, await request.body())  # rank 0 rolls everyone back
        training = saving_training(state)
        try:
            snapshot = await asyncio.to_thread(training.lifecycle.load_saved, body.version)
        except AdapterNotSaved:
            saved = [v.version for v in training.lifecycle.saved_versions()]
            raise APIError(404, f"adapter version {body.version} is not saved; saved versions: {saved}",
                           "version", "version_not_found") from None
        except AdapterLoadError as exc:  # (saved, itself or a copy of its weights, and unreadable)
            raise APIError(409, f"saved adapter version {body.version} cannot be loaded: {exc}", "version",
                           "version_unreadable") from None
        try:
            version = await state.engine.run_on_device(training.rollback, snapshot)
            if isinstance(version, concurrent.futures.Future):  # every replica rolls back at one round
                version = await asyncio.wrap_future(version)
        except AdapterMismatchError as exc:
            raise APIError(409, str(exc), "version", "version_incompatible") from None
        except EngineDeadError:
            raise APIError(503, "the server is shutting down") from None
        except RollbackSuperseded as exc:
            raise APIError(409, str(exc), "version", "rollback_superseded") from None
        except RuntimeError as exc:  # the replicas' rounds stopped
            raise APIError(503, f"the rollback did not reach every replica: {exc}", code="replica_unavailable",
                           headers={"Retry-After": "1"}) from None
        try:  # as GET /v1/adapters answers: every replica's
            status = await server_status(request, whole=True)
        except APIError:  # a replica did not answer: the rollback is done all the same; this one's
            status = await server_status(request, whole=False)
        # the rollback's own version, though steps may have trained on top of it since (replicas' rounds)
        return {**status, "version": version, "restored_from": snapshot.version}


def owner_elsewhere(state: ServerState, request: Request, completion_id: str) -> int | None:
    """The replica that served `completion_id`, where that is another one (None: this one
    answers — a single server, a replica's own completion, or another replica's question)."""
    if state.peers is None or state.peers.is_local(request):
        return None
    owner = state.replica.owner_of(completion_id)
    return None if owner == state.replica.rank else owner


async def replica_card(state: ServerState) -> dict:
    """This replica in `/v1/adapters`: its rank, the version it serves, the digest of its
    adapter's weights and the requests it finished."""
    training = live_training(state)
    try:
        digest = await state.engine.run_on_device(training.adapter_digest)
    except EngineDeadError:
        raise APIError(503, "the server is shutting down") from None
    return {"rank": state.replica.rank if state.replica is not None else 0,
            "version": training.status().adapter_version, "digest": digest,
            "requests_served": state.metrics.requests_served()}


def whole_server_status(answers: list[dict]) -> dict:
    """Every replica's `/v1/adapters` (by rank) as the server's: rank 0's (it saves the
    versions), with the training counters summed and every replica's card."""
    merged = {**answers[0], "replicas": [a["replicas"][0] for a in answers]}
    # a skipped step is every replica's (the same combined gradients): counted once
    merged["training"] = {key: value if key in ("last_loss", "skipped_steps") else
                          sum(a["training"][key] for a in answers) for key, value in answers[0]["training"].items()}
    # each replica's last job's loss, averaged over those that trained (rank 0 alone read null)
    losses = [a["training"]["last_loss"] for a in answers if a["training"].get("last_loss") is not None]
    merged["training"]["last_loss"] = sum(losses) / len(losses) if losses else None
    if merged.get("gate"):  # rank 0 judges; each replica quarantines the labels it trained
        merged["gate"] = {**merged["gate"], "quarantined_labels": sum(a["gate"]["quarantined_labels"]
                                                                      for a in answers)}
    return merged


async def forget_response(state: ServerState, response_id: str) -> dict:
    """Deletes what the server keeps of a response: its request and label (as `forget`),
    then its stored copy (server/response_store.py); a 404 if it keeps neither."""
    forgotten = None
    if state.training is not None:
        try:
            forgotten = await forget(state, response_id, label_only=False, deleted_object="response")
        except APIError as exc:
            if exc.status != 404 or state.responses is None:
                raise
    stored = state.responses is not None and await asyncio.to_thread(state.responses.delete, response_id)
    if forgotten is not None:
        return forgotten
    if not stored:
        raise APIError(404, f"No response found with id '{shown(response_id)}'.", "id", "not_found")
    return {"id": response_id, "object": "response", "deleted": True, "trained_into_version": None}


async def forget(state: ServerState, completion_id: str, label_only: bool, deleted_object: str | None = None) -> dict:
    """Deletes what the server keeps of a completion (404 if it keeps nothing; 503 if the
    feedback ledger cannot be written now). A label being trained is withdrawn from its
    job on the device thread, the job's other labels requeued; one whose step could not be
    stopped trains, and the answer is a 409 that says so. One that had trained already:
    the answer names the first version holding it (`trained_into_version`). `deleted_object`:
    the answer's `object` (OpenAI's name for what was deleted, by route)."""
    what = "label" if label_only else "stored request"
    training = state.training
    if training is None:
        raise APIError(404, f"no {what} for completion {completion_id!r}: training is off on this server, so it "
                            "keeps no completions", "id", "not_found")
    try:
        forgotten = await asyncio.to_thread(training.forget, completion_id, label_only)
    except LedgerUnavailable as exc:
        raise APIError(503, f"nothing was deleted: {exc}; send it again later", code="ledger_unavailable",
                       headers={"Retry-After": str(LEDGER_RETRY_AFTER_S)}) from None
    found = forgotten.found
    if forgotten.training:
        try:
            trained = await state.engine.run_on_device(training.withdraw_from_training, forgotten.training)
        except EngineDeadError:  # shutting down: no step runs any more
            if not found:
                raise APIError(503, "the server is shutting down") from None
            trained = []
        if trained:
            rest = "the rest the server kept of it was deleted" if found else "nothing else of it is kept"
            raise APIError(409, f"the label of completion {completion_id!r} was already in an optimizer step that "
                                "could not be stopped (being applied, or combined across replicas): it is in the "
                                f"adapter from the next version on (a rollback undoes it); {rest}", "id",
                           "label_in_training")
        found = True
    if forgotten.pending:  # (as a label for it is answered)
        raise APIError(409, f"completion {completion_id!r} is still being generated; delete it once it has "
                            "finished", "id", "response_pending")
    if not found:
        raise APIError(404, f"no {what} for completion {completion_id!r}", "id", "not_found")
    deleted_object = deleted_object or ("feedback.deleted" if label_only else "chat.completion.deleted")
    return {"id": completion_id, "object": deleted_object, "deleted": True,
            "trained_into_version": forgotten.trained_into}


def live_training(state: ServerState) -> Training:
    if state.training is None and state.served_adapter is not None:
        raise APIError(400, f"training is off on this server: it serves adapter version "
                            f"{state.served_adapter.version} frozen (serve another saved version with "
                            "--adapter-version N, or roll back on a server training into the directory)",
                       code="adapters_not_used")
    if state.training is None:
        raise APIError(400, "training is off on this server, so there is no adapter (start it with "
                            "--train-mode cpt|dpo|grpo)", code="adapters_not_used")
    return state.training


def saving_training(state: ServerState) -> Training:
    training = live_training(state)
    if training.status().saves is None:
        raise APIError(400, "adapters are not saved on this server (start it with --adapter-dir DIR)",
                       code="adapter_dir_not_set")
    return training


def adapter_status(state: ServerState) -> dict:
    """GET /v1/adapters: the version serving, the saved ones, the training counters, the
    rollbacks, and the eval gate's last verdicts."""
    training = live_training(state)
    status = training.status()
    stats, saves = status.training, status.saves
    loss = stats.last_loss
    return {
        "object": "adapter",
        "version": status.adapter_version,
        "restored_from": status.restored_from,
        "mode": status.mode,
        "adapter_dir": saves.adapter_dir if saves else None,
        "save_every": saves.save_every if saves else None,
        "saved": [{"version": v.version, "path": str(v.path), "created": int(v.created)}
                  for v in training.lifecycle.saved_versions()],
        "training": {
            "trained_entries": sum(stats.trained_entries.values()),
            "train_tokens": stats.train_tokens,
            "last_loss": loss if loss == loss else None,
            "skipped_steps": status.skipped_steps,
            "failed_jobs": stats.failed_jobs,
            "stale_entries": stats.stale_entries,
            "activation_cache_bytes": status.cache.bytes,
        },
        "rollbacks": dict(stats.rollbacks),
        "gate": None if status.gate is None else {
            "candidate_version": status.gate.candidate_version, "last_promoted": status.gate.last_promoted,
            "last_rejected": status.gate.last_rejected, "evaluations": status.gate.evaluations,
            "eval_seconds": round(status.gate.eval_seconds, 4), "promoted": status.gate.promoted,
            "rejected": status.gate.rejected, "quarantined_labels": stats.quarantined_labels},
    }
