"""What a client's grammar may be, so that compiling it cannot take the server down.

llguidance compiles a grammar by recursion on the native stack of the thread that asks:
a JSON schema whose `$ref`s chain a thousand definitions, or a Lark grammar of a few
thousand rules each naming the next, overflowed it and killed the whole server with a
segmentation fault (an outside pass, from one request). Such inputs are refused first, with
limits far past what real schemas and grammars use (OpenAI's structured outputs allow ten
levels of nesting) and far below what overflowed. Its error messages, which can carry a
Rust panic's backtrace, are cut to their first line.
"""

from __future__ import annotations

import json
import re

from engine.sampling_params import InvalidParameter

# levels of a schema (each object and array of it), counted through its local `$ref`s; a
# chain of 500 references (1,500 levels) compiled on an 8 MiB stack, 1,000 did not
MAX_SCHEMA_LEVELS = 256
# rules of a Lark or GBNF grammar; a chain of 1,000 compiled on an 8 MiB stack, 3,000 did not
MAX_GRAMMAR_RULES = 500
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(\.-?\d+)?[ \t]*(:|::=)", re.M)
_EMBEDDED_JSON = re.compile(r"%json\s*(?=\{)")


def check_schema_depth(schema, param: str) -> None:
    """Refuses a schema nested deeper than MAX_SCHEMA_LEVELS levels, counting through its
    local `$ref`s (a recursive schema's cycle counts once: llguidance expands it lazily)."""
    heights: dict[int, int] = {}
    on_path: set[int] = set()

    def height(node, depth: int) -> int:
        if not isinstance(node, (dict, list)):
            return 0
        key = id(node)
        if key in heights:
            return heights[key]
        if key in on_path:
            return 0
        if depth > MAX_SCHEMA_LEVELS:
            raise InvalidParameter(param, f"{param} is nested more than {MAX_SCHEMA_LEVELS} levels deep (objects and "
                                   "arrays, through its $refs)")
        on_path.add(key)
        children = list(node.values()) if isinstance(node, dict) else list(node)
        target = _local_target(schema, node.get("$ref")) if isinstance(node, dict) else None
        if target is not None:
            children.append(target)
        heights[key] = 1 + max((height(child, depth + 1) for child in children), default=0)
        on_path.discard(key)
        return heights[key]

    height(schema, 1)


def _local_target(schema, ref):
    """What a `$ref` into `schema` itself (`#`, `#/a/b`) points at; None for any other."""
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        return None
    node = schema
    for part in ref[2:].split("/") if ref != "#" else ():
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_grammar_size(text: str, param: str) -> None:
    """Refuses a Lark or GBNF grammar of more than MAX_GRAMMAR_RULES rules, or one that
    embeds (`%json {...}`) a schema deeper than `check_schema_depth` allows."""
    rules = len(_RULE.findall(text))
    if rules > MAX_GRAMMAR_RULES:
        raise InvalidParameter(param, f"{param} has {rules} rules; at most {MAX_GRAMMAR_RULES} are allowed")
    decoder = json.JSONDecoder()
    for embedded in _EMBEDDED_JSON.finditer(text):
        try:
            schema, _ = decoder.raw_decode(text, embedded.end())
        except (ValueError, RecursionError):
            continue  # not JSON: llguidance says so
        check_schema_depth(schema, param)


def first_line(message: str, limit: int = 500) -> str:
    """An error message from llguidance without a panic's backtrace, and not past `limit`."""
    line = str(message).strip().split("\n", 1)[0]
    return line if len(line) <= limit else line[:limit] + "…"
