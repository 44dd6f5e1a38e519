"""The feedback ledger as datasets: JSONL rows in TRL's dataset formats
(`alchemist feedback export`), which `datasets.load_dataset("json", data_files=…)` feeds
to TRL's trainers unchanged.

  preference         {prompt, chosen, rejected}: every DPO label; and for a rewarded group,
                     its best sample against each sample rewarded lower whose text
                     differs (DPOTrainer, RewardTrainer)
  unpaired           {prompt, completion, label}: a rewarded sample by the sign of its
                     advantage (its reward minus the group's mean; zero: left out), and
                     each side of a DPO label (KTOTrainer)
  prompt-completion  {prompt, completion}: what a CPT server served; a rewarded sample
                     with its `reward` and its group's `group_id` (the request's id) as
                     extra columns (SFTTrainer; TRL's GRPOTrainer samples its own
                     completions, so rewards travel as data)
  language-modeling  {text} or {messages}: what a CPT server trains on, each request's
                     prompt (SFTTrainer, a loss on every token, as CPT's; TRL renders
                     messages without the generation prompt that opened the answer),
                     but one whose client left before its answer ended

A request from `/v1/chat/completions` gives conversational rows (`prompt` the message list
the chat template was given, ledger_db.ClientPrompt; each completion one assistant
message); one from `/v1/completions` gives standard rows (plain text). A
request that offered tools has them as a `tools` column (JSON text) where the chat
template renders tools itself, or inside its prompt's messages where the fallback tool
prompt rendered them: either way TRL renders the prompt that was served. What a request
gave its chat template besides (vLLM's `chat_template_kwargs`) is TRL's column of that
name, on every row once any row has one (`{}` where a request gave none).
One file holds one style: `style` picks it when the ledger holds both. Quarantined labels
are left out unless asked for; then every row has a `quarantined` column (true for a
quarantined label's rows), so that one filter tells them apart. A served answer cut short
(by `max_tokens`, by a stop string or stop token the client gave, or by a client that went
away) is exported as served, but
counted (`ExportCounts.truncated`), and left out on request: TRL ends every completion
with the end of turn, so such a row teaches to stop where the model did not. A request
whose prompt the ledger does not hold as the client wrote it
(`truncate_prompt_tokens` cut it), or whose prompt ends with an assistant message (TRL
renders such a prompt as continued and the completion as a turn of its own: not what was
served, with `continue_final_message` or without), or, in a format with completions, whose
chat template opened no assistant's turn after a prompt that does not end with one
(`add_generation_prompt: false`; TRL opens it before a completion), is left out and counted. A file is written whole or not at all
(`write_jsonl`).
"""

from __future__ import annotations

import datetime
import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from trainer.ledger_db import ChoiceRecord, LedgerRow

FORMATS = ("preference", "unpaired", "prompt-completion", "language-modeling")
# finish reasons of an answer cut short: by max_tokens, or by a client that went away (and "stop"
# with a stop_reason: the client's stop string or token, not the model's end of turn)
CUT_SHORT = ("length", "abort")
STYLES = ("auto", "conversational", "standard")


class ExportError(ValueError):
    """The selection cannot be written as one dataset (say how to narrow it)."""


@dataclass(frozen=True)
class ExportCounts:
    rows: int = 0
    # requests with rows in this format left out: of the other style
    skipped: int = 0
    # and without a prompt as the client wrote it (truncate_prompt_tokens cut it)
    without_prompt: int = 0
    # and chat requests whose prompt ends with an assistant message (TRL renders such a prompt
    # as continued and the completion as a turn of its own, neither what was served), or with a
    # system or developer message (TRL refuses it)
    continuing: int = 0
    # and chat requests served without the assistant's turn opened (`add_generation_prompt: false`)
    # after a prompt that does not end with one: TRL opens it, so its prompt is not what was served
    without_generation_prompt: int = 0
    # requests that passed the filters (time, quarantine) and the style, whatever the format made of them
    selected: int = 0
    # rows with a served answer cut short (left out with `drop_truncated`, written otherwise)
    truncated: int = 0
    # language-modeling: CPT prompts left out whose client left before the answer ended (not trained on)
    abandoned: int = 0


def parse_since(text: str | None) -> float | None:
    """An ISO-8601 date or time (naive: UTC) as a unix time; ExportError if malformed."""
    if text is None:
        return None
    try:
        moment = datetime.datetime.fromisoformat(text)
    except ValueError:
        raise ExportError(f"--since {text!r} is not an ISO-8601 date or time (e.g. 2026-11-24 or "
                          "2026-11-24T09:30:00+01:00)") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.timezone.utc)
    return moment.timestamp()


def export_rows(rows: list[LedgerRow], format: str, since: float | None = None, style: str = "auto",
                include_quarantined: bool = False, drop_truncated: bool = False) -> tuple[list[dict], ExportCounts]:
    """The dataset rows of `format` made from the ledger's `rows` (labelled or served
    after `since`, a unix time)."""
    if format not in FORMATS:
        raise ExportError(f"format must be one of {FORMATS}, got {format!r}")
    if style not in STYLES:
        raise ExportError(f"style must be one of {STYLES}, got {style!r}")
    chosen = [row for row in rows if _selected(row, since, include_quarantined)]
    # the requests this format makes rows of, whose style decides (an unlabelled request of the other makes none)
    producing = [row for row in chosen if next(_FORMATTERS[format](row), None) is not None]
    styles = {_style(row) for row in producing} - {None}
    if style == "auto" and len(styles) > 1:
        raise ExportError("the ledger holds chat requests (conversational rows) and text completions (standard "
                          "rows); one dataset holds one style: pass --style conversational or --style standard")
    wanted = style if style != "auto" else next(iter(styles), "conversational")
    # a language-modeling row is the prompt alone, which TRL renders without the turn opened
    unopened = (lambda row: False) if format == "language-modeling" else _unopened
    kept = [row for row in chosen if _style(row) == wanted and not _continues(row) and not unopened(row)]
    # TRL hands a row's `chat_template_kwargs` and `tools` to the template: every row has them if any has
    with_kwargs = any(row.request.chat_template_kwargs for row in kept)
    with_tools = any(row.request.tools for row in kept)
    out, truncated = [], 0
    for row in kept:
        extra = {"tools": json.dumps(row.request.tools) if row.request.tools else None} if with_tools else {}
        if with_kwargs:
            extra["chat_template_kwargs"] = row.request.chat_template_kwargs or {}
        if include_quarantined:
            extra["quarantined"] = row.fate == "quarantined"
        for made, cut in _FORMATTERS[format](row):
            truncated += cut
            if not (cut and drop_truncated):
                out.append({**made, **extra})
    left_out = [_style(row) for row in producing if _style(row) != wanted]
    wanted_rows = [row for row in producing if _style(row) == wanted]
    abandoned = sum(format == "language-modeling" and row.request.method == "cpt" and _abandoned(row) for row in kept)
    return out, ExportCounts(len(out), sum(s is not None for s in left_out), left_out.count(None),
                             continuing=sum(map(_continues, wanted_rows)), selected=len(kept), truncated=truncated,
                             without_generation_prompt=sum(map(unopened, wanted_rows)), abandoned=abandoned)


def _selected(row: LedgerRow, since: float | None, include_quarantined: bool) -> bool:
    if row.fate == "quarantined" and not include_quarantined:
        return False
    moment = row.label_created_at if row.label is not None else row.request.served_at
    return since is None or moment >= since


def _style(row: LedgerRow) -> str | None:
    prompt = row.request.prompt
    if isinstance(prompt, list):
        return "conversational"
    return "standard" if isinstance(prompt, str) else None


def _continues(row: LedgerRow) -> bool:
    """A chat prompt ending with an assistant message (continued or not, as the request said),
    or with a system or developer message, which TRL's `apply_chat_template` refuses."""
    prompt = row.request.prompt
    return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[-1], dict) \
        and prompt[-1].get("role") in ("assistant", "system", "developer")


def _unopened(row: LedgerRow) -> bool:
    """A chat prompt not ending with an assistant message, served without the assistant's
    turn opened after it (`add_generation_prompt: false`), which TRL would open."""
    return isinstance(row.request.prompt, list) and not row.request.generation_prompt and not _continues(row)


def _completion(row: LedgerRow, text: str):
    return [{"role": "assistant", "content": text}] if _style(row) == "conversational" else text


@dataclass(frozen=True)
class _Answer:
    text: str | None
    # a served answer cut short (CUT_SHORT)
    cut: bool = False


def _cut_short(choice: ChoiceRecord) -> bool:
    """Whether a served answer ended before the model ended its turn."""
    return choice.finish_reason in CUT_SHORT or (choice.finish_reason == "stop" and choice.stop_reason is not None)


def _abandoned(row: LedgerRow) -> bool:
    """A request whose client left before its answer ended (trainer/cache.py does not train on it)."""
    return bool(row.choices) and all(choice.finish_reason == "abort" for choice in row.choices)


def _served(row: LedgerRow, index: int | None) -> _Answer:
    choice = next((c for c in row.choices if c.index == (index or 0)), None)
    return _Answer(None) if choice is None else _Answer(choice.text, _cut_short(choice))


def _preference_answers(row: LedgerRow) -> tuple[_Answer, _Answer]:
    """(chosen, rejected) of a DPO label: as sent, or the served choices named."""
    label = row.label
    if label.chosen_index is not None:
        return _served(row, label.chosen_index), _served(row, label.rejected_index)
    chosen = _Answer(label.chosen) if label.chosen is not None else _served(row, label.choice_index)
    rejected = _Answer(label.rejected) if label.rejected is not None else _served(row, label.choice_index)
    return chosen, rejected


def _rewarded(row: LedgerRow) -> list[tuple[_Answer, float]]:
    """(answer, reward) of each sample of a rewarded group, in choice order."""
    if row.label is None or row.label.kind != "rewards":
        return []
    indices = {c.index for c in row.choices}
    return [(_served(row, i), r) for i, r in enumerate(row.label.rewards) if i in indices]


# each formatter yields (a dataset row, whether it holds a served answer cut short)
def _preference(row: LedgerRow) -> Iterator[tuple[dict, bool]]:
    if row.label is not None and row.label.kind == "preference":
        chosen, rejected = _preference_answers(row)
        if None not in (chosen.text, rejected.text):
            yield {"prompt": row.request.prompt, "chosen": _completion(row, chosen.text),
                   "rejected": _completion(row, rejected.text)}, chosen.cut or rejected.cut
    samples = _rewarded(row)
    if samples:
        best_answer, best = max(samples, key=lambda s: s[1])
        for answer, reward in samples:
            if reward < best and answer.text != best_answer.text:  # equal texts: a pair that teaches nothing
                yield {"prompt": row.request.prompt, "chosen": _completion(row, best_answer.text),
                       "rejected": _completion(row, answer.text)}, best_answer.cut or answer.cut


def _unpaired(row: LedgerRow) -> Iterator[tuple[dict, bool]]:
    if row.label is not None and row.label.kind == "preference":
        for answer, desirable in zip(_preference_answers(row), (True, False)):
            if answer.text is not None:
                yield {"prompt": row.request.prompt, "completion": _completion(row, answer.text),
                       "label": desirable}, answer.cut
    samples = _rewarded(row)
    if samples:
        mean = sum(r for _, r in samples) / len(samples)
        for answer, reward in samples:
            if reward != mean:
                yield {"prompt": row.request.prompt, "completion": _completion(row, answer.text),
                       "label": reward > mean}, answer.cut


def _prompt_completion(row: LedgerRow) -> Iterator[tuple[dict, bool]]:
    if row.request.method == "cpt":
        for choice in row.choices:
            yield {"prompt": row.request.prompt, "completion": _completion(row, choice.text)}, _cut_short(choice)
    for answer, reward in _rewarded(row):  # a group's samples share its request's id: advantages are per group
        yield {"prompt": row.request.prompt, "completion": _completion(row, answer.text), "reward": reward,
               "group_id": row.request.id}, answer.cut


def _language_modeling(row: LedgerRow) -> Iterator[tuple[dict, bool]]:
    if row.request.method == "cpt" and not _abandoned(row):
        yield {"messages" if _style(row) == "conversational" else "text": row.request.prompt}, False


_FORMATTERS = {"preference": _preference, "unpaired": _unpaired, "prompt-completion": _prompt_completion,
               "language-modeling": _language_modeling}


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Writes `rows` as JSONL at `path` through a temporary file, fsynced and renamed into
    place with the mode of the file it replaces: a kill midway leaves the file that was
    there, never half a dataset. A path that is not a regular file (`/dev/stdout`, a
    pipe) is written as it is."""
    path = Path(path)
    lines = (json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    if path.exists() and not path.is_file():
        with open(path, "w", encoding="utf-8") as out:
            out.writelines(lines)
        return
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as out:
            if path.exists():
                os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
            out.writelines(lines)
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
