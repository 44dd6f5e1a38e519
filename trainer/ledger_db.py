"""The feedback ledger's rows as dataclasses, writing and deleting them, and reading them
(the file and its schema: trainer/ledger_file.py).

The writer is trainer/ledger.py; replay at start (trainer/replay.py) and export
(trainer/export.py, which may run in another process while the server writes) read
through `read_ledger`, on connections of their own.
"""

from __future__ import annotations

import json
import sqlite3
from dataclasses import dataclass, field, fields
from pathlib import Path

from trainer.ledger_file import ADDED_COLUMNS, open_database, table_columns

LEDGER_FILE = "ledger.sqlite3"

# a request whose label was deleted (SQL, on `requests`)
LABEL_DELETED = "id IN (SELECT request_id FROM deleted_labels)"
# the reason a released label's request keeps beside no fate (release_quarantined)
RELEASED = "released"


@dataclass
class LedgerStats:
    """The feedback ledger's counters (`alchemist:ledger_*`)."""

    commits: int = 0
    rows_written: int = 0
    write_errors: int = 0
    refused_writes: int = 0
    pruned_requests: int = 0
    commit_seconds: float = 0.0
    # writes that failed and wait to be retried (requests' rows and fates)
    retry_backlog: int = 0
    # labels manual rollbacks quarantined (the eval gate's are counted by the lifecycle)
    rollback_quarantined: int = 0


@dataclass(frozen=True)
class Deletion:
    """What deleting a request or its label found (`Ledger.delete`)."""

    found: bool
    # the requests whose labels (or whole rows) it deleted, with their fates then ("trained": in
    # served weights, which a deletion does not take a label's effect out of; a rollback does;
    # "released": a quarantined label released, in no weights)
    fates: dict[str, str | None] = field(default_factory=dict)
    # the first version holding one of them (None: none had trained)
    trained_into: int | None = None


@dataclass(frozen=True)
class ChoiceRecord:
    index: int
    token_ids: list[int]
    text: str
    # each token's log-prob as serving computed it (None: not computed)
    token_logprobs: list[float] | None = None
    # why it finished: "stop", "length" (cut by max_tokens), "abort" (None: a ledger from before it was kept)
    finish_reason: str | None = None
    # with "stop", the client's stop that ended it (vLLM's stop_reason: the stop string, or the
    # stop token's id); None when the model ended its turn (or a ledger from before it was kept)
    stop_reason: str | int | None = None
    # the temperature `token_logprobs` were taken at (GRPO's sampling temperature); None: 1, the model's own
    logprob_temperature: float | None = None

    def as_row(self) -> dict:
        """The choice as the `choices` column's JSON holds it (dataclasses.asdict would
        copy every token id and log-prob first); `logprob_temperature` only where it is not 1."""
        row = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.logprob_temperature is None:
            del row["logprob_temperature"]
        return row


@dataclass(frozen=True)
class RequestRecord:
    id: str
    # unix time
    served_at: float
    adapter_version: int
    # the training method's name (cpt, dpo, grpo)
    method: str
    prompt_token_ids: list[int]
    # the prompt as the client wrote it: chat messages (a list) or text; None if not known. For
    # a chat request whose messages the template was given otherwise, those instead
    # (ClientPrompt.rendered), so that rendering them again gives the prompt that was served
    prompt: object = None
    # the tools a chat request offered (OpenAI's format), where the chat template renders them itself
    tools: list[dict] | None = None
    # what a chat request gave its chat template besides the messages (vLLM's chat_template_kwargs)
    chat_template_kwargs: dict | None = None
    # False: a chat request's template did not open the assistant's turn after its messages
    # (`add_generation_prompt: false`); kept only then (NULL otherwise, and in older ledgers)
    generation_prompt: bool = True

    def values(self) -> tuple:
        """The row's values for INSERT_REQUEST, encoded."""
        return (self.id, self.served_at, self.adapter_version, self.method, to_json(self.prompt),
                to_json(self.prompt_token_ids), to_json(self.tools), to_json(self.chat_template_kwargs),
                None if self.generation_prompt else to_json(False))


INSERT_REQUEST = ("INSERT OR REPLACE INTO requests (id, served_at, adapter_version, method, prompt, prompt_token_ids, "
                  "tools, chat_template_kwargs, generation_prompt) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)")
FINISH_REQUEST = "UPDATE requests SET finished_at = ?, choices = ?, aborted = ? WHERE id = ?"


@dataclass(frozen=True)
class ClientPrompt:
    """A request's prompt as the client wrote it, and the tools it offered: what the
    server hands the recorder for the ledger (and a reward function is shown `prompt`).
    `rendered`: the messages the chat template was given, where they are not the
    client's (content parts joined, developer as system, the fallback tool prompt's):
    the ledger keeps those."""

    prompt: object
    tools: list[dict] | None = None
    rendered: list[dict] | None = None
    chat_template_kwargs: dict | None = None
    generation_prompt: bool = True
    # False: a text the server made (token ids decoded, a prompt truncate_prompt_tokens cut), which
    # a reward function is shown but the ledger does not keep as the client's prompt
    as_written: bool = True


@dataclass(frozen=True)
class LabelRecord:
    # "preference" or "rewards"
    kind: str
    # "api" (POST /v1/feedback) or "reward_function"
    source: str = "api"
    # preference texts as sent (None: the served response of `choice_index`)
    chosen: str | None = None
    rejected: str | None = None
    choice_index: int | None = None
    chosen_index: int | None = None
    rejected_index: int | None = None
    # what the trainer trains on: both responses' token ids, and the served log-probs of
    # a side that is a served response
    chosen_token_ids: list[int] | None = None
    rejected_token_ids: list[int] | None = None
    served_logps: dict[str, float] = field(default_factory=dict)
    rewards: list[float] | None = None


@dataclass(frozen=True)
class LedgerRow:
    """A request as the ledger holds it, with its label (if any): what replay and export read."""

    request: RequestRecord
    finished_at: float | None
    choices: list[ChoiceRecord]
    aborted: bool
    fate: str | None
    fate_version: int | None
    fate_path: str | None
    fate_reason: str | None
    label: LabelRecord | None
    label_created_at: float | None


def delete_rows(conn: sqlite3.Connection, request_id: str, label_only: bool, at: float) -> Deletion:
    """Deletes a request (with its label), or only its label, and those of its prompts
    (`<request_id>-<i>`) where it is a completion of several prompts (Ledger.delete)."""
    table, column = ("labels", "request_id") if label_only else ("requests", "id")
    # its prompts' ids by their range (an id's characters are never a pattern), then digits
    of_its_prompts = (f"{column} >= ? AND {column} < ? AND substr({column}, ?) GLOB '[0-9]*' "
                      f"AND substr({column}, ?) NOT GLOB '*[^0-9]*'")
    suffix_at = len(request_id) + 2
    arguments = (request_id, f"{request_id}-", f"{request_id}.", suffix_at, suffix_at)
    rows = conn.execute(f"SELECT id, coalesce(fate, CASE fate_reason WHEN '{RELEASED}' THEN fate_reason END), "
                        f"fate_version FROM requests WHERE id IN (SELECT {column} FROM {table} WHERE {column} = ? OR "
                        f"({of_its_prompts}))", arguments).fetchall()
    if label_only:
        conn.execute("INSERT OR IGNORE INTO deleted_labels SELECT request_id, ? FROM labels WHERE "
                     f"request_id = ? OR ({of_its_prompts})", (at, *arguments))
        # a label deleted before it trained: its request takes no new one, after a restart too
        conn.execute("UPDATE requests SET fate = 'dropped', fate_reason = 'deleted', fate_at = ? WHERE (fate "
                     f"IS NULL OR fate = 'quarantined') AND id IN (SELECT request_id FROM labels WHERE "
                     f"request_id = ? OR ({of_its_prompts}))", (at, *arguments))
    else:
        conn.execute(f"INSERT OR IGNORE INTO deleted_requests SELECT id, ? FROM requests WHERE id = ? OR "
                     f"({of_its_prompts})", (at, *arguments))
    deleted = conn.execute(f"DELETE FROM {table} WHERE {column} = ? OR ({of_its_prompts})", arguments).rowcount > 0
    versions = [version for _, fate, version in rows if fate == "trained" and version is not None]
    return Deletion(deleted, {request: fate for request, fate, _ in rows}, min(versions, default=None))


def to_json(value) -> str | None:
    return None if value is None else json.dumps(value, separators=(",", ":"))


def from_json(text: str | None):
    return None if text is None else json.loads(text)


# -- reading (replay at start, export, other processes) --------------------------------

_ROW_COLUMNS = ("r.id, r.served_at, r.finished_at, r.adapter_version, r.method, r.prompt, r.prompt_token_ids, "
                "r.choices, r.aborted, r.fate, r.fate_version, r.fate_path, r.fate_reason, l.created_at, "
                "l.source, l.kind, l.chosen, l.rejected, l.choice_index, l.chosen_index, l.rejected_index, "
                "l.chosen_token_ids, l.rejected_token_ids, l.served_logps, l.rewards")


def read_rows(conn: sqlite3.Connection, where: str = "1", params: tuple = ()) -> list[LedgerRow]:
    """Requests with their labels, oldest first, filtered by an SQL condition on `r`
    (requests) and `l` (labels)."""
    present = table_columns(conn, "requests")
    added = ", ".join(f"r.{c}" if c in present else "NULL" for c in ADDED_COLUMNS)  # an older ledger, read only
    rows = conn.execute(f"SELECT {_ROW_COLUMNS}, {added} FROM requests r LEFT JOIN labels l ON l.request_id = r.id "
                        f"WHERE {where} ORDER BY r.served_at, r.id", params).fetchall()
    return [_row(r) for r in rows]


def _row(r: tuple) -> LedgerRow:
    request = RequestRecord(r[0], r[1], r[3], r[4], from_json(r[6]), from_json(r[5]), from_json(r[25]),
                            from_json(r[26]), from_json(r[27]) is not False)
    choices = [ChoiceRecord(c["index"], c["token_ids"], c["text"], c.get("token_logprobs"), c.get("finish_reason"),
                            c.get("stop_reason"), c.get("logprob_temperature")) for c in from_json(r[7]) or []]
    label = None
    if r[13] is not None:
        label = LabelRecord(r[15], r[14], r[16], r[17], r[18], r[19], r[20], from_json(r[21]),
                            from_json(r[22]), from_json(r[23]) or {}, from_json(r[24]))
    return LedgerRow(request, r[2], choices, bool(r[8]), r[9], r[10], r[11], r[12], label, r[13])


def read_ledger(path: str | Path, where: str = "1", params: tuple = ()) -> list[LedgerRow]:
    """`read_rows` on a read-only connection of its own (WAL lets it run beside the
    writer, in this process or another)."""
    conn = open_database(Path(path), read_only=True)
    try:
        return read_rows(conn, where, params)
    finally:
        conn.close()


def deleted_requests(path: str | Path, request_id: str) -> list[str]:
    """The ids deleted whole (DELETE /v1/chat/completions/{id}) that are `request_id` or
    begin with `<request_id>-` (its prompts', for a completion of several)."""
    conn = open_database(Path(path), read_only=True)
    try:
        return [row[0] for row in conn.execute("SELECT id FROM deleted_requests WHERE id = ? OR (id >= ? AND id < ?)",
                                               (request_id, request_id + "-", request_id + "."))]
    finally:
        conn.close()


@dataclass(frozen=True)
class FateRow:
    """A request's label and fate, without its prompt and answers (`alchemist feedback list`)."""

    id: str
    served_at: float
    method: str
    label: str | None
    label_source: str | None
    fate: str | None
    fate_version: int | None
    fate_reason: str | None
    # how a trained label trained: "reuse" (on its recording), "stashed" (on an older version's, with
    # that version's weights), "recompute" (a full forward)
    fate_path: str | None = None


def read_fates(path: str | Path, where: str = "1", params: tuple = ()) -> list[FateRow]:
    """The requests' labels and fates, oldest first, filtered by an SQL condition on `r`
    (requests) and `l` (labels); read only, beside the writer."""
    conn = open_database(Path(path), read_only=True)
    try:
        return [FateRow(*row) for row in conn.execute(
            "SELECT r.id, r.served_at, r.method, l.kind, l.source, r.fate, r.fate_version, r.fate_reason, r.fate_path "
            "FROM requests "
            f"r LEFT JOIN labels l ON l.request_id = r.id WHERE {where} ORDER BY r.served_at, r.id", params)]
    finally:
        conn.close()


def release_quarantined(path: str | Path, request_ids: list[str] | None = None) -> list[str]:
    """Releases labels the eval gate quarantined (all, or those of `request_ids`): they
    train when the server next starts. The ids released."""
    conn = open_database(Path(path))
    try:
        where, params = f"fate = 'quarantined' AND NOT {LABEL_DELETED}", ()
        if request_ids is not None:
            where += f" AND id IN ({','.join('?' * len(request_ids))})"
            params = tuple(request_ids)
        conn.execute("BEGIN IMMEDIATE")
        released = [request_id for (request_id,) in conn.execute(f"SELECT id FROM requests WHERE {where}", params)]
        # (a reason kept beside no fate: a running server's deletion tells it from a fate not written yet;
        # the version it trained into too: a rollback to weights that hold it gives it back its `trained`)
        conn.execute(f"UPDATE requests SET fate = NULL, fate_reason = '{RELEASED}' WHERE {where}", params)
        conn.execute("COMMIT")
        return released
    finally:
        conn.close()
