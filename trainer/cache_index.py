"""The activation cache's entries by state, those holding a recording, and the answers
waiting for labels by deadline.

The serving path asks the cache something for every request it admits (is there room
for its recording, would it train too late to be worth recording) and the trainer at
every turn (is anything ready). A busy server keeps thousands of entries waiting for
labels — every answer waits up to the label timeout, most without their activations —
so those questions are answered from this index, in time that grows with the entries
holding recordings (bounded by the cache's bytes) or the few being trained, not with
the entries waiting; and the trainer's turn asks which labels are overdue, answered from
a heap by deadline. The cache (trainer/cache.py) keeps it under its lock. Beside it, the
requests still without an entry that feedback may name already (`ExpectedIds`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from typing import Iterator

from trainer.entries import TERMINAL, CacheEntry, EntryState


class EntryIndex:
    def __init__(self) -> None:
        # the entries in the cache, by state (a terminal state's entries have left it)
        self._by_state: dict[EntryState, dict[str, CacheEntry]] = {s: {} for s in EntryState if s not in TERMINAL}
        # entries admitted with a recording, oldest first; one whose recording was taken
        # off leaves at the next `recorded()` that meets it
        self._recorded: dict[str, CacheEntry] = {}
        # completion id -> when it was admitted (a counter): `in_state` lists by admission
        self._admitted: dict[str, int] = {}
        self._counter = itertools.count()
        # (label deadline, tie-break, completion id) of the answers waiting for labels,
        # soonest first; one labelled or ended since is skipped when its deadline comes up
        # (only its id stays until then), and the heap is rebuilt once such ids outnumber
        # the entries still waiting
        self._deadlines: list[tuple[float, int, str]] = []

    def add(self, entry: CacheEntry) -> None:
        """Files a newly admitted entry (the cache admits none that has ended)."""
        self._by_state[entry.state][entry.completion_id] = entry
        self._admitted[entry.completion_id] = next(self._counter)
        if entry.recording is not None:
            self._recorded[entry.completion_id] = entry

    def moved(self, entry: CacheEntry, previous: EntryState) -> None:
        """Files `entry` under the state the cache just gave it (from `previous`); an entry
        in a terminal state leaves the index, one that was not in it stays out."""
        indexed = self._pop(self._by_state.get(previous), entry)
        if entry.state in TERMINAL:
            self._pop(self._recorded, entry)
            if indexed:
                self._admitted.pop(entry.completion_id, None)
        elif indexed:
            self._by_state[entry.state][entry.completion_id] = entry

    def lost_recording(self, entry: CacheEntry) -> None:
        self._pop(self._recorded, entry)

    def count(self, state: EntryState) -> int:
        return len(self._by_state.get(state, ()))

    def in_state(self, state: EntryState) -> list[CacheEntry]:
        """The entries in `state`, oldest admitted first."""
        return sorted(self._by_state.get(state, {}).values(), key=lambda e: self._admitted[e.completion_id])

    def recorded(self) -> Iterator[CacheEntry]:
        """The entries holding a recording, oldest first."""
        for completion_id, entry in list(self._recorded.items()):
            if entry.recording is None:
                del self._recorded[completion_id]
            else:
                yield entry

    def awaits_label(self, entry: CacheEntry) -> None:
        """`entry` waits for its label until `entry.label_deadline`."""
        waiting = self._by_state[EntryState.WAITING_LABEL]
        if len(self._deadlines) > 2 * len(waiting) + 1024:
            self._deadlines = [(e.label_deadline, next(self._counter), cid) for cid, e in waiting.items()
                               if e.label_deadline is not None]
            heapq.heapify(self._deadlines)
        heapq.heappush(self._deadlines, (entry.label_deadline, next(self._counter), entry.completion_id))

    def past_deadline(self, now: float) -> list[CacheEntry]:
        """The entries still waiting for their labels whose deadline is before `now`,
        soonest first (they leave the heap; the caller ends them)."""
        overdue, waiting = [], self._by_state[EntryState.WAITING_LABEL]
        while self._deadlines and now > self._deadlines[0][0]:
            deadline, _, completion_id = heapq.heappop(self._deadlines)
            entry = waiting.get(completion_id)
            if entry is not None and entry.label_deadline == deadline:
                overdue.append(entry)
        return overdue

    @staticmethod
    def _pop(entries: dict[str, CacheEntry] | None, entry: CacheEntry) -> bool:
        if entries is None or entries.get(entry.completion_id) is not entry:
            return False
        del entries[entry.completion_id]
        return True


def lag_behind(ready_by_version: dict[int, int], running: list[CacheEntry], trained: int, serving: int,
               max_staleness: int, cohort_limit: int) -> int:
    """At least how many versions a recording stamped `serving` would be stale when trained,
    the optimizer at `trained`: behind the running job `running` when it has no room left
    for it, and the labelled recordings still usable (`ready_by_version`: how many of each
    version), as `ActivationCache.take_ready` orders them — oldest version first, one
    version per step, up to `cohort_limit` entries each; a version's rest goes stale when
    its window closes and waits behind every usable recording. Where it could go either
    way, the lesser: a recording is kept."""
    counts = dict(ready_by_version)
    own = counts.pop(serving, 0) + sum(e.adapter_version == serving and e.recording is not None for e in running)
    steps = int(len(running) >= cohort_limit and not any(e.adapter_version == serving for e in running))
    for version in sorted(v for v in counts if v < serving):
        window = max(0, max_staleness - (trained - version) - steps + 1)
        steps += min(-(-counts[version] // cohort_limit), window)
    return trained + steps + own // cohort_limit - serving


class ExpectedIds:
    """The trainable requests in flight without a cache entry yet (queued, prefilling, or
    unrecorded until they finish): feedback for one is answered as pending, not unknown.
    Thread-safe; bounded (an id the engine never finished, after a failure, is forgotten)."""

    LIMIT = 10_000

    def __init__(self) -> None:
        self._ids: OrderedDict[str, None] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, completion_id: str) -> None:
        with self._lock:
            self._ids[completion_id] = None
            while len(self._ids) > self.LIMIT:
                self._ids.popitem(last=False)

    def discard(self, completion_id: str) -> None:
        with self._lock:
            self._ids.pop(completion_id, None)

    def __contains__(self, completion_id: str) -> bool:
        with self._lock:
            return completion_id in self._ids

    def holds_any(self, matches) -> bool:
        """Whether an id in flight satisfies `matches` (a completion's own, or its prompts')."""
        with self._lock:
            return any(matches(completion_id) for completion_id in self._ids)
