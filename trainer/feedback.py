"""Feedback: a preference label attached to a served completion's cache entry.

`attach_label` validates a label against its entry and attaches it; it returns a typed
`FeedbackResult` (accepted, or why not, with OpenAI's `param` and `code`), which the
server maps to 200/400/404/409. Runs on the HTTP thread under the cache's lock (no
tensor work: token ids only).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from trainer.cache import ActivationCache, EntryState, PreferenceLabel


class FeedbackOutcome(str, enum.Enum):
    ACCEPTED = "accepted"
    # the label is malformed, or this server does not use feedback
    INVALID = "invalid"
    # no entry for the completion: unknown, not recorded, evicted or expired
    UNKNOWN = "unknown"
    # the entry already has its label, or its response is still being generated
    CONFLICT = "conflict"


@dataclass(frozen=True)
class FeedbackResult:
    outcome: FeedbackOutcome
    message: str = ""
    # the request field at fault, and OpenAI's error code
    param: str | None = None
    code: str | None = None

    @property
    def accepted(self) -> bool:
        return self.outcome is FeedbackOutcome.ACCEPTED


ACCEPTED = FeedbackResult(FeedbackOutcome.ACCEPTED)


class _Refused(Exception):
    def __init__(self, result: FeedbackResult):
        self.result = result


def _refuse(outcome: FeedbackOutcome, message: str, param: str | None, code: str) -> _Refused:
    return _Refused(FeedbackResult(outcome, message, param, code))


@dataclass(frozen=True)
class FeedbackLabel:
    completion_id: str
    # response texts; None means "the served response" (of `choice_index`)
    chosen: str | None
    rejected: str | None
    choice_index: int = 0


def attach_label(cache: ActivationCache, request: FeedbackLabel, response_ids: Callable[[str], list[int]],
                 max_model_len: int) -> FeedbackResult:
    """Validates `request` against its entry and attaches the label (the entry becomes
    ready for training); `response_ids` tokenizes a response text."""
    try:
        _attach(cache, request, response_ids, max_model_len)
    except _Refused as refused:
        return refused.result
    return ACCEPTED


def _attach(cache: ActivationCache, request: FeedbackLabel, response_ids, max_model_len: int) -> None:
    completion_id, chosen, rejected, choice_index = (request.completion_id, request.chosen, request.rejected,
                                                     request.choice_index)
    if chosen is None and rejected is None:
        raise _refuse(FeedbackOutcome.INVALID, "give at least one of 'chosen' and 'rejected'; the other defaults "
                      "to the served response", "chosen", "missing_required_parameter")
    with cache.lock:
        entry = cache.get(completion_id)
        if entry is None:
            ended = cache.ended_state(completion_id)
            if ended is EntryState.TRAINED:
                raise _refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label and "
                              "was trained on", "id", "label_exists")
            if ended is EntryState.NOT_TRAINABLE:
                raise _refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} cannot be trained on: it was "
                              "served with \"train\": false (or only scored); send feedback for completions "
                              "served with training allowed", "id", "not_trainable")
            reason = {EntryState.EXPIRED: "it expired (no feedback within the label timeout)",
                      EntryState.DROPPED: "it was dropped (its request was cut short, or the bound on entries "
                                          "waiting for a label, train.max_label_entries, was reached)"}.get(
                ended, "it is unknown (or so old that the server no longer remembers it)")
            raise _refuse(FeedbackOutcome.UNKNOWN, f"no training entry for completion {completion_id!r}: {reason}",
                          "id", "entry_not_found")
        if getattr(entry, "label", None) is not None:
            raise _refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label", "id",
                          "label_exists")
        served = None
        if chosen is None or rejected is None:
            if not entry.response_finished:
                raise _refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} is still being generated; "
                              "send both 'chosen' and 'rejected', or wait for it to finish", "id",
                              "response_pending")
            if choice_index not in entry.responses:
                raise _refuse(FeedbackOutcome.INVALID, f"choice_index {choice_index} does not exist; the "
                              f"completion has choices {sorted(entry.responses)}", "choice_index", "invalid_value")
            served = list(entry.responses[choice_index])
            if not served:
                raise _refuse(FeedbackOutcome.INVALID, "the served response is empty; give both 'chosen' and "
                              "'rejected'", "id", "invalid_value")
        chosen_ids = response_ids(chosen) if chosen is not None else served
        rejected_ids = response_ids(rejected) if rejected is not None else served
        if chosen_ids == rejected_ids:
            raise _refuse(FeedbackOutcome.INVALID, "'chosen' and 'rejected' are the same response", "chosen",
                          "invalid_value")
        limit = max_model_len - len(entry.prompt_token_ids)
        for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
            if len(ids) > limit:
                raise _refuse(FeedbackOutcome.INVALID, f"'{name}' is {len(ids)} tokens; at most {limit} fit after "
                              "the prompt", name, "context_length_exceeded")
        entry.label = PreferenceLabel(chosen_ids, rejected_ids)
        if served is not None and choice_index in entry.served_logps:
            side = "rejected" if rejected is None else "chosen"
            entry.label.served_logps[side] = entry.served_logps[choice_index]
        if entry.state is EntryState.WAITING_LABEL:
            entry.state = EntryState.READY
