"""Saved adapter versions that hold the same weights, by version number.

A rollback's or the eval gate's copy of a saved version names the version it copies
(`weights_of` in its state). `prunable` says which versions give way when more than `keep`
are saved: copies first, so that retried rollbacks and repeated rejections do not push out
the distinct versions to roll back to. `holder_of` says where a version pruned is to be read
from when a copy of its weights, or what it copied, is saved.
"""

from __future__ import annotations


def originals(copied: dict[int, int | None]) -> dict[int, int | None]:
    """Each version's original — the version whose weights it holds, followed through copies
    of copies (older directories name the copy they copied) — from what each names (None:
    no copy)."""
    resolved = dict(copied)
    for number, original in resolved.items():
        for _ in resolved:  # (bounded: a hand-edited state could name a cycle)
            if original is None or resolved.get(original) in (None, original):
                break
            original = resolved[original]
        resolved[number] = original
    return resolved


def prunable(copied: dict[int, int | None], keep: int) -> list[int]:
    """The saved versions (`copied`'s keys, each naming what it copies) to delete so that
    `keep` remain. Versions holding the same weights give way first, oldest first, down to
    one of them: the newest version if it is one of them, else the version copied while it
    is on disk, else the newest copy. Then the oldest others. The newest always stays."""
    numbers = sorted(copied)
    excess = len(numbers) - keep
    if excess <= 0:
        return []
    resolved = originals(copied)
    holders: dict[int, list[int]] = {}
    for number in numbers:
        holders.setdefault(number if resolved[number] is None else resolved[number], []).append(number)
    newest = numbers[-1]
    kept = {newest if newest in group else (weights if weights in group else group[-1])
            for weights, group in holders.items()}
    older = numbers[:-1]
    duplicates = [number for number in older if number not in kept]
    return (duplicates + [number for number in older if number not in duplicates])[:excess]


def holder_of(copied: dict[int, int | None], version: int, copied_before: dict[int, int] | None = None) -> int:
    """The saved version (of `copied`'s keys) that holds `version`'s weights: itself, or,
    where it was pruned for a copy of it (a retried rollback to it), the newest such copy,
    or, where `version` was itself a copy that was pruned (`copied_before`: what the feedback
    ledger says each copy copied, kept after its directory is gone), the holder of what it
    copied; `version` itself when none does (reading it fails then as a version not saved)."""
    asked, seen = version, set()
    while version not in copied and version not in seen:
        copies = [number for number, original in originals(copied).items() if original == version]
        if copies:
            return max(copies)
        seen.add(version)
        version = (copied_before or {}).get(version, version)
    return version if version in copied else asked
