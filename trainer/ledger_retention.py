"""The feedback ledger's retention: what may be pruned, and the saved version that decides it.

Requests go by age (`retention_days`) and then oldest first until the file is under a share
of `max_bytes`, but never one whose label some weights still owe: a label not trained yet,
or trained into a version that is not saved yet — a crash before that save hands it back to
the restart (trainer/replay.py), which must find it. The last saved version is kept in the
ledger's `meta` table by the process that saves versions (its resume, then each save). A
file no such process writes (another node's, with data-parallel replicas; a ledger from
before the key) has none: there, labels trained are pruned as before, only untrained ones kept.
"""

from __future__ import annotations

import sqlite3

SAVED_VERSION_KEY = "saved_version"
# labels some weights still owe: never pruned (one parameter: the last saved version; NULL: none is known)
OWED = ("(fate IS NULL OR (fate = 'trained' AND ? IS NOT NULL AND fate_version > ?)) "
        "AND id IN (SELECT request_id FROM labels)")


def record_saved(conn: sqlite3.Connection, version: int) -> None:
    """Version `version` is on disk (or a restart resumed at it)."""
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (SAVED_VERSION_KEY, str(version)))


def saved_version(conn: sqlite3.Connection) -> int | None:
    """The last version recorded saved (-1: none was); None when no process saving versions writes this file."""
    row = conn.execute("SELECT value FROM meta WHERE key = ?", (SAVED_VERSION_KEY,)).fetchone()
    return None if row is None else int(row[0])


def used_bytes(conn: sqlite3.Connection) -> int:
    """Bytes of the database's pages in use (what retention bounds)."""
    page_size, pages, free = (conn.execute(f"PRAGMA {p}").fetchone()[0]
                              for p in ("page_size", "page_count", "freelist_count"))
    return (pages - free) * page_size


def prune(conn: sqlite3.Connection, cutoff: float, target_bytes: int) -> int:
    """Deletes the requests served before `cutoff`, then the oldest until the pages in use
    are at most `target_bytes`, none of them owed, and gives their pages back; how many it deleted."""
    saved = saved_version(conn)
    deleted = conn.execute(f"DELETE FROM requests WHERE served_at < ? AND NOT ({OWED})",
                           (cutoff, saved, saved)).rowcount
    conn.execute("DELETE FROM deleted_requests WHERE deleted_at < ?", (cutoff,))  # (ids only, not counted)
    while used_bytes(conn) > target_bytes:
        ids = [r[0] for r in conn.execute(f"SELECT id FROM requests WHERE NOT ({OWED}) ORDER BY served_at LIMIT 256",
                                          (saved, saved))]
        if not ids:
            break
        deleted += conn.execute(f"DELETE FROM requests WHERE id IN ({','.join('?' * len(ids))})", ids).rowcount
    if deleted:
        conn.execute("PRAGMA incremental_vacuum").fetchall()  # one row per page freed: step them all
    return deleted
