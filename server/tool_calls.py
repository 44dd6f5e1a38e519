"""Tool calls out of a chat completion: what a request allows (`ToolUse`), the grammar that
forces a call when `tool_choice` is `required` or names a function, and the parser that
splits a choice's text, as it streams, into content and calls.

The convention is Hermes's (Qwen2.5, Hermes, and the fallback prompt in
server/tool_prompt.py): each call is a JSON object `{"name": ..., "arguments": {...}}`
between `<tool_call>` and `</tool_call>`. A forced call is decoded under a grammar, so its
name is one offered and its arguments validate against that function's parameters; with
`auto` the model may write a call or text, and a block that does not parse as a call
stays in the text (under a `response_format`, one grammar allows its JSON or calls).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Callable

from engine.structured import JSON_LAYOUT, Grammar, lark_grammar

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
# OpenAI's rule for function names
NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's shape)
    id: str = field(default_factory=new_call_id)

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of a choice's `index`-th tool call, as a stream sends it: the first piece
    carries the call's id and name, the next ones more of its arguments."""

    index: int
    arguments: str
    id: str | None = None
    name: str | None = None

    def as_openai(self) -> dict:
        delta: dict = {"index": self.index, "function": {"arguments": self.arguments}}
        if self.id is not None:
            delta.update(id=self.id, type="function")
            delta["function"] = {"name": self.name, "arguments": self.arguments}
        return delta


@dataclass
class _OpenCall:
    """A call whose name is known and whose arguments are being streamed."""

    id: str
    name: str
    arguments_start: int  # where the arguments begin in the call's body
    sent: str = ""


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

    @property
    def forced_names(self) -> tuple[str, ...]:
        """The functions a forced call may name (none unless a call is forced)."""
        if not self.forced:
            return ()
        return tuple(f["name"] for f in self.functions if self.choice == "required" or f["name"] == self.named)

    def grammar(self, open_token_id: int | None = None, text: tuple[dict, str] | None = None) -> Grammar | None:
        """For a forced choice, calls and nothing else, each valid against its function's
        parameters; with `auto` and `text` (the JSON schema `response_format` asks of a text
        answer, and its kind), that JSON or calls, as OpenAI lets a model answer either way.
        `open_token_id`: `<tool_call>` is this one special token (as in Qwen)."""
        if not self.forced and text is None:
            return None
        offered = [f for f in self.functions if self.choice != "named" or f["name"] == self.named]
        parameters = {f"f{i}": rerooted(_parameters(f), f"#/$defs/f{i}") for i, f in enumerate(offered)}
        schema = {"$defs": parameters, "anyOf": [_call_schema(f, f"#/$defs/f{i}") for i, f in enumerate(offered)],
                  "x-guidance": JSON_LAYOUT}
        opening = f"<[{open_token_id}]>" if open_token_id is not None else json.dumps(TOOL_CALL_OPEN)
        calls = 'call ("\\n" call)*' if self.choice != "named" and self.parallel else "call"
        call = f"call: {opening} \"\\n\" %json {json.dumps(schema)} \"\\n{TOOL_CALL_CLOSE}\""
        if self.forced:
            return lark_grammar(f"start: {calls}\n{call}", "tools", "tool_call")
        answer, kind = text
        return lark_grammar(f"start: answer | calls\nanswer: %json {json.dumps({'x-guidance': JSON_LAYOUT, **answer})}\n"
                            f"calls: {calls}\n{call}", "response_format", kind)


def _parameters(function: dict) -> dict:
    return function.get("parameters") or {"type": "object", "properties": {}, "additionalProperties": False}


def _call_schema(function: dict, parameters_ref: str) -> dict:
    return {"type": "object",
            "properties": {"name": {"const": function["name"]}, "arguments": {"$ref": parameters_ref}},
            "required": ["name", "arguments"], "additionalProperties": False}


# keywords whose values are data, not schemas: a `$ref` inside them is not a reference
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def rerooted(schema, root: str):
    """`schema` to be placed at the JSON pointer `root` of another document: its references
    into itself (`#`, `#/$defs/…`, `#/definitions/…`) point below `root`; a subschema with
    an `$id` of its own is a resource its references resolve in, and stays as it is."""
    if isinstance(schema, list):
        return [rerooted(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    resource = schema.get("$id")
    if isinstance(resource, str) and not resource.startswith("#"):  # its references resolve against its own $id
        return schema
    moved = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and (value == "#" or value.startswith("#/")):
            moved[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            moved[key] = value
        elif key in _SCHEMA_MAPS and isinstance(value, dict):  # its keys are names, each value a schema
            moved[key] = {name: rerooted(sub, root) for name, sub in value.items()}
        else:
            moved[key] = rerooted(value, root)
    return moved


# a call's body in the layout the fallback prompt and the forced grammar write
_CALL_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')
# the name in a body cut before its arguments: as much of it as was written, and its closing quote if written
_CUT_NAME = re.compile(r'\s*\{\s*"name"\s*:\s*"([a-zA-Z0-9_-]*)(")?')


def _parse_call(body: str) -> ToolCall | None:
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # (nested past Python's recursion limit: no call of ours)
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            return None
    if not isinstance(arguments, dict):
        return None
    raw = _raw_arguments(body)
    if raw is not None and json.loads(raw) == arguments:
        return ToolCall(value["name"], raw)  # as written (and as streamed)
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _raw_arguments(body: str) -> str | None:
    """The arguments' text in a body laid out `{"name": ..., "arguments": {...}}`."""
    head = _CALL_HEAD.match(body)
    if head is None:
        return None
    raw = _sendable_arguments(body[head.end():])
    try:
        json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return raw


def _sendable_arguments(text: str) -> str:
    """Of arguments streaming in, what cannot change: without the end that may still be
    the object's closing brace (with its spaces) or the start of the closing tag."""
    text = text[:len(text) - _partial_open_length(text, TOOL_CALL_CLOSE)].strip()
    if text.endswith("}"):
        text = text[:-1].rstrip()
    return text


class ToolCallParser:
    """Splits one choice's text into content and tool calls, fed as it streams.

    `feed` and `finish` return the new content and the new `ToolCallDelta`s. Text that
    might still open a call is held back. A call is handed out whole when its closing tag
    arrives, or, with `stream_arguments` (forced calls, whose layout the grammar fixes),
    as soon as its name is decoded and then argument by argument; a call left open when
    the output ends is parsed at `finish` (a streamed one is then handed out as far as it
    got, as OpenAI does when `max_tokens` cuts a call). `forced_names`: the output is a
    forced call's (its grammar wrote every character), naming one of these functions; none
    of it is content, and a call cut before its arguments began is still handed out, with
    empty arguments, once its name is certain (always, for a named `tool_choice`).
    `named`: the call is forced by a `tool_choice` that names its function; such an answer
    ends with finish reason "stop", not "tool_calls", as OpenAI's does.
    `parallel`: False keeps the first call alone (`parallel_tool_calls: false`; a forced
    call's grammar writes one only), as vLLM does.
    `finish` calls `on_finish` with the parser, e.g. to count its calls. Whitespace is
    handed out only once text follows it, so the blank lines around calls are not content;
    an answer without calls keeps its text whole.
    Feeding the whole text at once gives what streaming it gives: `calls` and the
    concatenated deltas are the same.
    """

    def __init__(self, stream_arguments: bool = False, on_finish: Callable[[ToolCallParser], None] | None = None,
                 forced_names: tuple[str, ...] = (), named: bool = False, parallel: bool = True):
        self._forced_names = tuple(forced_names)
        self.named = named
        self.parallel = parallel
        self._stream_arguments = stream_arguments or bool(self._forced_names)
        self._on_finish = on_finish
        self._pending = ""
        self._inside = False
        self._open: _OpenCall | None = None
        self._held_space = ""
        self._space_before_block = ""
        self.calls: list[ToolCall] = []
        # <tool_call> blocks that did not parse as a call (left in the content)
        self.invalid_blocks = 0

    @property
    def forced(self) -> bool:
        """The output is a forced call's: it has no content."""
        return bool(self._forced_names)

    @property
    def ends_as_tool_calls(self) -> bool:
        """Whether an answer that ended on its own says "tool_calls": it called a tool, and
        not one a `tool_choice` named (OpenAI's answer then says "stop")."""
        return bool(self.calls) and not self.named

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._pending += text
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if self._inside:
                end = self._pending.find(TOOL_CALL_CLOSE)
                if end == -1:
                    self._stream_open_call(deltas)
                    break
                body, self._pending = self._pending[:end], self._pending[end + len(TOOL_CALL_CLOSE):]
                self._inside = False
                self._close(body, True, content, deltas)
            else:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start == -1:
                    keep = _partial_open_length(self._pending)
                    content.append(self._text(self._pending[:len(self._pending) - keep]))
                    self._pending = self._pending[len(self._pending) - keep:]
                    break
                content.append(self._text(self._pending[:start]))
                self._space_before_block, self._held_space = self._held_space, ""  # back if it is no call
                self._pending = self._pending[start + len(TOOL_CALL_OPEN):]
                self._inside = True
        return "".join(content), deltas

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """What is left when the output ends."""
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        if self._inside:
            self._close(self._pending, False, content, deltas)
        elif self._forced_names and self._pending.strip():  # a forced call cut inside its opening tag
            self._close("", False, content, deltas)
        else:
            content.append(self._text(self._pending))
        if not self.calls and not self.forced:  # no calls for the whitespace to surround
            content.append(self._held_space)
            self._held_space = ""
        self._pending, self._inside = "", False
        if self._on_finish is not None:
            self._on_finish(self)
        return "".join(content), deltas

    def _stream_open_call(self, deltas: list[ToolCallDelta]) -> None:
        if self._open is None and self._stream_arguments:
            self._open = self._start(self._pending, deltas)
        if self._open is not None:
            self._send(self._open, _sendable_arguments(self._pending[self._open.arguments_start:]), deltas)

    def _start(self, body: str, deltas: list[ToolCallDelta]) -> _OpenCall | None:
        """Opens a streamed call once its body shows the name (None until then)."""
        head = _CALL_HEAD.match(body)
        if head is None:
            return None
        call = _OpenCall(new_call_id(), head.group(1), head.end())
        deltas.append(ToolCallDelta(len(self.calls), "", call.id, call.name))
        return call

    def _send(self, call: _OpenCall, arguments: str, deltas: list[ToolCallDelta]) -> None:
        """Sends what of `arguments` the call has not sent yet (it extends what was sent)."""
        new = arguments[len(call.sent):]
        if new:
            deltas.append(ToolCallDelta(len(self.calls), new))
            call.sent = arguments

    def _close(self, body: str, closed: bool, content: list[str], deltas: list[ToolCallDelta]) -> None:
        """A call's body: a call if it parses, else the text it was (an unclosed body may
        end in part of the closing tag). A streamed call is a call either way: its
        arguments are what was streamed, whole or as far as they got."""
        if not closed:
            body = _without_partial_close(body)
        opened, self._open = self._open, None
        if opened is None and self._stream_arguments:
            opened = self._start(body, deltas)  # all of it came at once
        if opened is None and not closed and self._forced_names:
            name = self._cut_name(body)
            if name is None:
                return  # cut before its name was certain: no call, and no text (the grammar wrote it)
            opened = _OpenCall(new_call_id(), name, len(body))
            deltas.append(ToolCallDelta(len(self.calls), "", opened.id, opened.name))
        if opened is not None:
            arguments = _sendable_arguments(body[opened.arguments_start:])
            self._send(opened, arguments, deltas)
            self.calls.append(ToolCall(opened.name, arguments, opened.id))
        elif (call := _parse_call(body.strip())) is not None:
            if self.parallel or not self.calls:
                deltas.append(ToolCallDelta(len(self.calls), call.arguments, call.id, call.name))
                self.calls.append(call)
        else:
            self.invalid_blocks += 1
            block = TOOL_CALL_OPEN + body + (TOOL_CALL_CLOSE if closed else "")
            content.append(self._text(self._space_before_block + block))
        self._space_before_block = ""

    def _cut_name(self, body: str) -> str | None:
        """The function a forced call cut before its arguments names: the one offered
        name that what was written of the name begins (or equals, once closed), if one."""
        written = _CUT_NAME.match(body)
        names = self._forced_names
        if written is not None:
            prefix, closed = written.group(1), written.group(2) is not None
            names = tuple(n for n in names if (n == prefix if closed else n.startswith(prefix)))
        return names[0] if len(names) == 1 else None

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
