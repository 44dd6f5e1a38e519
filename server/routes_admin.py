"""The routes beside the OpenAI ones: `/health`, `/metrics`, `POST /v1/feedback`, the
deletion of what the server keeps of a completion (`DELETE /v1/feedback/{id}`, its label;
`DELETE /v1/chat/completions/{id}`, the request and its label, as OpenAI's stored
completions are deleted), and the adapter routes (`GET /v1/adapters`,
`POST /v1/adapters/rollback`).

The trainer answers in typed results (`FeedbackResult`, `TrainerStatus`); the HTTP
statuses they become are decided here.
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST

from engine.async_engine import EngineDeadError
from server.errors import APIError, error_body
from server.parsing import parse_body
from server.protocol import FeedbackRequest, RollbackRequest
from server.state import ServerState, Training
from trainer.adapter_store import AdapterLoadError
from trainer.feedback import FeedbackOutcome
from trainer.ledger import LedgerUnavailable
from trainer.lifecycle import AdapterMismatchError

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

    @router.get("/metrics", response_class=Response)
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @router.post("/v1/feedback")
    async def feedback(request: Request):
        body: FeedbackRequest = await parse_body(request, FeedbackRequest)
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
    async def delete_feedback(completion_id: str):
        await forget(state, completion_id, label_only=True)
        return {"id": completion_id, "object": "feedback.deleted", "deleted": True}

    @router.delete("/v1/chat/completions/{completion_id}")
    async def delete_completion(completion_id: str):
        await forget(state, completion_id, label_only=False)
        return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}

    @router.get("/v1/adapters")
    async def adapters():
        if state.training is None and state.served_adapter is not None:
            adapter = state.served_adapter
            return {"object": "adapter", "version": adapter.version, "mode": "off", "frozen": True,
                    "path": adapter.path, "name": adapter.name or state.model_name}
        return adapter_status(state)

    @router.post("/v1/adapters/rollback")
    async def rollback(request: Request):
        body: RollbackRequest = await parse_body(request, RollbackRequest)
        training = saving_training(state)
        try:
            snapshot = await asyncio.to_thread(training.lifecycle.load_saved, body.version)
        except AdapterLoadError as exc:
            saved = [v.version for v in training.lifecycle.saved_versions()]
            if body.version not in saved:
                raise APIError(404, f"adapter version {body.version} is not saved; saved versions: {saved}",
                               "version", "version_not_found") from None
            raise APIError(409, f"saved adapter version {body.version} cannot be loaded: {exc}", "version",
                           "version_unreadable") from None
        try:
            await state.engine.run_on_device(training.rollback, snapshot)
        except AdapterMismatchError as exc:
            raise APIError(409, str(exc), "version", "version_incompatible") from None
        except EngineDeadError:
            raise APIError(503, "the server is shutting down") from None
        return adapter_status(state)

    return router


async def forget(state: ServerState, completion_id: str, label_only: bool) -> None:
    """Deletes what the server keeps of a completion (404 if it keeps nothing; 503 if the
    feedback ledger cannot be written now)."""
    training = live_training(state)
    try:
        found = await asyncio.to_thread(training.forget, completion_id, label_only)
    except LedgerUnavailable as exc:
        raise APIError(503, f"nothing was deleted: {exc}; send it again later", code="ledger_unavailable",
                       headers={"Retry-After": str(LEDGER_RETRY_AFTER_S)}) from None
    if not found:
        what = "label" if label_only else "stored request"
        raise APIError(404, f"no {what} for completion {completion_id!r}", "id", "not_found")


def live_training(state: ServerState) -> Training:
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
