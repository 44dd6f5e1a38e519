"""Stored responses: the Responses API's conversation state (OpenAI's `store`, on unless a
request says `"store": false`).

A stored response keeps the `response` object as it was answered, the input it was given
(as the API lists it: items, each with an id) and the id of the response it continued.
`previous_response_id` continues a stored one: its conversation — every earlier turn's
input and output, oldest first — comes before the new input (server/responses_stored.py).

SQLite, in the adapter directory beside the feedback ledger where the server keeps one (a
conversation outlives a restart, and the replicas of a node share the file), else in
memory. Bounded by count and by bytes: the least recently used go first, and continuing a
conversation uses every turn of it (one still going on is not pruned from under it).
Deleted text is overwritten (`secure_delete`) and checkpointed out of the write-ahead log.
Every call blocks: the routes make them on a worker thread.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

RESPONSES_FILE = "responses.sqlite3"
# how long a write waits for another process's (a replica's) lock
_BUSY_TIMEOUT_S = 10.0
# the texts apart from what each write reads and rewrites (which turn a response continues, its
# recency and size): marking a conversation's turns used touches none of their text
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS recency (
    id TEXT PRIMARY KEY REFERENCES responses (id) ON DELETE CASCADE,
    previous_id TEXT,
    -- the order in which responses were stored or continued (the least recent pruned first)
    used INTEGER NOT NULL,
    bytes INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS recency_by_use ON recency (used, bytes);
"""
# the chain of responses a response continues, newest first (a conversation's turns, from its last)
_CHAIN = """
WITH RECURSIVE chain (id, previous_id, depth) AS (
    SELECT id, previous_id, 0 FROM recency WHERE id = ?
    UNION ALL
    SELECT r.id, r.previous_id, c.depth + 1 FROM recency r JOIN chain c ON r.id = c.previous_id
    WHERE c.depth < 100000
)
"""


@dataclass(frozen=True)
class StoredResponse:
    # the `response` object as answered (its id, its output items)
    response: dict
    # the request's own input, as `GET /v1/responses/{id}/input_items` lists it
    input_items: list[dict]
    # the stored response it continued (`previous_response_id`), None for a conversation's first
    previous_id: str | None = None

    @property
    def id(self) -> str:
        return self.response["id"]


class ResponseStore:
    def __init__(self, path: Path | None = None, max_stored: int = 10_000, max_bytes: int = 512 << 20):
        """`path`: the SQLite file (created, owner-only); None: in memory."""
        if max_stored < 1 or max_bytes < 1:
            raise ValueError(f"max_stored and max_bytes must be at least 1, got {max_stored} and {max_bytes}")
        self.path, self.max_stored, self.max_bytes = path, max_stored, max_bytes
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600, exist_ok=True)
        self._writer = self._connect()
        self._writer.executescript(_SCHEMA)
        # in WAL mode a reader does not wait on a writer (another replica's included); in memory, one connection
        self._reader = self._connect() if path is not None else self._writer
        self._write_lock = threading.Lock()
        self._read_lock = threading.Lock() if path is not None else self._write_lock
        # how many are stored, and their bytes, as of this process's last write (`alchemist:stored_response*`)
        self.count, self.bytes = self._measure()

    def _measure(self) -> tuple[int, int]:
        return self._writer.execute("SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM recency").fetchone()

    def _connect(self) -> sqlite3.Connection:
        db = sqlite3.connect(str(self.path) if self.path is not None else ":memory:", timeout=_BUSY_TIMEOUT_S,
                             check_same_thread=False, isolation_level=None)
        db.execute("PRAGMA secure_delete = ON")
        db.execute("PRAGMA foreign_keys = ON")
        if self.path is not None:
            db.execute("PRAGMA journal_mode = WAL")
            db.execute("PRAGMA synchronous = NORMAL")
        return db

    def put(self, stored: StoredResponse) -> bool:
        """Stores a response (replacing one of its id) and marks the turns it continues as
        used now; then prunes the least recently used beyond the bounds. Whether it was
        stored (one larger than `max_bytes` alone is not)."""
        response, items = json.dumps(stored.response), json.dumps(stored.input_items)
        size = len(response) + len(items)
        if size > self.max_bytes:  # (it would push every other out, then itself)
            return False
        with self._write_lock:
            self._writer.execute("BEGIN IMMEDIATE")
            try:
                used = self._writer.execute("SELECT COALESCE(MAX(used), 0) + 1 FROM recency").fetchone()[0]
                self._writer.execute("INSERT OR REPLACE INTO responses (id, response, input_items) VALUES (?, ?, ?)",
                                     (stored.id, response, items))
                self._writer.execute("INSERT OR REPLACE INTO recency (id, previous_id, used, bytes) "
                                     "VALUES (?, ?, ?, ?)", (stored.id, stored.previous_id, used, size))
                if stored.previous_id is not None:
                    self._writer.execute(_CHAIN + "UPDATE recency SET used = ? WHERE id IN (SELECT id FROM chain)",
                                         (stored.previous_id, used))
                self.count, self.bytes = self._measure()
                if self.count > self.max_stored or self.bytes > self.max_bytes:
                    self._writer.execute(
                        "DELETE FROM responses WHERE id IN (SELECT id FROM (SELECT id, COUNT(*) OVER newest AS rank, "
                        "SUM(bytes) OVER newest AS total FROM recency WINDOW newest AS (ORDER BY used DESC, rowid "
                        "DESC)) WHERE rank > ? OR total > ?)", (self.max_stored, self.max_bytes))
                    self.count, self.bytes = self._measure()
                self._writer.execute("COMMIT")
            except BaseException:
                self._writer.execute("ROLLBACK")
                self.count, self.bytes = self._measure()
                raise
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        with self._read_lock:
            row = self._reader.execute("SELECT s.response, s.input_items, r.previous_id FROM responses s JOIN recency "
                                       "r ON r.id = s.id WHERE s.id = ?", (response_id,)).fetchone()
        return None if row is None else StoredResponse(json.loads(row[0]), json.loads(row[1]), row[2])

    def chain(self, response_id: str) -> tuple[list[StoredResponse], str | None]:
        """The stored turns of the conversation that ends with `response_id`, newest first,
        and the id of the turn before the oldest of them that this store does not hold
        (None: they go back to the conversation's first)."""
        with self._read_lock:
            rows = self._reader.execute(_CHAIN + "SELECT s.response, s.input_items, c.previous_id FROM chain c "
                                        "JOIN responses s ON s.id = c.id ORDER BY c.depth", (response_id,)).fetchall()
        turns = [StoredResponse(json.loads(r), json.loads(i), p) for r, i, p in rows]
        return turns, (turns[-1].previous_id if turns else response_id)

    def delete(self, response_id: str) -> bool:
        """Forgets a stored response (its text overwritten, and out of the write-ahead log);
        whether one was stored. The responses that continued it stay, but can no longer be
        continued (their conversation lacks a turn)."""
        with self._write_lock:
            deleted = self._writer.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0
            if deleted and self.path is not None:
                busy, _, _ = self._writer.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
                if busy:  # another process (a replica) reads an older snapshot: the next checkpoint takes it
                    logger.warning("a deleted response's text stays in %s-wal until the next checkpoint: another "
                                   "process held the database", self.path)
            self.count, self.bytes = self._measure()
        return deleted

    def close(self) -> None:
        separate = self._read_lock is not self._write_lock
        with self._write_lock, self._read_lock if separate else contextlib.nullcontext():
            self._writer.close()
            if separate:
                self._reader.close()
