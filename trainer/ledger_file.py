"""The feedback ledger's file (trainer/ledger.py writes it, trainer/ledger_db.py reads its
rows): its schema, and opening it, for the writer (created owner-only, write-ahead log,
schema applied, bounded in bytes) or for a reader (which never writes).
"""

from __future__ import annotations

import os
import sqlite3
from pathlib import Path

# how long a write waits for a lock held by another connection before it fails
BUSY_TIMEOUT_S = 2.0
SCHEMA_VERSION = "1"
# columns of `requests` added since the first schema, in the order rows are read
ADDED_COLUMNS = ("tools", "chat_template_kwargs", "generation_prompt")

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    id TEXT PRIMARY KEY,
    served_at REAL NOT NULL,
    finished_at REAL,
    adapter_version INTEGER NOT NULL,
    method TEXT NOT NULL,
    prompt TEXT,
    prompt_token_ids TEXT NOT NULL,
    choices TEXT,
    aborted INTEGER NOT NULL DEFAULT 0,
    fate TEXT,
    fate_version INTEGER,
    fate_path TEXT,
    fate_reason TEXT,
    fate_at REAL,
    tools TEXT,
    chat_template_kwargs TEXT,
    generation_prompt TEXT
);
CREATE INDEX IF NOT EXISTS requests_served_at ON requests (served_at);
CREATE TABLE IF NOT EXISTS labels (
    request_id TEXT PRIMARY KEY REFERENCES requests (id) ON DELETE CASCADE,
    created_at REAL NOT NULL,
    source TEXT NOT NULL,
    kind TEXT NOT NULL,
    chosen TEXT,
    rejected TEXT,
    choice_index INTEGER,
    chosen_index INTEGER,
    rejected_index INTEGER,
    chosen_token_ids TEXT,
    rejected_token_ids TEXT,
    served_logps TEXT,
    rewards TEXT
);
-- the requests whose label was deleted (DELETE /v1/feedback/{id}): ids only, so that a
-- rollback or the gate never quarantines (and `feedback release` never brings back) one
CREATE TABLE IF NOT EXISTS deleted_labels (
    request_id TEXT PRIMARY KEY REFERENCES requests (id) ON DELETE CASCADE,
    deleted_at REAL NOT NULL
);
-- the requests deleted whole (DELETE /v1/chat/completions/{id}): ids only, so that their
-- label sent again is told so, after a restart too
CREATE TABLE IF NOT EXISTS deleted_requests (id TEXT PRIMARY KEY, deleted_at REAL NOT NULL);
-- versions whose weights are a copy of another's (a rollback, the eval gate's return to
-- the promoted version): trainer/ledger_lineage.py
CREATE TABLE IF NOT EXISTS versions (version INTEGER PRIMARY KEY, parent INTEGER NOT NULL);
-- the versions a label trained into before its last (`fate_version`): it was quarantined,
-- released and trained again, and a rollback may restore weights that hold an earlier one
CREATE TABLE IF NOT EXISTS earlier_trainings (
    request_id TEXT NOT NULL REFERENCES requests (id) ON DELETE CASCADE,
    version INTEGER NOT NULL,
    PRIMARY KEY (request_id, version)
);
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


class LedgerOpenError(OSError):
    """The ledger's file cannot be opened (a full disk, a directory it may not write in)."""


def open_database(path: Path, max_bytes: int | None = None, read_only: bool = False) -> sqlite3.Connection:
    """A connection to the ledger at `path` (created owner-only, WAL, schema applied
    unless `read_only`); LedgerOpenError if it cannot be opened."""
    if read_only:
        if not path.is_file():
            raise FileNotFoundError(f"no feedback ledger at {path}")
        return _open_read_only(path)
    try:
        return _open_for_writing(path, max_bytes)
    except (sqlite3.Error, OSError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise LedgerOpenError(f"the feedback ledger {path} cannot be opened for writing: {why}") from exc


def _open_read_only(path: Path) -> sqlite3.Connection:
    """A reader's connection. In a directory it may not write in (a read-only mount, a
    backup), SQLite cannot make the shared-memory file a write-ahead log is read through:
    with no log left to read (the last writer closed cleanly), the file is read as
    immutable; with one, that would miss its commits, so it is refused."""
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_S, check_same_thread=False)
    try:
        conn.execute("PRAGMA foreign_keys = ON")
        conn.execute("PRAGMA schema_version").fetchone()
        return conn
    except sqlite3.OperationalError as exc:
        conn.close()
        wal = path.with_name(path.name + "-wal")
        # (SQLite's "unable to open": its shared memory, beside a file in a directory it may not write in)
        shut_out = exc.sqlite_errorcode & 0xFF == sqlite3.SQLITE_CANTOPEN and not os.access(path.parent, os.W_OK)
        if not shut_out or (wal.exists() and wal.stat().st_size > 0):
            raise LedgerOpenError(f"the feedback ledger {path} cannot be read: {exc}" + (
                " (its directory cannot be written, and its write-ahead log holds commits a reader needs to write "
                "beside: read a copy of the directory)" if shut_out else "")) from exc
    conn = sqlite3.connect(f"file:{path}?immutable=1", uri=True, check_same_thread=False)
    conn.execute("PRAGMA foreign_keys = ON")
    return conn


def _open_for_writing(path: Path, max_bytes: int | None) -> sqlite3.Connection:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.close(fd)
    os.chmod(path, 0o600)
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None, check_same_thread=False)
    try:
        return _ready(conn, max_bytes)
    except BaseException:
        conn.close()
        raise


def _ready(conn: sqlite3.Connection, max_bytes: int | None) -> sqlite3.Connection:
    """The writer's connection `conn` with its settings and the schema."""
    conn.execute("PRAGMA auto_vacuum = INCREMENTAL")  # takes effect on a new file: pruning shrinks it
    conn.execute("PRAGMA journal_mode = WAL")
    conn.execute("PRAGMA synchronous = FULL")  # a commit is on disk before its label is acknowledged
    conn.execute("PRAGMA foreign_keys = ON")
    conn.executescript(SCHEMA)
    for column in set(ADDED_COLUMNS) - table_columns(conn, "requests"):  # a ledger from before they were kept
        try:
            conn.execute(f"ALTER TABLE requests ADD COLUMN {column} TEXT")
        except sqlite3.OperationalError as exc:  # another process added it first
            if "duplicate column" not in str(exc):
                raise
    conn.execute("INSERT OR IGNORE INTO meta VALUES ('schema_version', ?)", (SCHEMA_VERSION,))
    if max_bytes is not None:
        page_size = conn.execute("PRAGMA page_size").fetchone()[0]
        conn.execute(f"PRAGMA max_page_count = {max(max_bytes // page_size, 64)}")
    return conn


def table_columns(conn: sqlite3.Connection, table: str) -> set[str]:
    return {row[1] for row in conn.execute(f"PRAGMA table_info({table})")}
