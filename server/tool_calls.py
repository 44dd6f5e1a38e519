"""Tool calls out of a chat completion: what a request allows (`ToolUse`), the grammar that
forces a call when `tool_choice` is `required` or names a function, and the parser that
splits a choice's text, as it streams, into content and calls.

The convention is Hermes's (Qwen2.5, Hermes, and the fallback prompt in
server/tool_prompt.py): each call is a JSON object `{"name": ..., "arguments": {...}}`
between `<tool_call>` and `</tool_call>`. A forced call is decoded under a grammar, so its
name is one offered and its arguments validate against that function's parameters; with
`auto` the model may write a call or text, and a block that does not parse as a call
stays in the text.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Callable

from engine.structured import JSON_LAYOUT, Grammar, lark_grammar

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# OpenAI's rule for function names
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolUse:
    """The tools a chat request offers and what it asks of them.

    functions: OpenAI's function definitions (`name`, `description`, `parameters`);
    choice: "auto" (text or calls), "required" (at least one call) or "named" (one call
    of `named`); parallel: whether a forced answer may hold more than one call.
    """

    functions: list[dict]
    choice: str = "auto"
    named: str | None = None
    parallel: bool = True

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "named")

    def grammar(self, open_token_id: int | None = None) -> Grammar | None:
        """For a forced choice, calls and nothing else, each valid against its function's
        parameters; `open_token_id`: `<tool_call>` is this one special token (as in Qwen)."""
        if not self.forced:
            return None
        offered = [f for f in self.functions if self.choice == "required" or f["name"] == self.named]
        schema = {"anyOf": [_call_schema(f) for f in offered], "x-guidance": JSON_LAYOUT}
        opening = f"<[{open_token_id}]>" if open_token_id is not None else json.dumps(TOOL_CALL_OPEN)
        calls = 'call ("\\n" call)*' if self.choice == "required" and self.parallel else "call"
        text = (f"start: {calls}\n"
                f"call: {opening} \"\\n\" %json {json.dumps(schema)} \"\\n{TOOL_CALL_CLOSE}\"")
        return lark_grammar(text, "tools", "tool_call")


def _call_schema(function: dict) -> dict:
    parameters = function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


class ToolCallParser:
    """Splits one choice's text into content and tool calls, fed as it streams.

    Text that might still open a call is held back; a call is handed out when its closing
    tag arrives (a call left open when the output ends is parsed at `finish`, which then
    calls `on_finish` with the parser, e.g. to count its calls). Whitespace
    is handed out only once text follows it, so the blank lines around calls are not
    content. Feeding the whole text at once gives what streaming it gives.
    """

    def __init__(self, on_finish: Callable[[ToolCallParser], None] | None = None):
        self._on_finish = on_finish
        self._pending = ""
        self._inside = False
        self._held_space = ""
        self.calls: list[ToolCall] = []
        # <tool_call> blocks that did not parse as a call (left in the content)
        self.invalid_blocks = 0

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._pending += text
        content, calls = [], []
        while True:
            if self._inside:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end == -1:
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                self._close(body, True, content, calls)
            else:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start == -1:
                    keep = _partial_open_length(self._pending)
                    content.append(self._text(self._pending[:len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._text(self._pending[:start]))
                self._held_space = ""
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._inside = True
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """What is left when the output ends."""
        content, calls = [], []
        if self._inside:
            self._close(self._pending, False, content, calls)
        else:
            content.append(self._text(self._pending))
        self._pending, self._inside = "", False
        self.calls += calls
        if self._on_finish is not None:
            self._on_finish(self)
        return "".join(content), calls

    def _close(self, body: str, closed: bool, content: list[str], calls: list[ToolCall]) -> None:
        """A call's body, as a call if it parses, else as the text it was (an unclosed
        body may end in part of the closing tag)."""
        call = _parse_call(body.strip() if closed else _without_partial_close(body).strip())
        if call is not None:
            calls.append(call)
        else:
            self.invalid_blocks += 1
            content.append(self._text(TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")))

    def _text(self, text: str) -> str:
        """`text` preceded by the whitespace held so far, minus its own trailing whitespace (held)."""
        if not text:
            return ""
        text = self._held_space + text
        stripped = text.rstrip()
        self._held_space = text[len(stripped):]
        return stripped


def _partial_open_length(text: str, tag: str = TOOL_CALL_OPEN) -> int:
    """The length of the longest end of `text` that begins `tag`."""
    for length in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-length:]):
            return length
    return 0


def _without_partial_close(body: str) -> str:
    return body[:len(body) - _partial_open_length(body, TOOL_CALL_CLOSE)]
