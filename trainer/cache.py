"""The activation cache: recorded requests waiting to be trained on.

Entries are keyed by completion id and move through
    waiting_label -> ready -> training -> trained
or end as expired (no label within the label timeout, paper §4.4), evicted (the cache
was full and the policy chose it), or dropped (stale with stale_policy=drop, a request its
client left, a failed job). The cache is bounded in bytes of recorded activations; when
a new recording does not fit, the full policy decides which activations go:
  - `drop_new` (the paper's): the old entries keep theirs, the new one is not kept;
  - `evict_oldest`: the oldest entries not being trained give way;
  - `unlabelled_give_way`: the oldest recordings still waiting for a label give way;
    labelled ones keep theirs until trained (most labels come soon after the answer, so
    a fresh recording is likelier to be trained on than one that has waited unlabelled).
One waiting for a label never loses its tokens for want of room: it stays as a label entry. States in entries.py.
Thread-safe; every ending goes to the ledger too; requests in flight without an entry are `expected` (cache_index.py).

The cache alone moves an entry from state to state: every transition is one of its methods
(`add`, `hold`, `attach_label`, `take_ready`, `requeue`, `end`, `drop_unlabelled`, `expire`);
nobody else assigns `entry.state`. It keeps its entries indexed by state, by whether they
hold a recording and by label deadline (trainer/cache_index.py), so that what serving asks
per request and the trainer per slice does not grow with the entries waiting for labels.
Its lock is its own, held only around its own bookkeeping.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque

from engine.recording import RecordedPrefill
from trainer.cache_index import EntryIndex, ExpectedIds, lag_behind
from trainer.entries import TERMINAL, CacheEntry, EntryState, FateJournal

logger = logging.getLogger(__name__)

# what gives way when a new recording does not fit (see the module docstring)
FULL_POLICIES = ("drop_new", "evict_oldest", "unlabelled_give_way")
# the latest recordings whose times are kept (a pause is measured against their gaps: trainer/maintenance.py)
RECENT_RECORDINGS = 17


class ActivationCache:
    def __init__(self, budget_bytes: int, full_policy: str = "drop_new", label_timeout_s: float = 300.0,
                 clock=time.monotonic, max_label_entries: int = 10_000, journal: FateJournal | None = None):
        """`max_label_entries`: entries without activations (labels that train by
        recomputation) kept at most; past it a new one is refused, counted and logged;
        `journal`: told how every entry ends (the feedback ledger)."""
        self.journal = journal
        self.budget_bytes = budget_bytes
        self.max_label_entries = max_label_entries
        self.refused_label_entries = 0  # label entries refused at the bound
        self.full_policy = full_policy
        self.label_timeout_s = label_timeout_s
        self.clock = clock
        self._entries: OrderedDict[str, CacheEntry] = OrderedDict()
        # the same entries by state, and those holding a recording (under the lock)
        self._index = EntryIndex()
        # recently ended entries (id -> final state), so feedback can tell "trained" from "unknown"
        self._ended: OrderedDict[str, EntryState] = OrderedDict()
        self.deleted_ids: set[str] = set()  # of those, the deleted (a membership test needs no lock)
        self.expected = ExpectedIds()
        self._lock = threading.RLock()
        self.bytes = 0
        # how entries ended, by state
        self.ended_counts: dict[str, int] = {s.value: 0 for s in TERMINAL}
        # bytes of activations released so far (entries that ended), for memory trimming
        self.released_bytes = 0
        # when the latest entries holding a recording were added (clock times; -inf: never)
        self.recorded_at: deque[float] = deque([float("-inf")], maxlen=RECENT_RECORDINGS)
        # recordings taken off their entries under the lock, freed with it dropped, on the device thread
        self._detached: list[RecordedPrefill] = []

    def __len__(self) -> int:
        return len(self._entries)

    def entries(self) -> list[CacheEntry]:
        with self._lock:
            return list(self._entries.values())

    def get(self, completion_id: str) -> CacheEntry | None:
        with self._lock:
            return self._entries.get(completion_id)

    def ended_state(self, completion_id: str) -> EntryState | None:
        with self._lock:
            return self._ended.get(completion_id)

    def has_room_for(self, nbytes: int) -> bool:
        """Whether a new recording of `nbytes` would be kept, as the full policy decides."""
        with self._lock:
            return self._fits(nbytes)

    def _fits(self, nbytes: int) -> bool:
        """Whether `nbytes` fit once the entries that would give way have given theirs."""
        return self.bytes - sum(e.nbytes for e in self._giving_way()) + nbytes <= self.budget_bytes

    def _giving_way(self) -> list[CacheEntry]:
        """The entries whose activations give way to a new recording, in that order."""
        if self.full_policy == "drop_new":
            return []
        return [e for e in self._index.recorded() if e.state is not EntryState.TRAINING
                and (self.full_policy == "evict_oldest" or e.state is EntryState.WAITING_LABEL)]

    def _make_room(self, nbytes: int) -> bool:
        """Frees room for a new recording as the full policy says; False if it cannot fit."""
        if not self._fits(nbytes):
            return False
        for victim in self._giving_way():
            if self.bytes + nbytes <= self.budget_bytes:
                break
            if victim.needs_label:
                self._strip(victim)  # its label may still come: it keeps its tokens
            else:
                self._end(victim, EntryState.EVICTED)
        return True

    @property
    def label_entries(self) -> int:
        """Entries without activations (they train by recomputation)."""
        with self._lock:
            return len(self._entries) - sum(1 for _ in self._index.recorded())

    def add(self, entry: CacheEntry, owed: bool = False) -> bool:
        """Admits an entry, applying the full-cache policy to its activations; False if dropped. One that waits
        for a label stays without activations (a label entry), up to `max_label_entries`; past it too when
        `owed` (a restart's labels answered 200, and its CPT requests the cache held: training owed)."""
        with self._lock:
            if self._entries.get(entry.completion_id) is entry or entry.state in TERMINAL:
                logger.error("entry %r added again (%s)", entry.completion_id, entry.state.value)  # a bug upstream
                admitted = entry.state not in TERMINAL  # it stays as it is
            elif entry.recording is not None and not self._make_room(entry.nbytes) and not self._no_room(entry):
                admitted = False
            elif entry.recording is None and not owed and self.label_entries >= self.max_label_entries:
                self.refused_label_entries += 1
                logger.warning("label entry for %r refused: %d entries without activations are waiting (the "
                               "bound, train.max_label_entries)", entry.completion_id, self.max_label_entries)
                self._end(entry, EntryState.DROPPED, reason="max_label_entries")
                admitted = False
            else:
                previous = self._entries.get(entry.completion_id)
                if previous is not None:  # a bug upstream; keep the byte accounting right and say so
                    logger.error("completion %r was recorded twice; dropping the older entry", entry.completion_id)
                    self._end(previous, EntryState.DROPPED)
                self._entries[entry.completion_id] = entry
                self._index.add(entry)
                if entry.needs_label:
                    self._hold(entry)
                self.bytes += entry.nbytes
                if entry.recording is not None:
                    self.recorded_at.append(self.clock())
                admitted = True
        self._free_detached()
        return admitted

    def _no_room(self, entry: CacheEntry) -> bool:
        """A new recording does not fit: dropped (False), or, waiting for a label, kept without its activations."""
        if not entry.needs_label:
            self._detach(entry)
            if self.journal is not None:
                self.journal.record_fate(entry.completion_id, EntryState.DROPPED.value, reason="cache_full")
            return False
        self._strip(entry)
        return True

    def free_activations(self, entry: CacheEntry) -> None:
        """An entry whose gradient is computed gives its activations' room back at once (its step still to come)."""
        with self._lock:
            self._strip(entry)
        self._free_detached()

    def _strip(self, entry: CacheEntry) -> None:
        """Frees an entry's activations; it stays, to train by recomputation."""
        if entry.completion_id in self._entries:
            self.bytes -= entry.nbytes
            self.released_bytes += entry.nbytes
        entry.nbytes = 0
        self._detach(entry)

    def _detach(self, entry: CacheEntry) -> None:
        """Takes an entry's recording off it (under the lock); `_free_detached` frees it."""
        if entry.recording is not None:
            self._detached.append(entry.recording)
            entry.recording = None
            self._index.lost_recording(entry)

    def _free_detached(self) -> None:
        """Frees the recordings taken off their entries, with the lock dropped (device thread)."""
        with self._lock:
            recordings, self._detached = self._detached, []
        for recording in recordings:
            recording.release()

    def note_ended(self, completion_id: str, state: EntryState | None, deleted=False, counted=False) -> None:
        """A request that can never get an entry (NOT_TRAINABLE, NOT_A_GROUP; EXPIRED or DROPPED as a restart finds it,
        or cut short before it had one: `counted`), or one whose data were `deleted`: its feedback says why."""
        with self._lock:
            if completion_id not in self._entries and state is not None:
                self._remember(completion_id, state)
                if counted:
                    self.ended_counts[state.value] += 1
            if deleted and (completion_id in self._entries or completion_id in self._ended):
                self.deleted_ids.add(completion_id)

    def _remember(self, completion_id: str, state: EntryState) -> None:
        """How a completion's entry ended (or why it never had one), for its feedback."""
        self._ended[completion_id] = state
        while len(self._ended) > 10_000:
            self.deleted_ids.discard(self._ended.popitem(last=False)[0])

    def hold(self, entry: CacheEntry) -> None:
        """Keeps a ready entry out of training until `attach_label`, as an entry that
        needs a label is held from its admission (a custom method may hold any entry)."""
        with self._lock:
            self._hold(entry)

    def _move(self, entry: CacheEntry, state: EntryState) -> None:
        previous, entry.state = entry.state, state
        self._index.moved(entry, previous)

    def _hold(self, entry: CacheEntry) -> None:
        if entry.state is EntryState.READY:
            entry.held = True
            self._move(entry, EntryState.WAITING_LABEL)

    def attach_label(self, entry: CacheEntry, label, skip: bool = False) -> bool:
        """Attaches `label` to an entry still waiting for one; the entry becomes ready for
        training, or (`skip`: the label gives no gradient) ends as skipped. False if the
        entry has ended or already has its label (another label won the race)."""
        with self._lock:
            if self._entries.get(entry.completion_id) is not entry or entry.state is not EntryState.WAITING_LABEL \
                    or getattr(entry, "label", None) is not None:
                return False
            if label is not None:
                entry.label = label
            if skip:
                self._end(entry, EntryState.SKIPPED)  # its recording is freed by the device thread
            else:
                self._move(entry, EntryState.READY)
            return True

    def drop_unlabelled(self, entry: CacheEntry) -> None:
        """Ends an entry whose label can never come (its reward function failed); off the
        device thread, so its recording is freed at the device thread's next call."""
        with self._lock:
            if entry.state is EntryState.WAITING_LABEL:
                self._end(entry, EntryState.DROPPED, reason="reward_function_failed")

    def end(self, entry: CacheEntry, state: EntryState, version: int | None = None, path: str | None = None,
            reason: str | None = None) -> None:
        """Removes an entry for good and frees its activations (device thread: freeing a
        graph is tensor work, DESIGN.md invariant). A trained entry says into which
        adapter `version` and by which `path`."""
        with self._lock:
            self._end(entry, state, version, path, reason)
        self._free_detached()

    def withdraw(self, completion_id: str, held: tuple[int | None, str | None] | None = None) -> bool:
        """Ends a deleted completion's entry, or (`held`: version, path) one whose label the weights a rollback
        restored hold already, as trained into it; never one being trained (any thread). Whether it ended."""
        with self._lock:
            entry = self._entries.get(completion_id)
            if entry is None or entry.state is EntryState.TRAINING:
                return False
            if held is not None:
                self._end(entry, EntryState.TRAINED, *held)
                return True
            self._end(entry, EntryState.DROPPED, reason="deleted")
            self.deleted_ids.add(completion_id)
            return True

    def _end(self, entry: CacheEntry, state: EntryState, version: int | None = None, path: str | None = None,
             reason: str | None = None) -> None:
        if self._entries.pop(entry.completion_id, None) is not None:
            self.bytes -= entry.nbytes
            self.released_bytes += entry.nbytes
        self._move(entry, state)
        self._detach(entry)
        self.ended_counts[state.value] += 1
        self._remember(entry.completion_id, state)
        if self.journal is not None:
            self.journal.record_fate(entry.completion_id, state.value, version, path, reason)

    def has_pending_release(self) -> bool:
        """Recordings of entries ended off the device thread wait to be freed."""
        return bool(self._detached)

    def response_finished(self, completion_id: str, responses: dict[int, list[int]], aborted: bool,
                          served_logps: dict[int, float] | None = None,
                          served_token_logps: dict[int, list[float]] | None = None,
                          label_deadline: float | None = None,
                          logprob_temperature: float | None = None) -> CacheEntry | None:
        """Completes an entry with its served responses and their log-probs (taken at
        `logprob_temperature`; None: the entry's own); the entry, if it still waits for its
        label (until `label_deadline`, clock time; default: the label timeout from now)."""
        waiting = None
        with self._lock:
            entry = self._entries.get(completion_id)
            if entry is None:
                return None
            entry.responses = responses
            entry.served_logps = served_logps or {}
            entry.served_token_logps = served_token_logps or {}
            if logprob_temperature is not None:
                entry.logprob_temperature = logprob_temperature
            entry.response_finished = True
            # cut short by its client: no whole response to prefer or reject; a CPT prompt, a retry sends
            # again. A label that came before the end (both texts: READY, once held) keeps its entry.
            if aborted and (entry.state is EntryState.WAITING_LABEL and entry.needs_label
                            or entry.state is EntryState.READY and not entry.held):
                self._end(entry, EntryState.DROPPED, reason="aborted")
            elif entry.needs_label:
                if entry.state is EntryState.WAITING_LABEL:
                    entry.label_deadline = (self.clock() + self.label_timeout_s if label_deadline is None
                                            else label_deadline)
                    self._index.awaits_label(entry)
                    waiting = entry
        self._free_detached()
        return waiting

    def expire(self) -> list[CacheEntry]:
        """Ends entries whose label did not arrive in time, and frees the recordings of
        entries ended off the device thread (device thread)."""
        now = self.clock()
        with self._lock:
            expired = self._index.past_deadline(now)
            for entry in expired:
                self._end(entry, EntryState.EXPIRED)
        self._free_detached()
        return expired

    def take_ready(self, limit: int, version: int | None = None, max_staleness: int = 0,
                   cohort_limit: int | None = None, recorded_only: bool = False) -> list[CacheEntry]:
        """The entries of the next optimizer step (at most `limit`), marked as training.

        Without `version`: the oldest ready entries. With it (the current adapter
        version), entries whose recording can still be trained on — recorded at most
        `max_staleness` versions before `version` — come first, one version per step:
        the oldest such version, since its recordings are the next to go stale (training
        the current version first would push them past the bound, to recomputation).
        Entries of one version (a cohort) share one step, up to `cohort_limit` (default
        `limit`), so none of them goes stale waiting for another's. Only when no
        recording is usable, the oldest entries that train by recomputation, up to
        `limit` (they do not go staler: they are computed at the current version) —
        unless `recorded_only` (entries joining a cohort's step)."""
        with self._lock:
            ready = self._index.in_state(EntryState.READY)
            if version is not None:
                usable = [e for e in ready if e.recording is not None
                          and 0 <= version - e.adapter_version <= max_staleness]
                if usable:
                    oldest = min(e.adapter_version for e in usable)
                    ready = [e for e in usable if e.adapter_version == oldest]
                    limit = cohort_limit or limit
                elif recorded_only:
                    return []
            taken = ready[:limit]
            for entry in taken:
                self._move(entry, EntryState.TRAINING)
            return taken

    def release_stale(self, version: int, max_staleness: int = 0) -> None:
        """Drops the recordings of waiting entries recorded more than `max_staleness`
        adapter versions before `version` (or after it: a rollback): they are never
        back-propagated (they take the recompute path or are dropped when their turn
        comes), so their memory is freed now rather than then."""
        with self._lock:
            for entry in list(self._index.recorded()):
                lag = version - entry.adapter_version
                if not 0 <= lag <= max_staleness and entry.state is not EntryState.TRAINING:
                    self._strip(entry)
        self._free_detached()

    def recorded_versions(self) -> set[int]:
        """The adapter versions of the recordings waiting to be trained."""
        with self._lock:
            return {e.adapter_version for e in self._index.recorded() if e.state is not EntryState.TRAINING}

    def requeue(self, entry: CacheEntry) -> None:
        """Puts an entry of an abandoned job back in line (it is retrained later)."""
        with self._lock:
            if entry.completion_id in self._entries and entry.state is EntryState.TRAINING:
                self._move(entry, EntryState.READY)

    def lag_of_next_recording(self, trained: int, serving: int, max_staleness: int, cohort_limit: int) -> int:
        """At least how many versions a recording made now (stamped `serving`) would be
        stale when trained, the optimizer at `trained` (`cache_index.lag_behind`)."""
        with self._lock:
            running = self._index.in_state(EntryState.TRAINING)
            counts: dict[int, int] = {}
            for e in self._index.recorded():
                if e.state is EntryState.READY and 0 <= trained - e.adapter_version <= max_staleness:
                    counts[e.adapter_version] = counts.get(e.adapter_version, 0) + 1
        return lag_behind(counts, running, trained, serving, max_staleness, cohort_limit)

    def count(self, state: EntryState) -> int:
        with self._lock:
            return self._index.count(state)
