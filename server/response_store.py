"""Stored responses: the Responses API's conversation state (OpenAI's `store`, on unless a
request says `"store": false`).

A stored response keeps the `response` object as it was answered, the input it was given
(as the API lists it: items, each with an id) and the id of the response it continued.
`previous_response_id` continues a stored one: its conversation — every earlier turn's
input and output, oldest first — comes before the new input (server/responses_stored.py).

SQLite, in the adapter directory beside the feedback ledger where the server keeps one (a
conversation outlives a restart, and the replicas of a node share the file), else in
memory; at most `max_stored` responses, the oldest pruned first. Every call blocks: the
routes make them on a worker thread.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

RESPONSES_FILE = "responses.sqlite3"
# how long a write waits for another process's (a replica's) lock
_BUSY_TIMEOUT_S = 10.0
_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    stored_at REAL NOT NULL,
    previous_id TEXT,
    response TEXT NOT NULL,
    input_items TEXT NOT NULL
);
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
    def __init__(self, path: Path | None = None, max_stored: int = 10_000):
        """`path`: the SQLite file (created, owner-only); None: in memory."""
        if max_stored < 1:
            raise ValueError(f"max_stored must be at least 1, got {max_stored}")
        self.path, self.max_stored = path, max_stored
        self._lock = threading.Lock()
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.touch(mode=0o600, exist_ok=True)
        self._db = sqlite3.connect(str(path) if path is not None else ":memory:", timeout=_BUSY_TIMEOUT_S,
                                   check_same_thread=False, isolation_level=None)
        if path is not None:
            self._db.execute("PRAGMA journal_mode = WAL")
            self._db.execute("PRAGMA synchronous = NORMAL")
        self._db.executescript(_SCHEMA)

    def put(self, stored: StoredResponse) -> None:
        """Stores a response (replacing one of its id), then prunes the oldest beyond `max_stored`."""
        row = (stored.id, time.time(), stored.previous_id, json.dumps(stored.response),
               json.dumps(stored.input_items))
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                self._db.execute("INSERT OR REPLACE INTO responses (id, stored_at, previous_id, response, input_items) "
                                 "VALUES (?, ?, ?, ?, ?)", row)
                self._db.execute("DELETE FROM responses WHERE id IN (SELECT id FROM responses ORDER BY rowid DESC "
                                 "LIMIT -1 OFFSET ?)", (self.max_stored,))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            row = self._db.execute("SELECT response, input_items, previous_id FROM responses WHERE id = ?",
                                   (response_id,)).fetchone()
        if row is None:
            return None
        return StoredResponse(json.loads(row[0]), json.loads(row[1]), row[2])

    def delete(self, response_id: str) -> bool:
        """Forgets a stored response; whether one was stored. The responses that continued it
        stay, but can no longer be continued (their conversation lacks a turn)."""
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def __len__(self) -> int:
        with self._lock:
            return self._db.execute("SELECT COUNT(*) FROM responses").fetchone()[0]

    def close(self) -> None:
        with self._lock:
            self._db.close()
