"""What a client's grammar may be, and where it compiles, so that compiling it cannot take
the server down.

llguidance compiles a grammar by recursion on the native stack of the thread that asks:
a JSON schema whose `$ref`s chain a thousand definitions, or a Lark grammar of a few
thousand rules each naming the next, overflowed it and killed the whole server with a
segmentation fault (an outside pass, from one request). Such inputs are refused first,
with limits far past what real schemas and grammars use (OpenAI's structured outputs allow
ten levels of nesting), and requests' grammars compile on threads of their own whose stack
is many times what the largest input the limits let through needs. llguidance's error
messages, which can carry a Rust panic's backtrace, are cut to their first line.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import json
import re
import threading
from urllib.parse import unquote

from engine.sampling_params import InvalidParameter

# levels of a schema (each object and array of it), counted through its `$ref`s; the most
# these limits let through compiles even on a 2 MiB stack, glibc's default for a thread under
# `ulimit -s unlimited` (BENCHMARKS.md, "Outside passes with agent libraries, a new user and
# an attacker")
MAX_SCHEMA_LEVELS = 256
# rules of a grammar, as llguidance compiles it (Lark; GBNF is converted first)
MAX_GRAMMAR_RULES = 500
# the stack of the threads requests' grammars compile on
COMPILE_STACK_BYTES = 64 << 20
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w-]*(\.-?\d+)?[ \t]*(:|::=)", re.M)
_EMBEDDED_JSON = re.compile(r"%json\s*(?=\{)")


def check_schema_depth(schema, param: str) -> None:
    """Refuses a schema nested deeper than MAX_SCHEMA_LEVELS levels, counting through its
    `$ref`s (a recursive schema's cycle counts once: llguidance expands it lazily), or one
    with a `$ref` this cannot follow (to another document, or by a URI no `$id` here names)."""
    targets = _ReferenceTargets(schema, param)
    heights: dict[int, int] = {}
    on_path: set[int] = set()

    def too_deep():
        return InvalidParameter(param, f"{param} is nested more than {MAX_SCHEMA_LEVELS} levels deep (objects and "
                                "arrays, through its $refs)")

    def height(node, kind: str, depth: int) -> int:
        if not isinstance(node, (dict, list)) or id(node) in on_path:
            return 0
        if id(node) in heights:  # measured on another path: deep here too?
            if depth - 1 + heights[id(node)] > MAX_SCHEMA_LEVELS:
                raise too_deep()
            return heights[id(node)]
        if depth > MAX_SCHEMA_LEVELS:
            raise too_deep()
        on_path.add(id(node))
        children = list(_children(node, kind))
        if kind == "schema" and isinstance(node, dict) and "$ref" in node:
            children.append((targets.of(node), "schema"))
        heights[id(node)] = 1 + max((height(child, of, depth + 1) for child, of in children), default=0)
        on_path.discard(id(node))
        return heights[id(node)]

    height(schema, "schema", 1)


# keywords whose values are data, not schemas (a `$ref` in them is no reference), and those
# whose values map names to schemas (a name may be "$ref" or "$id")
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def _children(node, kind: str):
    """(child, its kind) of a node of `kind`: "schema", "map" (of names to schemas) or "data"."""
    if isinstance(node, list):
        return ((child, kind) for child in node)
    if kind != "schema":
        return ((child, "data" if kind == "data" else "schema") for child in node.values())
    return ((child, "data" if key in _DATA_KEYWORDS else "map" if key in _SCHEMA_MAPS and isinstance(child, dict)
             else "schema") for key, child in node.items())


class _ReferenceTargets:
    """Where a schema's `$ref`s point: JSON pointers and anchors within the resource they
    are written in (the root, or a subschema with an `$id`), or within a resource another
    `$ref` names by its `$id`."""

    def __init__(self, schema, param: str):
        self.param, self.root = param, schema
        self.resource_of: dict[int, object] = {}
        self.by_id: dict[str, object] = {}
        self.anchors: dict[tuple[int, str], object] = {}
        stack = [(schema, "schema", schema)]
        while stack:
            node, kind, resource = stack.pop()
            if kind == "schema" and isinstance(node, dict):
                if isinstance(node.get("$id"), str) and not node["$id"].startswith("#"):
                    resource = node
                    self.by_id[node["$id"].rstrip("#")] = node
                if isinstance(node.get("$anchor"), str):
                    self.anchors[(id(resource), node["$anchor"])] = node
                self.resource_of[id(node)] = resource
            if isinstance(node, (dict, list)):
                stack.extend((child, of, resource) for child, of in _children(node, kind))

    def of(self, node: dict):
        ref = node["$ref"]
        base, _, fragment = ref.partition("#") if isinstance(ref, str) else ("", "", "")
        resource = self.resource_of.get(id(node), self.root) if not base else self.by_id.get(base)
        target = None if resource is None or not isinstance(ref, str) else \
            _pointed(resource, fragment) if not fragment or fragment.startswith("/") else \
            self.anchors.get((id(resource), fragment))
        if target is None:
            raise InvalidParameter(self.param, f"{self.param} has a $ref this server cannot follow: {str(ref)[:100]!r} "
                                   "(refer within the schema: '#', '#/$defs/…', or an $anchor or $id it defines)")
        return target


def _pointed(resource, pointer: str):
    node = resource
    for part in pointer[1:].split("/") if pointer else ():
        part = unquote(part).replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def check_grammar_size(text: str, param: str) -> None:
    """Refuses a Lark or GBNF grammar of more than MAX_GRAMMAR_RULES rules, or one that
    embeds (`%json {...}`) a schema `check_schema_depth` refuses. Asked of the client's text
    (llguidance's GBNF converter, in Python, took 80 s over 10,000 rules) and of the Lark
    it compiles."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")  # (GBNF's converter takes a lone \r for a line's end)
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


_compile_pool: concurrent.futures.ThreadPoolExecutor | None = None
_compile_pool_lock = threading.Lock()


def compile_pool(workers: int = 2) -> concurrent.futures.ThreadPoolExecutor:
    """The threads requests' grammars compile on, each with a COMPILE_STACK_BYTES stack
    (made at the first use, every thread at once: a thread's stack is fixed when it starts)."""
    global _compile_pool
    with _compile_pool_lock:
        if _compile_pool is None:
            started = threading.Barrier(workers + 1)
            previous = threading.stack_size(COMPILE_STACK_BYTES)
            try:
                pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="alchemist-grammar")
                for _ in range(workers):  # each waits for the others: the pool starts all its threads now
                    pool.submit(started.wait)
                started.wait()
            finally:
                threading.stack_size(previous)
            _compile_pool = pool
        return _compile_pool


async def on_compile_threads(work, *args, **kwargs):
    """`work(*args, **kwargs)` on `compile_pool`'s threads, awaited on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(compile_pool(), functools.partial(work, *args, **kwargs))
