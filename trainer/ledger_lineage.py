"""Which labels an adapter version holds, in the feedback ledger's terms.

Versions only go forward, but weights do not: a rollback makes version V a copy of saved
version N's weights, and the eval gate's rejection makes one a copy of the promoted
version's. The ledger's `versions` table records those parents; any other version's
parent is the version before it. The labels a version holds are those trained into the
versions of its lineage (it, its parent, its parent's parent, …), so a rollback to N, as V:
  - quarantines the labels trained into versions before V that are not in N's lineage
    (they left the weights; `alchemist feedback release` trains them again), and
  - gives back their `trained` fate to the labels an earlier rollback quarantined that
    are in N's lineage (they are in the weights again: released, they would train twice),
    and to those released since, waiting to train again (a release keeps the version).
A label released and trained again has two trainings (the `earlier_trainings` table keeps
the one before its last): it is held by weights whose lineage has either.
A label deleted after it trained is dropped for good instead of quarantined (it never trains
again; weights a later rollback restores that hold it make it `trained` again, which names the
version a deletion reports). A rollback's
fates are applied once: applied again (a restart after a kill, each data-parallel replica
on a shared ledger) it changes nothing, whatever happened since (a release, a deletion).

A restart that resumes saved version S as W (the versions after S died unsaved with the
process) moves the fates to what S's weights hold, as a rollback to S would, except that
what trained into the lost versions is opened again (trainer/replay.py), not quarantined:
fates a lost rollback wrote, or a replica wrote before the save that should have kept its
rollback, follow the weights that survived.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from trainer.ledger_db import LABEL_DELETED, RELEASED
from trainer.ledger_file import open_database

ROLLED_BACK = "rolled back to version"
# the meta key of the last version a restart resumed as (`resumed_as`), or a rollback was given (`named`)
HIGHEST_RESUMED_KEY = "resumed_as_version"


def rollback_reason(restored: int, version: int) -> str:
    return f"{ROLLED_BACK} {restored}, as version {version}"


def resume_reason(saved: int, version: int) -> str:
    return f"resumed saved version {saved} as version {version}: the weights after it were lost"


def lineage(conn: sqlite3.Connection, version: int) -> list[tuple[int, int]]:
    """The versions whose labels `version` holds, as inclusive ranges."""
    parents = dict(conn.execute("SELECT version, parent FROM versions WHERE version <= ?", (version,)).fetchall())
    ranges, current = [], version
    while current >= 0:
        restore = max((v for v in parents if v <= current), default=None)
        if restore is None:
            ranges.append((0, current))
            break
        ranges.append((restore, current))
        if parents[restore] >= restore:  # never written so; a parent is always an older version
            break
        current = parents[restore]
    return ranges


def record_fate(conn: sqlite3.Connection, request_id: str, fate: str, version: int | None, path: str | None,
                reason: str | None, at: float) -> None:
    """How a request's entry ended; a label that trains again (released, or given back its
    fate by a rollback while it waited to) keeps the version it trained into before among
    its `earlier_trainings`."""
    if fate == "trained":
        conn.execute(f"INSERT OR IGNORE INTO earlier_trainings SELECT id, fate_version FROM requests WHERE id = ? AND "
                     f"fate_version IS NOT NULL AND fate_version != ? AND ((fate IS NULL AND fate_reason = "
                     f"'{RELEASED}') OR fate = 'trained')", (request_id, version))
    conn.execute("UPDATE requests SET fate = ?, fate_version = ?, fate_path = ?, fate_reason = ?, fate_at = ? "
                 "WHERE id = ?", (fate, version, path, reason, at, request_id))


def restore(conn: sqlite3.Connection, restored: int, version: int, at: float, resumed: bool = False) -> int:
    """Version `version` is a copy of version `restored`'s weights (a rollback; `resumed`: a
    restart's, after the versions that followed `restored` were lost): records the parent,
    then moves the labels' fates to what the weights now hold — a label is held where its
    training, or an earlier one, is in `restored`'s lineage, and its fate then names that
    one; the labels it quarantined (none if this rollback's fates were applied already)."""
    if conn.execute("SELECT 1 FROM versions WHERE version = ? AND parent = ?", (version, restored)).fetchone():
        return 0
    conn.execute("INSERT OR REPLACE INTO versions (version, parent) VALUES (?, ?)", (version, restored))
    ranges = lineage(conn, restored)
    bounds = tuple(bound for pair in ranges for bound in pair)
    last = " OR ".join("fate_version BETWEEN ? AND ?" for _ in ranges)
    earlier = " OR ".join("version BETWEEN ? AND ?" for _ in ranges)
    held = f"(({last}) OR id IN (SELECT request_id FROM earlier_trainings WHERE {earlier}))"
    held_version = (f"CASE WHEN {last} THEN fate_version ELSE (SELECT max(version) FROM earlier_trainings t "
                    f"WHERE t.request_id = requests.id AND ({earlier})) END")
    # a rollback quarantines what the versions it undid trained; a restart's resume leaves what
    # trained into the lost versions to be opened again (trainer/replay.py)
    undone_below = restored + 1 if resumed else version
    reason = resume_reason(restored, version) if resumed else rollback_reason(restored, version)
    quarantined = quarantine(conn, f"fate = 'trained' AND fate_version < ? AND NOT {held}",
                             (undone_below, *bounds, *bounds), reason, at)
    # in the weights again: quarantined (by an earlier rollback, or by the gate after an earlier
    # training these weights hold), released since (a release keeps the version), dropped when
    # deleted after its training (never to train again, but held: a deletion names the version),
    # or trained again after a release where the weights hold the training before (deleted or
    # not: the fate names what holds it); a fate moved to an earlier training keeps the later one
    again = (f"(((fate = 'quarantined' OR (fate IS NULL AND fate_reason = '{RELEASED}')) AND NOT {LABEL_DELETED}) "
             f"OR (fate = 'dropped' AND fate_reason = 'deleted' AND {LABEL_DELETED}) "
             f"OR (fate = 'trained' AND fate_version < ? AND NOT ({last}))) AND {held}")
    again_params = (version, *bounds, *bounds, *bounds)
    conn.execute(f"INSERT OR IGNORE INTO earlier_trainings SELECT id, fate_version FROM requests WHERE {again} "
                 f"AND fate_version IS NOT NULL AND NOT ({last})", (*again_params, *bounds))
    conn.execute(f"UPDATE requests SET fate = 'trained', fate_version = {held_version}, fate_reason = NULL, "
                 f"fate_at = ? WHERE {again}", (*bounds, *bounds, at, *again_params))
    return quarantined


def reopen(conn: sqlite3.Connection, request_ids: list[str]) -> None:
    """These labels trained last into versions a crash lost: open again. One released
    after an earlier training that survived (queued after `forget_after`) is released
    again, with that training's version, as before its lost training: a rollback to
    weights that hold it gives it back its `trained` (cleared, the cache trained it twice)."""
    earlier = "FROM earlier_trainings t WHERE t.request_id = requests.id"
    conn.execute(f"UPDATE requests SET fate = NULL, fate_path = NULL, fate_version = (SELECT max(version) {earlier}), "
                 f"fate_reason = CASE WHEN EXISTS (SELECT 1 {earlier}) THEN '{RELEASED}' END "
                 f"WHERE fate = 'trained' AND id IN ({','.join('?' * len(request_ids))})", request_ids)


def highest_version(path: str | Path) -> int:
    """The highest adapter version the ledger at `path` knows of (-1: none): one that
    served a request, that labels trained into, a copy's, or one a restart resumed as.
    Read only, beside the writer."""
    conn = open_database(Path(path), read_only=True)
    try:
        return conn.execute(
            "SELECT max(coalesce((SELECT max(adapter_version) FROM requests), -1), "
            "coalesce((SELECT max(fate_version) FROM requests), -1), "
            "coalesce((SELECT max(version) FROM versions), -1), "
            "coalesce((SELECT CAST(value AS INTEGER) FROM meta WHERE key = ?), -1))",
            (HIGHEST_RESUMED_KEY,)).fetchone()[0]
    finally:
        conn.close()


def copied_versions(path: str | Path) -> dict[int, int]:
    """Each version that began as a copy of another's weights (a rollback, the gate's return,
    a restart's resume) → the version it copied; kept after the copy's directory is pruned.
    Read only, beside the writer; {} where there is no ledger."""
    if not Path(path).is_file():
        return {}
    conn = open_database(Path(path), read_only=True)
    try:
        return dict(conn.execute("SELECT version, parent FROM versions").fetchall())
    finally:
        conn.close()


def resumed_as(conn: sqlite3.Connection, saved: int, version: int, at: float) -> int:
    """A restart resumed saved version `saved`'s weights as `version`, a number above every
    one the ledger knew (versions after `saved` died unsaved: their numbers are not given
    to other weights), and the fates follow `saved`'s weights (`restore`); nothing when it
    resumed under its own number (0: fresh weights, none saved). The labels it quarantined."""
    if version == max(saved, 0):
        return 0
    conn.execute("INSERT OR REPLACE INTO meta VALUES (?, ?)", (HIGHEST_RESUMED_KEY, str(version)))
    if saved < 0:  # fresh weights hold nothing: what trained before trains again (trainer/replay.py)
        record_parent(conn, version, saved)
        return 0
    return restore(conn, saved, version, at, resumed=True)


def named(conn: sqlite3.Connection, version: int) -> None:
    """Version `version` was given to weights: `highest_version` knows it from now on."""
    conn.execute("INSERT INTO meta VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                 "CAST(max(CAST(value AS INTEGER), CAST(excluded.value AS INTEGER)) AS TEXT)",
                 (HIGHEST_RESUMED_KEY, str(version)))


def record_parent(conn: sqlite3.Connection, version: int, parent: int) -> None:
    """Version `version` is a copy of version `parent`'s weights (the gate's return to the
    promoted version; its rejected labels are quarantined by id)."""
    conn.execute("INSERT OR REPLACE INTO versions (version, parent) VALUES (?, ?)", (version, parent))


def forget_after(conn: sqlite3.Connection, saved: int) -> None:
    """The versions after `saved` died unsaved with a crash: the parent one of them recorded
    (a gate's copy whose save a kill cut short) and the trainings into them go with them
    (the restart resumes `saved`'s weights under a new number, `resumed_as`)."""
    conn.execute("DELETE FROM versions WHERE version > ?", (saved,))
    conn.execute("DELETE FROM earlier_trainings WHERE version > ?", (saved,))  # in no weights that survived


def quarantine(conn: sqlite3.Connection, where: str, params: tuple, reason: str, at: float) -> int:
    """Quarantines the requests `where` selects, but drops for good those whose label was
    deleted (the label is in no weights any more, and must never train again); how many
    it quarantined."""
    conn.execute(f"UPDATE requests SET fate = 'dropped', fate_reason = 'deleted', fate_at = ? "
                 f"WHERE ({where}) AND {LABEL_DELETED}", (at, *params))
    return conn.execute(f"UPDATE requests SET fate = 'quarantined', fate_reason = ?, fate_at = ? "
                        f"WHERE ({where}) AND NOT {LABEL_DELETED}", (reason, at, *params)).rowcount
