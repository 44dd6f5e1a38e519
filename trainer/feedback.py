"""Feedback: a label attached to a served completion's cache entry — a preference (DPO: `chosen`/`rejected`
texts, one side defaulting to the served response, or two served choices by index) or a reward per choice (GRPO).

`attach_label` validates a label against its entry and has the cache attach it; it returns a typed
`FeedbackResult` (accepted, or why not, with OpenAI's `param` and `code`), which the server maps to
200/400/404/409/503. With a feedback ledger (trainer/ledger.py) a label is committed there before the cache
attaches it: 200 means it survives a crash; a ledger that cannot be written refuses it (503), changing nothing.
`FeedbackIntake` (trainer/intake.py) is what the server calls. Both run on a worker thread, never on the event
loop: a label's texts are tokenized before the cache is consulted, and no lock is held meanwhile (the cache
attaches the label only if the entry still waits for one). A request in flight: 409 `response_pending`.
"""
from __future__ import annotations

import dataclasses
import itertools
import math
import sqlite3
from dataclasses import dataclass
from typing import Callable, NoReturn

from trainer.cache import ActivationCache
from trainer.entries import CacheEntry, EntryState, GroupEntry, GroupRewards, PreferenceEntry, PreferenceLabel
from trainer.ledger import LabelExists, Ledger, LedgerUnavailable
from trainer.label_history import fate_said, is_prompt_of, remembered
from trainer.feedback_result import ACCEPTED, FeedbackOutcome, FeedbackResult, Refused, refuse
from trainer.ledger_db import LabelRecord, read_ledger


@dataclass(frozen=True)
class FeedbackLabel:
    completion_id: str
    # response texts; None means "the served response" (of `choice_index`)
    chosen: str | None = None
    rejected: str | None = None
    choice_index: int = 0
    # DPO between two served choices of an n >= 2 request
    chosen_index: int | None = None
    rejected_index: int | None = None
    # GRPO: one reward per choice
    rewards: list[float] | None = None
    # who sent it: "api" (POST /v1/feedback) or "reward_function"
    source: str = "api"


# which label a training method takes (TrainingMethod.label_kind)
PREFERENCE, REWARDS = "preference", "rewards"


@dataclass(frozen=True)
class _Labels:
    """Where a label goes once validated: the ledger first (when there is one), then the cache."""

    cache: ActivationCache
    ledger: Ledger | None
    request: FeedbackLabel


@dataclass(frozen=True)
class ResponseText:
    """A response's text and its token ids, as the served tokenizer maps them."""

    # a label's text to its ids (the end of sequence not appended)
    ids: Callable[[str], list[int]]
    # served ids to the text the client read (special tokens skipped)
    text: Callable[[list[int]], str]
    # the served response's ids (None: not finished) and the prompt's to the end a label's text trains
    # with (trainer/turn_end.py)
    end: Callable[[list[int] | None, list[int]], list[int]]


def attach_label(cache: ActivationCache, request: FeedbackLabel, responses: ResponseText, max_model_len: int,
                 label_kind: str = PREFERENCE, ledger: Ledger | None = None) -> FeedbackResult:
    """Validates `request` against its entry and attaches the label (the entry becomes
    ready for training). With a `ledger`, the label is committed there before it is
    attached: accepted means on disk."""
    try:
        request = dataclasses.replace(request, completion_id=lone_prompts_id(cache, ledger, request.completion_id))
        request = _for_prompt_of_batch(cache, request)
        to = _Labels(cache, ledger, request)
        if label_kind == REWARDS:
            return _attach_rewards(to, request)
        if request.rewards is not None:
            raise refuse(FeedbackOutcome.INVALID, "'rewards' are for group training; this server trains on "
                          "preferences (give 'chosen'/'rejected', or 'chosen_index'/'rejected_index')", "rewards",
                          "invalid_value")
        if request.chosen_index is not None or request.rejected_index is not None:
            _attach_indices(to, request)
        else:
            _attach(to, request, responses, max_model_len)
    except Refused as refused:
        return refused.result
    return ACCEPTED


def entry_ids_of(cache: ActivationCache, completion_id: str) -> list[str]:
    """The ids of the cache's entries for `completion_id`: its own, or its prompts' (`<id>-<i>`,
    a `/v1/completions` request of several) up to the last live one or the last known in
    order from the first (an ended one the cache no longer remembers counts, as unknown)."""
    if _known(cache, completion_id):
        return [completion_id]
    indices = {int(entry.completion_id.rpartition("-")[2]) for entry in cache.entries()
               if is_prompt_of(completion_id, entry.completion_id)}
    indices.update(itertools.takewhile(lambda i: _known(cache, f"{completion_id}-{i}"), itertools.count()))
    return [f"{completion_id}-{i}" for i in range(max(indices) + 1)] if indices else [completion_id]


def _known(cache: ActivationCache, entry_id: str) -> bool:
    return cache.get(entry_id) is not None or cache.ended_state(entry_id) is not None or entry_id in cache.expected


def lone_prompts_id(cache: ActivationCache, ledger: Ledger | None, completion_id: str) -> str:
    """The id a label or a deletion names: a `/v1/completions` list of one prompt is no batch
    (its entry is `<id>`, as one prompt's is), but clients that name a list's prompt i
    `<id>-<i>` name it `<id>-0`, taken for `<id>` when the cache or the ledger knows `<id>`
    and not `<id>-0`."""
    prefix, _, index = completion_id.rpartition("-")
    if index != "0" or not prefix.startswith("cmpl-") or _known(cache, completion_id):
        return completion_id
    if _known(cache, prefix):
        return prefix
    try:
        known = {row.request.id for row in read_ledger(ledger.path, "r.id IN (?, ?)", (completion_id, prefix))} \
            if ledger is not None else set()
    except (sqlite3.Error, OSError):
        return completion_id
    return prefix if known == {prefix} else completion_id


def _for_prompt_of_batch(cache: ActivationCache, request: FeedbackLabel) -> FeedbackLabel:
    """A `/v1/completions` request of several prompts keeps an entry per prompt (`<id>-<i>`)
    and numbers its choices across them, as its response does: with n choices per prompt,
    prompt i's j-th is choice i·n + j. A label naming such a completion is `request` for the
    entry of the prompt its choices belong to; any other label is `request` itself."""
    cid = request.completion_id
    entry_ids = entry_ids_of(cache, cid)
    if entry_ids == [cid]:
        return request
    entries = [cache.get(entry_id) for entry_id in entry_ids]
    if request.rewards is not None:
        _refuse_batch_rewards(cid, len(entries))
    pair = request.chosen_index is not None or request.rejected_index is not None
    names = ("chosen_index", "rejected_index") if pair else ("choice_index",)
    indices = {name: getattr(request, name) for name in names if getattr(request, name) is not None}
    per_prompt = next((len(e.responses) for e in entries if e is not None and e.response_finished), None)
    if per_prompt is None and any(indices.values()):  # choice 0 is prompt 0's first, whatever n is
        in_flight = any(entry_id in cache.expected for entry_id in entry_ids)
        if all(entry is None for entry in entries) and not in_flight:  # every prompt's ended: say how, if alike
            states = {entry_id: cache.ended_state(entry_id) for entry_id in entry_ids}
            ended = set(states.values()) - {None}  # (one the cache no longer remembers: None)
            if len(ended) == 1:
                _waiting_entry(cache, next(entry_id for entry_id, state in states.items() if state is not None))
            raise refuse(FeedbackOutcome.UNKNOWN, f"no training entry is left for completion {cid!r}: its prompts' "
                          f"entries ended ({', '.join(sorted(s.value for s in ended))})", "id", "entry_not_found")
        raise _still_generating(cid)
    prompts = {name: index // (per_prompt or 1) for name, index in indices.items()}
    for name, prompt in prompts.items():
        if prompt >= len(entries):
            raise refuse(FeedbackOutcome.INVALID, f"{name} {indices[name]} does not exist; the completion has "
                          f"choices 0 to {len(entries) * per_prompt - 1}", name, "invalid_value")
    if len(set(prompts.values())) > 1:
        raise refuse(FeedbackOutcome.INVALID, f"choices {indices['chosen_index']} and "
                      f"{indices['rejected_index']} answer different prompts; a preference compares two "
                      "answers to one prompt", "rejected_index", "invalid_value")
    prompt = next(iter(prompts.values()), 0)
    return dataclasses.replace(request, completion_id=f"{cid}-{prompt}",
                               **{name: index - prompt * (per_prompt or 1) for name, index in indices.items()})


def _refuse_batch_rewards(completion_id: str, prompts: int) -> NoReturn:
    raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} answered {prompts} prompts; send each "
                  f"prompt's rewards on its own, with id '{completion_id}-<prompt index>'", "rewards", "invalid_value")


def _waiting_entry(cache: ActivationCache, completion_id: str, ledger: Ledger | None = None,
                   choice: int | None = 0) -> CacheEntry:
    """The completion's entry, still without a label; refuses (404/409/400) otherwise. An entry this process
    never had may have had its label before a restart: the `ledger` says so (409, as before the restart), of a
    batch's prompt by the label's `choice` (None: rewards, which a batch's id never takes)."""
    entry = cache.get(completion_id)
    if entry is None and completion_id in cache.expected:  # queued, prefilling, or not recorded: no entry yet
        raise _still_generating(completion_id)
    if entry is None:
        ended = cache.ended_state(completion_id)
        if completion_id in cache.deleted_ids:
            raise refuse(FeedbackOutcome.UNKNOWN, _deleted_message(completion_id), "id", "entry_not_found")
        if ended in (EntryState.TRAINED, EntryState.SKIPPED):
            how = (ledger is not None and fate_said(ledger.path, completion_id)) or "was " + (
                "trained on" if ended is EntryState.TRAINED else "skipped (equal rewards)")
            raise refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label and {how}",
                          "id", "label_exists")
        if ended is EntryState.NOT_TRAINABLE:
            raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} cannot be trained on: it was "
                          "served with \"train\": false (or only scored), so it takes no label", "id", "not_trainable")
        if ended is EntryState.NOT_A_GROUP:
            raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} is not a group: this server "
                          "trains on groups of samples; request them with n >= 2", "id", "not_a_group")
        if ended is None:
            _labelled_before(ledger, completion_id, choice)
        said = ended is EntryState.DROPPED and ledger is not None and fate_said(ledger.path, completion_id)
        reason = f"it {said}, says the feedback ledger" if said else {
            EntryState.EXPIRED: "it expired (no feedback within the label timeout)",
            EntryState.DROPPED: "it was dropped (its request was cut short, the reward function failed on it, or "
                                "the bound on entries waiting for a label, train.max_label_entries, was reached)"}.get(
            ended, "it is unknown (or so old that the server no longer remembers it)")
        raise refuse(FeedbackOutcome.UNKNOWN, f"no training entry for completion {completion_id!r}: {reason}",
                      "id", "entry_not_found")
    if getattr(entry, "label", None) is not None:
        raise refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label", "id",
                      "label_exists")
    return entry


def _labelled_before(ledger: Ledger | None, completion_id: str, choice: int | None) -> None:
    """Refuses a completion this process's cache never knew as the ledger remembers it (a label sent
    again after a restart): 409 if its label is kept there, 404 if it was deleted or ended (why, as
    the ledger says) — its own, or for a batch's id, the prompt's its choice `choice` answers."""
    try:
        memory = remembered(ledger.path, completion_id, choice) if ledger is not None else None
    except (sqlite3.Error, OSError):
        return  # unreadable now: answered as the cache alone would
    if memory is not None and memory.prompts:
        _refuse_batch_rewards(completion_id, memory.prompts)
    if memory is not None and memory.labelled:
        raise refuse(FeedbackOutcome.CONFLICT, f"completion {memory.entry_id!r} already has its label, kept in "
                      f"the feedback ledger (it {memory.how()})", "id", "label_exists")
    if memory is not None and (memory.deleted or memory.fate is not None):  # (or ended before this process)
        raise refuse(FeedbackOutcome.UNKNOWN, _deleted_message(memory.entry_id) if memory.deleted else
                      f"no training entry for completion {memory.entry_id!r}: it {memory.how()}, says the feedback "
                      "ledger", "id", "entry_not_found")


def _deleted_message(completion_id: str) -> str:
    return f"no training entry for completion {completion_id!r}: its data were deleted (DELETE /v1/feedback/{{id}} " \
        "or /v1/chat/completions/{id}), and a deleted completion takes no new label"


def _commit(to: _Labels, entry: CacheEntry, label, skip: bool = False) -> None:
    """Commits `label` to the ledger, then has the cache attach it; refuses as
    `_waiting_entry` does if the entry ended or was labelled since it was looked up, and
    with 503 if the ledger cannot be written (nothing is attached then)."""
    completion_id = entry.completion_id
    if to.ledger is not None:
        try:
            to.ledger.commit_label(completion_id, _label_record(to.request, label))
        except LabelExists:
            raise refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label", "id",
                          "label_exists") from None
        except LedgerUnavailable as exc:
            raise refuse(FeedbackOutcome.UNAVAILABLE, f"the label was not accepted: {exc}; nothing was changed, "
                          "send it again later", None, "ledger_unavailable") from None
    if not to.cache.attach_label(entry, label, skip):
        if to.ledger is not None:
            to.ledger.withdraw_label(completion_id)  # answered as refused: it must not train after a restart
        _waiting_entry(to.cache, completion_id)  # (not the ledger: it still holds the label just withdrawn)
        raise refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} already has its label", "id",
                      "label_exists")


def _label_record(request: FeedbackLabel, label) -> LabelRecord:
    """The ledger's row for a label: as sent, and as the trainer trains on it."""
    if isinstance(label, GroupRewards):
        return LabelRecord("rewards", request.source, rewards=list(label.rewards))
    served_side = request.chosen is None or request.rejected is None
    return LabelRecord("preference", request.source, request.chosen, request.rejected,
                       request.choice_index if served_side and request.chosen_index is None else None,
                       request.chosen_index, request.rejected_index, list(label.chosen), list(label.rejected),
                       dict(label.served_logps))


def _finished_responses(entry: CacheEntry, completion_id: str, what: str) -> dict[int, list[int]]:
    if not entry.response_finished:
        raise _still_generating(completion_id, what)
    return entry.responses


def _still_generating(completion_id: str, what: str = "its label") -> Refused:
    message = f"completion {completion_id!r} is still being generated; send {what} once it has finished"
    return refuse(FeedbackOutcome.CONFLICT, message, "id", "response_pending")


def _attach_rewards(to: _Labels, request: FeedbackLabel) -> FeedbackResult:
    completion_id, rewards = request.completion_id, request.rewards
    if rewards is None:
        raise refuse(FeedbackOutcome.INVALID, "this server trains on groups of samples (GRPO): send 'rewards', "
                      "one number per choice", "rewards", "missing_required_parameter")
    for name in ("chosen", "rejected", "chosen_index", "rejected_index"):
        if getattr(request, name) is not None:
            raise refuse(FeedbackOutcome.INVALID, f"'{name}' is for preference training; this server trains on "
                          "groups (GRPO): send only 'rewards'", name, "invalid_value")
    bad = [i for i, r in enumerate(rewards) if not math.isfinite(r)]
    if bad:
        raise refuse(FeedbackOutcome.INVALID, f"rewards must be finite numbers; rewards[{bad[0]}] is "
                      f"{rewards[bad[0]]}", "rewards", "invalid_value")
    entry = _waiting_entry(to.cache, completion_id, to.ledger, choice=None)
    if not isinstance(entry, GroupEntry):
        raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} is not a group",
                      "id", "not_a_group")
    responses = _finished_responses(entry, completion_id, "its rewards")
    if len(rewards) != len(responses):
        raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} has {len(responses)} choices; "
                      f"got {len(rewards)} rewards (one per choice, in choice order)", "rewards",
                      "invalid_value")
    skip = max(rewards) == min(rewards)
    _commit(to, entry, GroupRewards([float(r) for r in rewards]), skip)
    if skip:
        return FeedbackResult(FeedbackOutcome.ACCEPTED, "all rewards are equal: the group has no advantage "
                              "and is not trained", skipped=True)
    return ACCEPTED


def _attach_indices(to: _Labels, request: FeedbackLabel) -> None:
    """DPO between two served choices: both responses and their log-probs come from decoding."""
    completion_id, chosen, rejected = request.completion_id, request.chosen_index, request.rejected_index
    for name in (n for n in ("chosen", "rejected") if getattr(request, n) is not None):
        raise refuse(FeedbackOutcome.INVALID, f"'{name}' (a text) and 'chosen_index'/'rejected_index' (two served "
                      "choices) are two forms of a label; a text against choice i: 'choice_index': i", name,
                      "invalid_value")
    if chosen is None or rejected is None:
        missing = "chosen_index" if chosen is None else "rejected_index"
        raise refuse(FeedbackOutcome.INVALID, "give both 'chosen_index' and 'rejected_index'", missing,
                      "missing_required_parameter")
    entry = _waiting_entry(to.cache, completion_id, to.ledger, chosen)  # an unknown id: 404 before the pair's checks
    if chosen == rejected:
        raise refuse(FeedbackOutcome.INVALID, "'chosen_index' and 'rejected_index' are the same choice",
                      "rejected_index", "invalid_value")
    if not isinstance(entry, PreferenceEntry):
        raise refuse(FeedbackOutcome.INVALID, f"completion {completion_id!r} takes no preference label", "id",
                      "invalid_value")
    responses = _finished_responses(entry, completion_id, "its preference")
    for name, index in (("chosen_index", chosen), ("rejected_index", rejected)):
        if index not in responses:
            raise refuse(FeedbackOutcome.INVALID, f"{name} {index} does not exist; the completion has choices "
                          f"{sorted(responses)}", name, "invalid_value")
    if responses[chosen] == responses[rejected]:
        raise refuse(FeedbackOutcome.INVALID, f"choices {chosen} and {rejected} are the same response",
                      "rejected_index", "invalid_value")
    label = PreferenceLabel(list(responses[chosen]), list(responses[rejected]))
    for side, index in (("chosen", chosen), ("rejected", rejected)):
        if index in entry.served_logps:
            label.served_logps[side] = entry.served_logps[index]
    _commit(to, entry, label)


def _attach(to: _Labels, request: FeedbackLabel, responses: ResponseText, max_model_len: int) -> None:
    completion_id, chosen, rejected, choice_index = (request.completion_id, request.chosen, request.rejected,
                                                     request.choice_index)
    if chosen is None and rejected is None:
        raise refuse(FeedbackOutcome.INVALID, "give at least one of 'chosen' and 'rejected'; the other defaults "
                      "to the served response", "chosen", "missing_required_parameter")
    # the texts are tokenized first, with nothing locked: a large label stalls no one
    texts_ids = {name: responses.ids(text) for name, text in (("chosen", chosen), ("rejected", rejected))
                 if text is not None}
    entry = _waiting_entry(to.cache, completion_id, to.ledger, choice_index)
    served = None
    if entry.response_finished and choice_index not in entry.responses:  # (with both texts too)
        raise refuse(FeedbackOutcome.INVALID, f"choice_index {choice_index} does not exist; the completion has "
                      f"choices {sorted(entry.responses)}", "choice_index", "invalid_value")
    end = responses.end(entry.responses[choice_index] if entry.response_finished else None, entry.prompt_token_ids)
    texts_ids = {name: ids + end for name, ids in texts_ids.items()}
    if chosen is None or rejected is None:
        if not entry.response_finished:
            raise refuse(FeedbackOutcome.CONFLICT, f"completion {completion_id!r} is still being generated; "
                          "send both 'chosen' and 'rejected', or wait for it to finish", "id",
                          "response_pending")
        served = list(entry.responses[choice_index])
        if not served:
            raise refuse(FeedbackOutcome.INVALID, "the served response is empty; give both 'chosen' and "
                          "'rejected'", "id", "invalid_value")
    given, text = ("chosen", chosen) if rejected is None else ("rejected", rejected)
    if served is not None and text in (responses.text(served), entry.texts_read.get(choice_index)):
        raise refuse(FeedbackOutcome.INVALID, f"'{given}' is the served response, which is the other side when "
                      "only one is given: a pair of the same response teaches nothing; give both 'chosen' and "
                      "'rejected'", given, "invalid_value")
    chosen_ids = texts_ids.get("chosen", served)
    rejected_ids = texts_ids.get("rejected", served)
    if chosen_ids == rejected_ids:
        raise refuse(FeedbackOutcome.INVALID, "'chosen' and 'rejected' are the same response", "chosen",
                      "invalid_value")
    limit = max_model_len - len(entry.prompt_token_ids)
    for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
        if len(ids) > limit:
            raise refuse(FeedbackOutcome.INVALID, f"'{name}' is {len(ids)} tokens; at most {limit} fit after "
                          "the prompt", name, "context_length_exceeded")
    label = PreferenceLabel(chosen_ids, rejected_ids)
    if served is not None and choice_index in entry.served_logps:
        side = "rejected" if rejected is None else "chosen"
        label.served_logps[side] = entry.served_logps[choice_index]
    _commit(to, entry, label)
