"""The eval gate's probes (`--eval-set FILE`, `train.eval_set`): JSONL, one probe per line.

    {"messages": [...] | "prompt": "...", "chosen": "...", "rejected": "..."}   preference probe
    {"messages": [...] | "prompt": "...", "completion": "..."}                   completion probe

A version's score on a preference probe is the log-prob margin of the chosen response
over the rejected one; on a completion probe, the completion's log-prob (nats, summed
over its tokens). Messages are rendered with the tokenizer's chat template as
`/v1/chat/completions` renders them (the responses then end with the end-of-turn token,
as served responses do); a prompt is tokenized as `/v1/completions` tokenizes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trainer.turn_end import chat_turn_end, label_end


class EvalSetError(ValueError):
    """The eval set cannot be used (the message says which line and why)."""


@dataclass(frozen=True)
class Probe:
    prompt_ids: list[int]
    # a preference probe: (chosen, rejected) response token ids; a completion probe: (completion,)
    responses: tuple[list[int], ...]

    @property
    def kind(self) -> str:
        return "preference" if len(self.responses) == 2 else "completion"


def load_eval_set(path: str | Path, tokenizer, max_model_len: int) -> list[Probe]:
    """The probes of the JSONL file at `path`, tokenized; EvalSetError if it is empty or a
    line is malformed or too long."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise EvalSetError(f"train.eval_set {str(path)!r} cannot be read: {exc}") from None
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[:exc.start].count(b"\n") + 1
        raise EvalSetError(f"train.eval_set {path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    probes, turn_end = [], chat_turn_end(tokenizer)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"train.eval_set {path}:{number}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise EvalSetError(f"{where}: not JSON ({exc.msg})") from None
        probe = _probe(record, tokenizer, where, turn_end)
        if len(probe.prompt_ids) + max(len(r) for r in probe.responses) > max_model_len:
            raise EvalSetError(f"{where}: the probe is longer than max_model_len ({max_model_len} tokens)")
        probes.append(probe)
    if not probes:
        raise EvalSetError(f"train.eval_set {path} holds no probes")
    return probes


def _probe(record, tokenizer, where: str, turn_end: int | None) -> Probe:
    if not isinstance(record, dict):
        raise EvalSetError(f"{where}: a probe is a JSON object")
    texts = {k: record.get(k) for k in ("chosen", "rejected", "completion")}
    if texts["completion"] is not None and texts["chosen"] is None and texts["rejected"] is None:
        names = ("completion",)
    elif texts["completion"] is None and texts["chosen"] is not None and texts["rejected"] is not None:
        names = ("chosen", "rejected")
    else:
        raise EvalSetError(f"{where}: a probe has 'chosen' and 'rejected' (preference) or 'completion'")
    if not all(isinstance(texts[n], str) and texts[n] for n in names):
        raise EvalSetError(f"{where}: {' and '.join(repr(n) for n in names)} must be non-empty strings")
    messages, prompt = record.get("messages"), record.get("prompt")
    if (messages is None) == (prompt is None):
        raise EvalSetError(f"{where}: a probe has 'messages' (chat) or 'prompt' (text), one of them")
    if messages is not None:
        if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            raise EvalSetError(f"{where}: 'messages' is a non-empty list of chat messages, each with a 'role'")
        try:
            prompt_ids = list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"])
        except Exception as exc:  # noqa: BLE001 - the template's own errors (jinja2's, ValueError)
            raise EvalSetError(f"{where}: the chat template cannot render these messages: {exc}") from None
        end = label_end(None, prompt_ids, frozenset(), turn_end, tokenizer.eos_token_id)
        responses = tuple(tokenizer(texts[n], add_special_tokens=False)["input_ids"] + end for n in names)
    else:
        if not isinstance(prompt, str) or not prompt:
            raise EvalSetError(f"{where}: 'prompt' must be a non-empty string")
        prompt_ids = tokenizer(prompt)["input_ids"]
        responses = tuple(tokenizer(texts[n], add_special_tokens=False)["input_ids"] for n in names)
    return Probe(prompt_ids, responses)
