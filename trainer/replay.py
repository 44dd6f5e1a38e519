"""What a restart takes back from the feedback ledger (trainer/ledger.py), before serving.

Activations die with the process; labels do not. A label counts as trained only once a
saved adapter version includes it, so on start, for the training method the server runs:
  - every label not trained into a version up to the one resumed from (never trained, or
    trained into a version that was not saved before the crash) becomes a ready entry
    again, without activations: it trains by recomputation, at the resumed version (CPT,
    which needs no label, takes its requests back the same way, but those its client left);
  - every request served within the label timeout that is still without a label becomes
    an entry waiting for one again, until the same deadline it had (a reward function,
    if one is set, scores its group again);
  - requests that can no longer take a label (their timeout passed while the server was
    down, they were cut short by the crash, or their label was deleted while it trained
    into a version the crash lost) get that fate written.

A label trained into a version that was not saved is marked untrained again at once: no
weights hold it (the saved ones resume under a number after the lost versions, whose
lineage skips them: AdapterLifecycle.resume), and a later crash before it has trained
must not lose it. The
bound on entries without activations (`train.max_label_entries`)
never refuses what is taken back: labels answered 200, CPT requests the cache held.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable

from trainer.cache import ActivationCache
from trainer.entries import CacheEntry, EntryState, GroupEntry, GroupRewards, PreferenceLabel
from trainer.ledger import Ledger
from trainer.ledger_db import LedgerRow, read_ledger
from trainer.methods import TrainingMethod
from trainer.rewards import RewardScorer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReplayCounts:
    # labels (or CPT requests) to train again
    to_train: int = 0
    # requests that still take a label
    awaiting_label: int = 0
    # requests whose label can no longer come
    closed: int = 0


def replay_ledger(ledger: Ledger, method: TrainingMethod, cache: ActivationCache, version: int,
                  saved_version: int | None, label_timeout_s: float,
                  rewards: RewardScorer | None = None, owns: Callable[[str], bool] | None = None
                  ) -> ReplayCounts:
    """Puts the ledger's unfinished business back into `cache` (see the module
    docstring); `version`: the adapter version training resumes at, `saved_version`: the
    saved version it was restored from (None: none was); `owns`: which completions are
    this replica's (data-parallel replicas share a node's ledger; None: all)."""
    saved = -1 if saved_version is None else saved_version
    ledger.flush()  # the fates a restart applied again (a rollback's, resumed) before they are read
    rows = read_ledger(ledger.path, "r.fate IS NULL OR (r.fate = 'trained' AND r.fate_version > ?)", (saved,))
    if owns is not None:
        rows = [row for row in rows if owns(row.request.id)]
    lost = [row.request.id for row in rows if row.fate == "trained"]
    if lost:  # trained into versions that died unsaved (in any mode): untrained again, before a later version is saved
        ledger.reopen(lost)
    _tell_of_other_methods([row for row in rows if row.request.method != method.name and row.label is not None],
                           method)
    rows = [row for row in rows if row.request.method == method.name]
    now_wall, now_clock = time.time(), cache.clock()
    to_train = awaiting = closed = 0
    for row in rows:
        entry = _entry(method, row, version)
        if row.label is None and row.fate == "trained" and entry.needs_label:
            # its label was deleted while it trained, into a version the crash lost: it takes no new one
            ledger.record_fate(row.request.id, EntryState.DROPPED.value, reason="deleted")
            cache.note_ended(row.request.id, EntryState.DROPPED, deleted=True)
            closed += 1
            continue
        if row.label is not None:
            if _labelled(cache, entry, row):
                to_train += 1
            else:
                closed += 1
            continue
        # a CPT prompt its client left is not trained on, as online (a retry sends it again); one whose end
        # the ledger missed is, as it may have been answered (its answer waits for that commit at most 1 s)
        if not entry.needs_label and not row.aborted:
            cache.add(entry, owed=True)
            to_train += 1
            continue
        deadline = None if row.finished_at is None else row.finished_at + label_timeout_s
        if row.aborted or deadline is None or deadline <= now_wall:
            reason = "interrupted" if row.finished_at is None else "aborted" if row.aborted else None
            state = EntryState.EXPIRED if reason is None else EntryState.DROPPED
            ledger.record_fate(row.request.id, state.value, reason=reason)
            cache.note_ended(row.request.id, state)  # its feedback says why
            closed += 1
            continue
        cache.add(entry)
        waiting = cache.response_finished(row.request.id, entry.responses, False, entry.served_logps,
                                          entry.served_token_logps, now_clock + deadline - now_wall)
        if rewards is not None and isinstance(waiting, GroupEntry):
            rewards.score(waiting, row.request.prompt, [c.text for c in row.choices])
        awaiting += 1
    counts = ReplayCounts(to_train, awaiting, closed)
    ledger.flush()
    if rows:
        logger.info("feedback ledger: %d labels to train again (after saved version %s), %d requests still take "
                    "feedback, %d can no longer", to_train, saved_version, awaiting, closed)
    return counts


def _tell_of_other_methods(rows: list[LedgerRow], method: TrainingMethod) -> None:
    """Labels of another training method wait in the ledger, untrained: this mode cannot
    train them, and they wait for a start in theirs."""
    if not rows:
        return
    counts = Counter(row.request.method for row in rows)
    logger.warning("feedback ledger: labels of another training method wait to be trained (%s); the server trains "
                   "%s, so they wait until it is started in their mode again",
                   ", ".join(f"{name}: {n}" for name, n in sorted(counts.items())), method.name)


def _entry(method: TrainingMethod, row: LedgerRow, version: int) -> CacheEntry:
    """The row's entry without activations, at the version it will be recomputed at."""
    entry = method.make_label_entry(row.request.id, row.request.prompt_token_ids, version)
    for choice in row.choices:
        entry.responses[choice.index] = list(choice.token_ids)
        if choice.token_logprobs is not None:
            entry.served_token_logps[choice.index] = list(choice.token_logprobs)
            entry.served_logps[choice.index] = sum(choice.token_logprobs)
            entry.logprob_temperature = choice.logprob_temperature or 1.0
    return entry


def _labelled(cache: ActivationCache, entry: CacheEntry, row: LedgerRow) -> bool:
    """Adds `entry` with its label attached (ready to train); False if the label does not
    fit the method (the server was restarted in another mode)."""
    label = row.label
    if label.kind == "rewards" and isinstance(entry, GroupEntry) and label.rewards is not None:
        attached = GroupRewards(list(label.rewards))
    elif label.kind == "preference" and label.chosen_token_ids is not None and hasattr(entry, "label") \
            and not isinstance(entry, GroupEntry):
        attached = PreferenceLabel(list(label.chosen_token_ids), list(label.rejected_token_ids),
                                   dict(label.served_logps))
    else:
        return False
    if not cache.add(entry, owed=True):
        return False
    cache.response_finished(row.request.id, entry.responses, False, entry.served_logps, entry.served_token_logps)
    return cache.attach_label(entry, attached)
