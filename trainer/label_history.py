"""What the feedback ledger remembers of a completion's label when this process's cache
does not: a client whose 200 a crash lost sends its label again after the restart, and is
told that the label exists (409), as it would have been before the crash.

A `/v1/completions` request of several prompts keeps an entry per prompt, `<id>-<i>`, and
numbers its choices across them (with n choices per prompt, prompt i's j-th is i·n + j);
a label naming the request's own id is the label of the prompt its choice belongs to.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.ledger_db import LedgerRow, read_ledger


def is_prompt_of(completion_id: str, entry_id: str) -> bool:
    """Whether `entry_id` is one prompt's entry (`<id>-<i>`) of a `/v1/completions`
    request of several prompts, `completion_id`."""
    prefix, _, index = entry_id.rpartition("-")
    return prefix == completion_id and index.isascii() and index.isdigit()


@dataclass(frozen=True)
class KeptLabel:
    # the entry the label belongs to: the completion's, or one prompt's of a batch
    entry_id: str
    # the ledger's fate of it: "trained" (into `fate_version`), another fate, or None (waits to train)
    fate: str | None
    fate_version: int | None

    def how(self) -> str:
        if self.fate == "trained":
            return f"was trained into version {self.fate_version}"
        return f"is {self.fate}" if self.fate else "waits to be trained"


def kept_label(ledger_path: str | Path, completion_id: str, choice: int = 0) -> KeptLabel | None:
    """The label the ledger holds for `completion_id`, or for the prompt of a batch that
    its choice `choice` answers; None if it holds none. Raises sqlite3.Error or OSError
    when the ledger cannot be read."""
    rows = read_ledger(ledger_path, "r.id = ? AND l.request_id IS NOT NULL", (completion_id,))
    if not rows:
        prefix = completion_id + "-"
        prompts = {row.request.id: row for row in read_ledger(ledger_path, "substr(r.id, 1, ?) = ?",
                                                               (len(prefix), prefix))
                   if is_prompt_of(completion_id, row.request.id)}
        rows = [row for row in [prompts.get(f"{prefix}{choice // _choices_per_prompt(prompts.values())}")]
                if row is not None and row.label is not None]
    return KeptLabel(rows[0].request.id, rows[0].fate, rows[0].fate_version) if rows else None


def _choices_per_prompt(rows) -> int:
    """n of a batch: every prompt of it has n choices (a prompt cut short may hold fewer)."""
    return max((len(row.choices) for row in rows), default=0) or 1
