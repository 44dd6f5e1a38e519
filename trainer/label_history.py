"""What the feedback ledger remembers of a completion when this process's cache does not:
a client whose 200 a crash lost sends its label again after the restart, and is told
that the label exists (409), or that its data were deleted (404), as it would have been
before the crash.

A `/v1/completions` request of several prompts keeps an entry per prompt, `<id>-<i>`, and
numbers its choices across them (with n choices per prompt, prompt i's j-th is i·n + j);
a label naming the request's own id is the label of the prompt its choice belongs to.
"""

from __future__ import annotations

import sqlite3
from dataclasses import dataclass
from pathlib import Path

from trainer.ledger_db import LABEL_DELETED, deleted_requests, read_ledger


# a fate's reason as the ledger keeps it, in words (others, a rollback's, say themselves)
_REASONS = {
    "aborted": "its request was cut short: a client that went away, or the server shutting down",
    "interrupted": "its request was in flight when the server stopped",
    "max_label_entries": "the bound on entries waiting for a label, train.max_label_entries, was reached",
    "cache_full": "the activation cache was full",
    "reward_function_failed": "the reward function failed on it",
    "job_failed": "the training job that held it failed",
    "stale": "its recording was staler than train.max_staleness allows, and train.stale_policy drops such",
    "non_finite_loss": "its loss was not a finite number",
    "step_skipped": "its optimizer step was skipped twice (a loss or gradient not finite)",
}


def is_prompt_of(completion_id: str, entry_id: str) -> bool:
    """Whether `entry_id` is one prompt's entry (`<id>-<i>`) of a `/v1/completions`
    request of several prompts, `completion_id`."""
    prefix, _, index = entry_id.rpartition("-")
    return prefix == completion_id and index.isascii() and index.isdigit()


@dataclass(frozen=True)
class LedgerMemory:
    # the entry the ledger row is of: the completion's, or one prompt's of a batch
    entry_id: str
    labelled: bool
    # the row's fate: "trained" (into `fate_version`), another fate, or None (waits to train)
    fate: str | None
    fate_version: int | None
    fate_reason: str | None
    # the prompts of the batch whose id was asked about (0: not a batch's id)
    prompts: int = 0
    # its label was deleted (DELETE /v1/feedback/{id}, or its request's whole), before or after it trained
    label_deleted: bool = False

    @property
    def deleted(self) -> bool:
        """Its label was deleted: it takes no new one (a ledger from before deleted labels were
        kept apart tells a deletion before training by its fate)."""
        by_fate = self.fate == "dropped" and self.fate_reason == "deleted"
        return not self.labelled and (self.label_deleted or by_fate)

    def how(self) -> str:
        if self.fate == "trained":
            return f"was trained into version {self.fate_version}"
        if self.fate is None:
            return "waits to be trained"
        reason = _REASONS.get(self.fate_reason, self.fate_reason)
        return f"is {self.fate}" + (f" ({reason})" if reason else "")


def remembered(ledger_path: str | Path, completion_id: str, choice: int | None = 0) -> LedgerMemory | None:
    """The ledger's row of `completion_id`, or of the prompt of a batch that its choice
    `choice` answers (None: a label naming no choice, GRPO's rewards, answers none of a
    batch's prompts); None if it holds none. Raises sqlite3.Error or OSError when the
    ledger cannot be read."""
    rows = read_ledger(ledger_path, "r.id = ?", (completion_id,))
    if not rows:
        prefix = completion_id + "-"  # its prompts' ids by their range, which the primary key's index serves
        prompts = {row.request.id: row for row in read_ledger(ledger_path, "r.id >= ? AND r.id < ?",
                                                               (prefix, completion_id + "."))
                   if is_prompt_of(completion_id, row.request.id)}
        if not prompts:  # none, or deleted whole (its prompts with it)
            deleted = any(i == completion_id or is_prompt_of(completion_id, i)
                          for i in deleted_requests(ledger_path, completion_id))
            return LedgerMemory(completion_id, False, None, None, None, label_deleted=True) if deleted else None
        if choice is None:
            return LedgerMemory(completion_id, False, None, None, None, prompts=len(prompts))
        per_prompt = max((len(row.choices) for row in prompts.values()), default=0) or 1  # (a cut prompt: fewer)
        rows = [row for row in [prompts.get(f"{prefix}{choice // per_prompt}")] if row is not None]
    if not rows:
        return None
    row = rows[0]
    deleted = row.label is None and bool(read_ledger(ledger_path, f"r.id = ? AND r.{LABEL_DELETED}",
                                                     (row.request.id,)))
    return LedgerMemory(row.request.id, row.label is not None, row.fate, row.fate_version, row.fate_reason,
                        label_deleted=deleted)


def fate_said(ledger_path: str | Path, completion_id: str) -> str | None:
    """What became of an entry's label, as the ledger says once its fate has landed there
    (trained into which version, quarantined by the eval gate or a rollback); None if it
    has none yet or the ledger cannot be read."""
    try:
        memory = remembered(ledger_path, completion_id)
    except (sqlite3.Error, OSError):
        return None
    return memory.how() if memory is not None and memory.fate is not None else None
