"""`alchemist feedback`: what a server's feedback ledger (`DIR/ledger.sqlite3`) holds, read
beside a running server: `export` (TRL's dataset formats, trainer/export.py), `list` (each
request's label and fate, e.g. the labels the eval gate quarantined) and `release`
(quarantined labels train again when the server next starts).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import sys
from pathlib import Path

from trainer.export import FORMATS

# what `list --fate` selects: the fates the ledger writes, and waiting (no fate yet)
FATES = ("waiting", "trained", "quarantined", "dropped", "expired", "evicted", "skipped")


def add_feedback_commands(commands) -> None:
    """`alchemist feedback export|list|release`."""
    feedback = commands.add_parser("feedback", help="the feedback a server collected (its ledger)")
    feedback_commands = feedback.add_subparsers(dest="feedback_command", required=True)
    export = feedback_commands.add_parser("export", help="write the ledger's labels as JSONL in TRL's dataset formats")
    export.add_argument("--adapter-dir", required=True, help="the server's --adapter-dir (it holds ledger.sqlite3)")
    export.add_argument("--format", default="preference", choices=FORMATS,
                        help="preference: {prompt, chosen, rejected} (DPO); unpaired: {prompt, completion, label} "
                        "(KTO); prompt-completion: {prompt, completion[, reward]} (SFT, rewards as data); "
                        "language-modeling: {text} or {messages}, the prompts a CPT server trains on")
    export.add_argument("--since", help="only labels given (or, unlabelled, requests served) at or after this "
                        "ISO-8601 date or time (naive: UTC)")
    export.add_argument("--out", help="file to write (default: standard output)")
    export.add_argument("--style", default="auto", choices=["auto", "conversational", "standard"],
                        help="conversational rows (chat requests) or standard rows (text completions); auto: the "
                        "ledger's one style")
    export.add_argument("--include-quarantined", action="store_true",
                        help="also the labels the eval gate or a rollback quarantined, with a `quarantined` "
                        "column on every row (true for theirs)")
    export.add_argument("--drop-truncated", action="store_true",
                        help="leave out rows with a served answer cut short (by max_tokens, a client's stop or a "
                        "disconnect)")
    release = feedback_commands.add_parser("release", help="release labels the eval gate quarantined: they train "
                                           "when the server next starts")
    release.add_argument("--adapter-dir", required=True, help="the server's --adapter-dir (it holds ledger.sqlite3)")
    release.add_argument("ids", nargs="*", help="completion ids to release (default: every quarantined label)")
    listing = feedback_commands.add_parser("list", help="the ledger's requests, one per line: id, when served, "
                                           "method, label, fate (with its version and reason; 'not saved yet': "
                                           "trained into a version after the last saved one)")
    listing.add_argument("--adapter-dir", required=True, help="the server's --adapter-dir (it holds ledger.sqlite3)")
    listing.add_argument("--fate", choices=FATES, help="only requests of this fate (waiting: no fate yet — "
                         "served and not trained, labelled or not (--labelled: with a label), released ones too)")
    listing.add_argument("--labelled", action="store_true", help="only requests with a label")
    listing.add_argument("--json", action="store_true", help="JSON lines instead of a table")


def feedback_command(args: argparse.Namespace) -> int:
    """`alchemist feedback export|list|release`."""
    import sqlite3

    from trainer.ledger_db import LEDGER_FILE

    path = Path(args.adapter_dir) / LEDGER_FILE
    try:
        if args.feedback_command == "export":
            return export_feedback(args)
        if not path.is_file():
            print(f"alchemist: no feedback ledger at {path}", file=sys.stderr)
            return 2
        return list_requests(args, path) if args.feedback_command == "list" else release_labels(args, path)
    except sqlite3.Error as exc:  # (one that cannot be opened is an OSError saying so, below)
        print(f"alchemist: the feedback ledger {path} cannot be read: {exc}", file=sys.stderr)
    except OSError as exc:
        print(f"alchemist: {exc}", file=sys.stderr)
    return 2


def release_labels(args: argparse.Namespace, path: Path) -> int:
    """`feedback release`: 1 if an id asked for is neither released now nor before (each is
    said, and why)."""
    from trainer.ledger_db import RELEASED, read_fates, release_quarantined

    released = set(release_quarantined(path, args.ids or None))
    print(f"alchemist: released {len(released)} quarantined labels; they train when the server next starts",
          file=sys.stderr)
    missing = [request_id for request_id in dict.fromkeys(args.ids) if request_id not in released]
    if not missing:
        return 0
    rows = {row.id: row for row in read_fates(path, f"r.id IN ({','.join('?' * len(missing))})", tuple(missing))}
    refused = 0
    for request_id in missing:
        row = rows.get(request_id)
        if row is not None and row.fate is None and row.fate_reason == RELEASED:
            print(f"alchemist: {request_id}: released already", file=sys.stderr)
            continue
        refused += 1
        print(f"alchemist: {request_id}: {'not in the ledger' if row is None else 'not quarantined: ' + _fate(row)}",
              file=sys.stderr)
    return 1 if refused else 0


def list_requests(args: argparse.Namespace, path: Path) -> int:
    """`feedback list`: the ledger's requests, oldest first. A label trained into a version
    after the last saved one says so: a crash before that save hands it back to training."""
    from trainer.ledger_db import read_fates
    from trainer.ledger_file import open_database
    from trainer.ledger_retention import saved_version

    where, params = "1", ()
    if args.fate == "waiting":
        where = "r.fate IS NULL"
    elif args.fate:
        where, params = "r.fate = ?", (args.fate,)
    if args.labelled:
        where += " AND l.request_id IS NOT NULL"
    rows = read_fates(path, where, params)
    conn = open_database(path, read_only=True)
    try:
        saved = saved_version(conn)  # None: no process that saves versions writes this ledger
    finally:
        conn.close()

    def unsaved(row) -> bool | None:
        return None if row.fate != "trained" or saved is None else row.fate_version > saved

    if args.json:
        sys.stdout.write("".join(json.dumps({**dataclasses.asdict(row), "unsaved": unsaved(row)}, ensure_ascii=False)
                                 + "\n" for row in rows))
    else:
        table = [("id", "served_at", "method", "label", "trained by", "fate")]
        table += [(row.id, _when(row.served_at), row.method, row.label or "-",
                   row.fate_path if row.fate == "trained" and row.fate_path else "-",
                   _fate(row) + (" (not saved yet)" if unsaved(row) else "")) for row in rows]
        widths = [max(len(line[i]) for line in table) for i in range(len(table[0]) - 1)]
        sys.stdout.write("".join("  ".join([*(cell.ljust(w) for cell, w in zip(line, widths)), line[-1]]).rstrip()
                                 + "\n" for line in table))
    print(f"alchemist: {len(rows)} requests", file=sys.stderr)
    return 0


def _when(unix_time: float) -> str:
    return datetime.datetime.fromtimestamp(unix_time, datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _fate(row) -> str:
    """A row's fate in words: with the version it trained into, or why."""
    from trainer.ledger_db import RELEASED

    if row.fate is None:
        return "waiting (released)" if row.fate_reason == RELEASED else "waiting"
    version = f" v{row.fate_version}" if row.fate == "trained" else ""
    return row.fate + version + (f" ({row.fate_reason})" if row.fate_reason else "")


def _left_out(counts) -> str:
    """What the export left out, and why, as a clause per reason."""
    said = f"; {counts.skipped} requests of another style left out" if counts.skipped else ""
    if counts.continuing:
        said += (f"; {counts.continuing} requests left out whose prompt ends with an assistant message (TRL "
                 "renders it as continued and the completion as a turn of its own: not what was served) or a system "
                 "or developer message (which TRL refuses)")
    if counts.without_generation_prompt:
        said += (f"; {counts.without_generation_prompt} requests left out served with add_generation_prompt: "
                 "false (TRL opens the assistant's turn after such a prompt: not what was served)")
    if counts.abandoned:
        said += (f"; {counts.abandoned} prompts left out whose client left before the answer ended (a CPT server "
                 "does not train on them)")
    if counts.without_prompt:
        said += (f"; {counts.without_prompt} requests left out whose prompt the ledger does not hold as the client "
                 "wrote it (sent as token ids, or cut by truncate_prompt_tokens)")
    return said


def export_feedback(args: argparse.Namespace) -> int:
    """`alchemist feedback export`: the ledger's rows as JSONL (the server may be running)."""
    from trainer.export import ExportError, export_rows, parse_since, write_jsonl
    from trainer.ledger_db import LEDGER_FILE, read_ledger

    try:
        rows = read_ledger(Path(args.adapter_dir) / LEDGER_FILE)
        dataset, counts = export_rows(rows, args.format, parse_since(args.since), args.style,
                                      args.include_quarantined, args.drop_truncated)
    except (ExportError, FileNotFoundError) as exc:
        print(f"alchemist: {exc}", file=sys.stderr)
        return 2
    if not counts.rows:  # an empty JSONL file is not a dataset `datasets` loads: nothing is written
        if counts.truncated and args.drop_truncated:
            print(f"alchemist: {counts.truncated} rows hold a served answer cut short (by max_tokens, a stop the "
                  f"client gave, or a disconnect): left out (--drop-truncated){_left_out(counts)}", file=sys.stderr)
        elif counts.selected:
            print(f"alchemist: {counts.selected} requests, none with rows in this format: DPO labels and rewarded "
                  "groups export as preference or unpaired rows, what a CPT server served and rewarded samples as "
                  f"prompt-completion rows, what it trains on as language-modeling rows{_left_out(counts)}",
                  file=sys.stderr)
        elif not _left_out(counts):
            print("alchemist: no request in the ledger passed the filters (--since; quarantined labels need "
                  "--include-quarantined)", file=sys.stderr)
        else:
            print(f"alchemist: no rows{_left_out(counts)}", file=sys.stderr)
        print(f"alchemist: no rows: {args.out or 'standard output'} not written", file=sys.stderr)
        return 1
    try:
        if args.out:
            write_jsonl(args.out, dataset)
        else:
            sys.stdout.write("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in dataset))
    except OSError as exc:
        print(f"alchemist: cannot write {args.out or 'standard output'}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    print(f"alchemist: wrote {counts.rows} {args.format} rows to {args.out or 'standard output'}{_left_out(counts)}",
          file=sys.stderr)
    if counts.truncated:
        done = "left out" if args.drop_truncated else "written (TRL ends each completion with the end of turn, so " \
            "they teach to stop where the model did not: --drop-truncated leaves them out)"
        print(f"alchemist: {counts.truncated} rows hold a served answer cut short (by max_tokens, a stop the "
              f"client gave, or a disconnect): {done}", file=sys.stderr)
    return 0
