"""The feedback ledger: every request that can receive feedback, its label and its fate,
in an embedded SQLite database in the adapter directory (`DIR/ledger.sqlite3`), so that a
label answered 200 survives `kill -9`, and what was collected can be read out
(trainer/export.py, `alchemist feedback export`). The schema and the rows are in trainer/ledger_db.py.

    requests  one row per request that got a cache entry: when and by which version it was served, its prompt
              (as written and as tokens), each choice's tokens, text and served log-probs, then its fate and when
    labels    at most one per request: a preference or a group's rewards, from the API or the reward function

Writes run on a thread of their own, one transaction per drain of its queue. A request's
rows and fates are queued (the device thread must not wait for a disk); its answer waits
for them on the event loop (`record_finished`), so a label finds it after a crash. A
label is acknowledged only once its transaction has committed: `commit_label` blocks its
caller (a worker thread) until then, and raises `LedgerUnavailable` if the database cannot
be written (disk full, locked, read-only) — nothing committed before is touched.

The file is its owner's alone (mode 0600, and its WAL). Retention is bounded by age and
by size, oldest first, on the writer thread; labels still to be trained, or trained into
a version not saved yet, are never pruned (trainer/ledger_retention.py). The file never
grows past `max_bytes`: a write that would fails as a full disk does.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import sqlite3
import threading
import time
from pathlib import Path

from trainer import ledger_lineage, ledger_retention
from trainer.config import LedgerConfig
from trainer.ledger_db import (FINISH_REQUEST, INSERT_REQUEST, ChoiceRecord, Deletion, LabelRecord, LedgerStats,
                               RequestRecord, delete_rows, to_json)
from trainer.ledger_file import open_database
from trainer.ledger_write import QueuedWrite, RefusalCount, RetryBacklog, is_full
from trainer.log_throttle import Throttle

logger = logging.getLogger(__name__)

# how long a label waits for its commit before feedback gives up (503)
COMMIT_TIMEOUT_S = 10.0
# how often the writer applies retention
PRUNE_EVERY_S = 60.0
# retention prunes to this share of max_bytes, so that it does not run on every write
PRUNE_TO = 0.9


class LedgerUnavailable(Exception):
    """The ledger cannot be written now (disk full, locked, read-only, closed)."""


class LabelExists(Exception):
    """The request already has a label in the ledger."""


class Ledger:
    def __init__(self, path: str | Path, config: LedgerConfig = LedgerConfig(), clock=time.time):
        self.path = Path(path)
        self.config = config
        self.clock = clock
        self.stats = LedgerStats()
        self._conn = open_database(self.path, config.max_bytes)
        self._queue: queue.Queue[QueuedWrite | None] = queue.Queue()
        # writes that failed for want of room or a lock: retried before the next ones
        self._retry = RetryBacklog()
        self._last_error: sqlite3.Error | None = None
        self._refusals = RefusalCount(self.stats)
        self._retention_failing, self._last_prune = Throttle(), float("-inf")
        self._room_may_change = True  # a write landed since retention last ran (when full, it runs again only then)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="alchemist-ledger", daemon=True)
        self._thread.start()

    # -- writes (queued; only labels wait) ---------------------------------------------

    def record_request(self, record: RequestRecord) -> None:
        """A request got a cache entry (device thread: queued, not waited for)."""
        self._put(QueuedWrite(lambda c: c.execute(INSERT_REQUEST, record.values()),  # encoded on the writer thread
                              request_id=record.id, inserts_row=True))

    def record_finished(self, request_id: str, choices: list[ChoiceRecord], aborted: bool):
        """A request's responses, when it finished (device thread: queued). Returns a future
        done once they are committed (with the request's row, queued before), for the answer
        to wait for, or once it fails (then retried unwaited); None while writes fail."""
        finished_at, written = self.clock(), concurrent.futures.Future()
        failing = self._closed or bool(self._retry)  # (before the put: the writer empties it as it takes a batch)
        self._put(QueuedWrite(lambda c: c.execute(FINISH_REQUEST, (
            finished_at, to_json([choice.as_row() for choice in choices]), int(aborted), request_id)),
            tried=lambda: written.done() or written.set_result(None), request_id=request_id))
        return None if failing else written

    def record_fate(self, request_id: str, fate: str, version: int | None = None, path: str | None = None,
                    reason: str | None = None) -> None:
        """How a request's entry ended (queued; called under the cache's lock)."""
        at = self.clock()
        self._put(QueuedWrite(lambda c: ledger_lineage.record_fate(c, request_id, fate, version, path, reason, at),
                              owed=True, request_id=request_id))

    def commit_label(self, request_id: str, label: LabelRecord, timeout_s: float = COMMIT_TIMEOUT_S) -> None:
        """Writes a label and returns once it is committed (call on a worker thread).
        LabelExists if the request has one; LedgerUnavailable if it cannot be written."""
        created = self.clock()

        def apply(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO labels (request_id, created_at, source, kind, chosen, rejected, choice_index, "
                "chosen_index, rejected_index, chosen_token_ids, rejected_token_ids, served_logps, rewards) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (request_id, created, label.source, label.kind, label.chosen, label.rejected, label.choice_index,
                 label.chosen_index, label.rejected_index, to_json(label.chosen_token_ids),
                 to_json(label.rejected_token_ids), to_json(label.served_logps), to_json(label.rewards)))

        self._wait(QueuedWrite(apply, concurrent.futures.Future(), request_id=request_id), timeout_s)

    def quarantine(self, request_ids: list[str], reason: str, version: int, promoted: int) -> None:
        """The eval gate rejected the version these requests' labels trained into, and made
        `version` a copy of the `promoted` one (queued); a label deleted since is dropped
        instead, for good."""
        at = self.clock()
        marks = ",".join("?" * len(request_ids))

        def apply(c: sqlite3.Connection) -> None:
            ledger_lineage.record_parent(c, version, promoted)
            ledger_lineage.quarantine(c, f"id IN ({marks})", tuple(request_ids), reason, at)

        self._put(QueuedWrite(apply, owed=True))

    def version_named(self, version: int) -> None:
        """Adapter version `version` was given to weights (a rollback's, saved or not): a
        restart gives its number to no other weights (waits until tried)."""
        self._put(QueuedWrite(lambda c: ledger_lineage.named(c, version), owed=True))
        self.flush()

    def rolled_back(self, restored: int, version: int) -> None:
        """A rollback made `version` a copy of saved version `restored` (queued): what
        trained into versions it undid is quarantined, what an earlier rollback quarantined
        and `restored` holds is trained again (trainer/ledger_lineage.py). Bounded above by
        `version`, so that a replica applying the same rollback later does not touch what
        another trained after it."""
        at = self.clock()
        quarantined = [0]

        def apply(c: sqlite3.Connection) -> None:
            quarantined[0] = ledger_lineage.restore(c, restored, version, at)

        def committed() -> None:
            self.stats.rollback_quarantined += quarantined[0]

        self._put(QueuedWrite(apply, committed=committed, owed=True))

    def reopen(self, request_ids: list[str]) -> None:
        """These requests' labels trained into versions a crash lost before they were saved: in
        no weights until trained again; no later saved version may pass for one holding them (queued)."""
        for start in range(0, len(request_ids), 500):
            chunk = request_ids[start:start + 500]
            self._put(QueuedWrite(lambda c, chunk=chunk: ledger_lineage.reopen(c, chunk), owed=True))

    # -- the adapter's saves (AdapterCheckpointer's SaveJournal, in the process that saves versions) --

    def resumed(self, saved: int, version: int, saving: bool = True) -> None:
        """Training resumed saved version `saved` as `version` (before serving, after the
        saved rollbacks' fates are applied again): the versions after `saved` died unsaved,
        and the fates follow `saved`'s weights (trainer/ledger_lineage.py); `saving`: this
        is the process that saves versions, and `saved` is on disk (queued)."""
        at = self.clock()

        def apply(c: sqlite3.Connection) -> None:
            ledger_lineage.forget_after(c, saved)
            quarantined = ledger_lineage.resumed_as(c, saved, version, at)
            if quarantined:
                logger.warning("feedback ledger: %d labels the lost versions' rollbacks had given back are in no "
                               "weights that survived: quarantined (`alchemist feedback release` trains them again)",
                               quarantined)
            if saving:
                ledger_retention.record_saved(c, saved)

        self._put(QueuedWrite(apply, owed=True))

    def before_save(self, snapshot=None) -> None:
        """Before a version is saved (the checkpointer's writer thread): the fates it trained
        are on disk first, or LedgerUnavailable fails the save."""
        self.flush(strict=True)

    def when_written(self, callback) -> None:
        """Calls `callback` on the writer thread once every owed write queued before now has committed (queued)."""
        marker = QueuedWrite(lambda c: None)
        marker.committed = lambda: self._retry.keep(marker) if self._retry.owed_waiting() else callback()
        self._put(marker)

    def saved(self, version: int) -> None:
        """Version `version` is on disk: the labels it holds may go by retention (queued)."""
        self._put(QueuedWrite(lambda c: ledger_retention.record_saved(c, version)))

    def withdraw_label(self, request_id: str) -> None:
        """Removes a label whose entry ended before it could be attached (queued)."""
        self._put(QueuedWrite(lambda c: c.execute("DELETE FROM labels WHERE request_id = ?", (request_id,)),
                              request_id=request_id))

    def delete(self, request_id: str, label_only: bool = False) -> Deletion:
        """Deletes a request (with its label), or only its label, and those of its prompts
        (`<request_id>-<i>`) where it is a completion of several prompts: whether there was
        one, and which of its labels had trained (blocks until committed; LedgerUnavailable)."""
        found, at = [], self.clock()
        self._wait(QueuedWrite(lambda c: found.append(delete_rows(c, request_id, label_only, at)),
                               concurrent.futures.Future(), request_id=request_id, with_prompts=True), COMMIT_TIMEOUT_S)
        return found[-1]  # (the last try's: a failed batch's writes are tried again alone)

    def _wait(self, write: QueuedWrite, timeout_s: float) -> None:
        """Queues `write` and waits for its commit. A write not begun within `timeout_s`
        is withdrawn (LedgerUnavailable: nothing changed); one being committed is waited
        for, so the caller never hears "refused" of a write that lands."""
        self._put(write)
        try:
            write.done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            if write.done.cancel():
                if write.request_id is not None:  # (not a flush's; the writer is stuck meanwhile)
                    self._refusals.add("the feedback ledger does not commit")
                raise LedgerUnavailable(f"the feedback ledger did not commit within {timeout_s:g} s") from None
            write.done.result()

    def flush(self, timeout_s: float = COMMIT_TIMEOUT_S, strict: bool = False) -> None:
        """Waits until every write queued so far has been tried; `strict`: raises
        LedgerUnavailable unless every owed one (a fate, a lineage) has landed, as before a
        version is saved (a request's own rows may wait: no save depends on them)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        waiting: list[int] = []  # the owed writes left for their retry (or given up) when this one landed
        self._put(QueuedWrite(lambda c: None, done, committed=lambda: waiting.append(self._retry.owed_waiting())))
        try:
            done.result(timeout_s)
        except LedgerUnavailable:
            if strict:
                raise
            return  # tried, and failed: the writes wait for their retry
        if strict and waiting[0]:
            raise LedgerUnavailable(f"{waiting[0]} fates in the feedback ledger are not written: {self._last_error}")

    def _put(self, write: QueuedWrite) -> None:
        if self._closed:
            if write.done is not None:
                write.done.set_exception(LedgerUnavailable("the feedback ledger is closed"))
            return
        self._queue.put(write)

    # -- the writer thread -------------------------------------------------------------

    def _run(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:  # the stop: a last try at what waits for its retry
                self._commit(self._retry.take())
                return
            batch = [*self._retry.take(), first]
            while len(batch) < 512:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._commit(batch)
                    return
                batch.append(item)
            self._commit(batch)
            if self.clock() - self._last_prune >= PRUNE_EVERY_S:
                self._prune_quietly()

    def _commit(self, batch: list[QueuedWrite]) -> None:
        """One transaction for the batch. If the ledger is full, retention makes room and
        each write is tried alone, so that one that cannot be written fails by itself;
        if it cannot be written at all (locked, read-only, I/O), every waiting caller
        hears it at once and the rest is kept to be retried."""
        # a waiting caller's write is begun here, unless its caller gave up on it (`_wait`)
        batch = [w for w in batch if w.done is None or w.done.set_running_or_notify_cancel()]
        if not batch:
            return
        started = time.perf_counter()
        try:
            self._transaction(batch)
        except Exception as exc:  # noqa: BLE001 - SQLite's errors, and any other: the writer never dies
            if isinstance(exc, sqlite3.IntegrityError) or is_full(exc):
                self._room_may_change = True
                for write in batch:
                    self._commit_one(write)
            else:
                for write in batch:
                    self._failed(write, exc)
        else:
            for write in batch:
                write.landed()
            self.stats.rows_written += len(batch)
        self.stats.commits += 1
        self.stats.commit_seconds += time.perf_counter() - started
        self.stats.retry_backlog = len(self._retry)

    def _failed(self, write: QueuedWrite, exc: Exception, tried: bool = True) -> None:
        """A write that could not be made (`tried` False: may not be yet, behind a failed one of
        its request): its waiting caller hears it (a label, refused with nothing changed); a
        queued one is retried with the next writes."""
        if tried:
            self.stats.write_errors += 1
            self._last_error = exc
        if write.done is not None:
            self._refuse(write, f"the feedback ledger cannot be written: {exc}")
        else:
            self._retry.keep(write, exc if tried else None)
        write.was_tried()  # (after the retry's append: whoever it tells sees the ledger failing)

    def _refuse(self, write: QueuedWrite, message: str) -> None:
        """A waiting caller's write refused, with nothing changed: a label's or a deletion's is a 503."""
        if write.request_id is not None:  # (not a flush's)
            self._refusals.add(message)
        write.done.set_exception(LedgerUnavailable(message))

    def _commit_one(self, write: QueuedWrite) -> None:
        if self._retry.holds_back(write):
            self._failed(write, self._last_error, tried=False)
            return
        try:
            try:
                self._transaction([write])
            except sqlite3.Error as exc:
                if not (is_full(exc) and self._room_may_change):  # (no write landed since retention last ran)
                    raise
                self._prune_quietly()  # room from what retention may drop, then once more
                self._transaction([write])
        except sqlite3.IntegrityError as exc:
            if write.done is not None and "FOREIGN KEY" in str(exc):  # its request's row is not written yet
                if self._retry:
                    self._refuse(write, f"the feedback ledger does not hold the label: it cannot be written: "
                                        f"{self._last_error}")
                else:
                    write.done.set_exception(LedgerUnavailable("the feedback ledger does not hold the label: its "
                                                               "request is not in it yet"))
            elif write.done is not None:
                write.done.set_exception(LabelExists(str(exc)))
            else:  # a row for a request the ledger no longer holds (deleted): nothing to do
                logger.debug("ledger write skipped: %s", exc)
                write.was_tried()
        except Exception as exc:  # noqa: BLE001 - as in _commit
            self._failed(write, exc)
        else:
            self.stats.rows_written += 1
            self._room_may_change = True
            write.landed()

    def _transaction(self, batch: list[QueuedWrite]) -> None:
        conn = self._conn
        conn.execute("BEGIN IMMEDIATE")  # waits up to BUSY_TIMEOUT_S for another writer's lock
        try:
            for write in batch:
                write.apply(conn)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:  # SQLite may have rolled back already (a full disk, an I/O error)
                conn.execute("ROLLBACK")
            raise

    # -- retention ---------------------------------------------------------------------

    def _prune_quietly(self) -> None:
        self._last_prune, self._room_may_change = self.clock(), False
        try:
            self._transaction([QueuedWrite(self._prune)])
        except sqlite3.Error as exc:
            if self._retention_failing.due():
                logger.warning("feedback ledger retention failed: %s", exc)

    def prune(self) -> None:
        """Applies retention now (it runs on its own every minute and when the file is full)."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._put(QueuedWrite(self._prune, done))
        done.result(COMMIT_TIMEOUT_S)

    def _prune(self, conn: sqlite3.Connection) -> None:
        """Retention (trainer/ledger_retention.py), on the writer thread."""
        deleted = ledger_retention.prune(conn, self.clock() - self.config.retention_days * 86400,
                                         int(self.config.max_bytes * PRUNE_TO))
        if deleted:
            self.stats.pruned_requests += deleted
            logger.info("feedback ledger: pruned %d old requests", deleted)

    def used_bytes(self) -> int:
        """Bytes of the database's pages in use (what retention bounds)."""
        return ledger_retention.used_bytes(self._conn)

    def close(self) -> None:
        """Writes what is queued and closes the database."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(30)
        if self._retry:  # (the answers of requests it records went out: their labels get 404 after a restart)
            logger.warning("feedback ledger: %d writes could not be made before the stop (%s) and are lost",
                           len(self._retry), self._last_error)
        self._conn.close()

