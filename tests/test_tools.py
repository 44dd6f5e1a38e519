"""Tool calling over the real app, on a tiny random model (whose template has no tool
section, so the fallback prompt is used): forced calls always name an offered function
and validate against its parameters; `auto` parses the calls a model writes; streaming
sends OpenAI's tool-call deltas; the OpenAI SDK and LangChain use it as they use OpenAI."""

import json

import jsonschema
import pytest
from fastapi.testclient import TestClient

from engine.structured import GrammarCompiler
from server.tool_calls import ToolCallParser, ToolUse, rerooted
from server.tool_prompt import FALLBACK_PROMPT, fallback_messages, native_messages
from tests.servers import TINY_NAME, ServerThread, long_context_app
from tests.tiny import tiny_tokenizer

WEATHER = {"name": "get_weather", "description": "The weather in a city.", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False}}
TIME = {"name": "get_time", "parameters": {
    "type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": TIME}]
SCHEMAS = {f["name"]: f["parameters"] for f in (WEATHER, TIME)}
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def client():
    with TestClient(long_context_app()) as c:
        yield c


def chat(client, **body):
    return client.post("/v1/chat/completions", json={"model": TINY_NAME, "messages": QUESTION, "tools": TOOLS,
                                                     "max_tokens": 160, **body})


def assert_valid_call(call: dict, names=("get_weather", "get_time")) -> None:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] in names
    jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


# -- forced calls --------------------------------------------------------------------------

def test_required_gives_one_valid_call_without_parallel_calls(client):
    r = chat(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=2, n=3)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "tool_calls", choice
        assert choice["message"]["content"] is None
        assert len(choice["message"]["tool_calls"]) == 1
        assert_valid_call(choice["message"]["tool_calls"][0])


PAINT = {"name": "paint", "parameters": {  # references as pydantic writes them, and one as older tools do
    "$defs": {"Color": {"enum": ["red", "green"]}},
    "definitions": {"Point": {"type": "object", "properties": {"x": {"type": "integer", "maximum": 9}},
                              "required": ["x"], "additionalProperties": False}},
    "type": "object", "properties": {"color": {"$ref": "#/$defs/Color"}, "at": {"$ref": "#/definitions/Point"},
                                     "$ref": {"const": {"$ref": "#"}}},
    "required": ["color", "at"], "additionalProperties": False}}
TREE = {"name": "tree", "parameters": {  # recursive: "#" is the parameters' own root
    "type": "object", "properties": {"name": {"enum": ["a", "b"]},
                                     "children": {"type": "array", "maxItems": 1, "items": {"$ref": "#"}}},
    "required": ["name", "children"], "additionalProperties": False}}


IDENTIFIED = {"name": "pick", "parameters": {  # a resource of its own: its references resolve against its $id
    "$id": "https://example.com/pick", "$defs": {"A": {"enum": ["x", "y"]}}, "type": "object",
    "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"], "additionalProperties": False}}


@pytest.mark.parametrize("function", [PAINT, TREE, IDENTIFIED], ids=["defs", "recursive", "id"])
def test_a_forced_call_is_valid_against_parameters_that_refer_to_themselves(client, function):
    """`$ref`s resolve against the function's parameters, not the grammar's call wrapper."""
    r = chat(client, tools=[{"type": "function", "function": function}], tool_choice="required",
             parallel_tool_calls=False, temperature=1.0, seed=3, n=4, max_tokens=200)
    assert r.status_code == 200, r.text
    complete = [c for c in r.json()["choices"] if c["finish_reason"] == "tool_calls"]
    assert complete
    for choice in complete:
        call = choice["message"]["tool_calls"][0]
        assert call["function"]["name"] == function["name"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), function["parameters"])


def test_a_schema_moved_below_a_pointer_keeps_its_data_and_its_foreign_references():
    schema = {"$ref": "#", "properties": {"$ref": {"$ref": "#/$defs/A"}, "const": {"const": {"$ref": "#"}}},
              "$defs": {"enum": {"enum": [{"$ref": "#"}]}, "A": {"$ref": "other.json#/A"}}}
    assert rerooted({"$id": "https://x/p", "$ref": "#/$defs/A"}, "#/$defs/f1") == {"$id": "https://x/p",
                                                                                  "$ref": "#/$defs/A"}
    assert rerooted(schema, "#/$defs/f1") == {
        "$ref": "#/$defs/f1", "properties": {"$ref": {"$ref": "#/$defs/f1/$defs/A"}, "const": {"const": {"$ref": "#"}}},
        "$defs": {"enum": {"enum": [{"$ref": "#"}]}, "A": {"$ref": "other.json#/A"}}}


def test_required_with_parallel_calls_validates_every_call(client):
    r = chat(client, tool_choice="required", temperature=1.0, seed=7, n=3, max_tokens=200)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        calls = choice["message"].get("tool_calls") or []
        assert calls, choice
        complete = calls if choice["finish_reason"] == "tool_calls" else calls[:-1]  # the last one may be cut
        for call in complete:
            assert_valid_call(call)
        if choice["finish_reason"] == "tool_calls":
            assert choice["message"]["content"] is None


def test_a_named_function_is_the_one_called_and_the_answer_ends_as_openai_ends_it(client):
    """A call that `tool_choice` names ends with "stop" (OpenAI's, and vLLM's since it
    aligned), streamed or whole; `required`'s with "tool_calls"."""
    named = {"type": "function", "function": {"name": "get_time"}}
    r = chat(client, tool_choice=named, temperature=1.0, seed=4, n=2)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        (call,) = choice["message"]["tool_calls"]
        assert_valid_call(call, names=("get_time",))
        assert choice["finish_reason"] == "stop"
    content, (call,), finish = streamed_choice(client, tool_choice=named, temperature=1.0, seed=4, max_tokens=160)
    assert (content, call["name"], finish) == ("", "get_time", "stop")
    assert streamed_choice(client, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=4,
                           max_tokens=160)[2] == "tool_calls"


def streamed_choice(client, **body) -> tuple[str, list[dict], str | None]:
    """A streamed chat completion's first choice put together: content, calls, finish reason."""
    content, calls, finish = "", {}, None
    body = {"model": TINY_NAME, "messages": QUESTION, "tools": TOOLS, **body, "stream": True}
    with client.stream("POST", "/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            for choice in json.loads(line[6:])["choices"] if line.startswith("data: {") else []:
                content += choice["delta"].get("content") or ""
                for call in choice["delta"].get("tool_calls") or []:
                    entry = calls.setdefault(call["index"], {"name": "", "arguments": ""})
                    entry["name"] += call["function"].get("name") or ""
                    entry["arguments"] += call["function"]["arguments"]
                finish = choice["finish_reason"] or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("max_tokens", [4, 16, 60])
def test_a_forced_call_cut_by_max_tokens_is_returned_as_far_as_it_got(client, max_tokens):
    """Never its markup as content: the named call, with the arguments decoded so far
    (none while the limit falls before them), streamed or whole."""
    body = {"tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "temperature": 0.0}
    (full,) = chat(client, **body).json()["choices"][0]["message"]["tool_calls"]
    whole = chat(client, **body, max_tokens=max_tokens).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None, whole
    (call,) = whole["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert full["function"]["arguments"].startswith(call["function"]["arguments"])
    assert (max_tokens > 16) == bool(call["function"]["arguments"])  # at 60 tokens the arguments have begun
    content, calls, finish = streamed_choice(client, **body, max_tokens=max_tokens)
    assert (content, finish) == ("", "length")
    assert calls == [{"name": "get_weather", "arguments": call["function"]["arguments"]}]


def test_a_required_call_cut_before_its_name_is_certain_is_no_call_and_no_markup(client):
    whole = chat(client, tool_choice="required", temperature=0.0, max_tokens=16).json()["choices"][0]
    assert whole["finish_reason"] == "length" and whole["message"]["content"] is None, whole  # OpenAI's null
    assert "tool_calls" not in whole["message"]
    assert streamed_choice(client, tool_choice="required", temperature=0.0, max_tokens=16) == ("", [], "length")


def test_a_streamed_forced_call_opens_with_null_content_and_a_free_answer_with_empty_content(client):
    """OpenAI's first delta: `content` null where a tool call is forced (the SDK's stream
    helper then sends no content event), "" where the answer may be text."""
    for tool_choice, opening in (("required", None), ("auto", "")):
        body = {"model": TINY_NAME, "messages": QUESTION, "tools": TOOLS, "tool_choice": tool_choice,
                "max_tokens": 4, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            first = json.loads(next(line for line in r.iter_lines() if line.startswith("data: {"))[6:])
        assert first["choices"][0]["delta"] == {"role": "assistant", "content": opening}, first


def test_none_offers_no_tools(client):
    with_none = chat(client, tool_choice="none", temperature=0.0, max_tokens=5)
    without = client.post("/v1/chat/completions", json={"model": TINY_NAME, "messages": QUESTION,
                                                         "temperature": 0.0, "max_tokens": 5})
    assert with_none.status_code == 200, with_none.text
    assert with_none.json()["usage"]["prompt_tokens"] == without.json()["usage"]["prompt_tokens"]
    assert "tool_calls" not in with_none.json()["choices"][0]["message"]
    assert with_none.json()["choices"][0]["message"]["content"] == without.json()["choices"][0]["message"]["content"]


# -- auto: calls the model writes -------------------------------------------------------------

WRITTEN = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
           '\n</tool_call>')
# the text as a regex that matches it alone (Rust's syntax)
WRITTEN_REGEX = "".join("\\" + ch if ch in ".^$|?*+()[]{}\\" else ("\\n" if ch == "\n" else ch) for ch in WRITTEN)


def test_auto_parses_the_calls_the_model_writes(client):
    # the model is made to write a call in the Hermes convention (a regex holds it to this text)
    r = chat(client, tool_choice="auto", temperature=0.0, max_tokens=200,
             structured_outputs={"regex": WRITTEN_REGEX})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == "Let me check."
    (call,) = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "unit": "celsius"}
    assert choice["finish_reason"] == "tool_calls"


def test_without_tools_the_same_text_is_content(client):
    r = client.post("/v1/chat/completions", json={
        "model": TINY_NAME, "messages": QUESTION, "max_tokens": 200, "temperature": 0.0,
        "structured_outputs": {"regex": WRITTEN_REGEX}})
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == WRITTEN and "tool_calls" not in choice["message"]
    assert choice["finish_reason"] == "stop"


ANSWER = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}}


def opening_bias(text: str) -> dict:
    """A logit bias that makes the tiny model open its answer with `text`'s first token."""
    return {str(tiny_tokenizer()(text, add_special_tokens=False)["input_ids"][0]): 100}


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_a_forced_call_with_a_response_format_is_the_call(client, tool_choice):
    """OpenAI's Agents SDK sends an agent's `output_type` as `response_format` beside a forced
    `tool_choice` (an outside pass: it was a 400); the format shapes a later turn's text."""
    r = chat(client, tool_choice=tool_choice, response_format=ANSWER, temperature=1.0, seed=3, n=3)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["message"]["content"] is None and choice["message"]["tool_calls"], choice
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] in SCHEMAS
            if choice["finish_reason"] != "length":  # (a call max_tokens cut is returned as far as it got)
                assert_valid_call(call)


@pytest.mark.parametrize("opening, called", [("<tool_call>", True), ("{", False)])
def test_auto_with_a_response_format_answers_the_formats_json_or_calls(client, opening, called):
    """With `auto`, a model under `response_format` may still call a tool, as OpenAI's may (the
    Agents SDK's `output_type` with tools, pydantic-ai's NativeOutput with a tool: the format's
    grammar alone let no call begin). The tiny model is steered to either opening."""
    r = chat(client, tool_choice="auto", response_format=ANSWER, temperature=1.0, seed=4, n=4,
             logit_bias=opening_bias(opening))
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        message = choice["message"]
        if called:
            assert message["content"] is None and choice["finish_reason"] in ("tool_calls", "length"), choice
            assert message["tool_calls"][0]["function"]["name"] in ("get_weather", "get_time")
            if choice["finish_reason"] == "tool_calls":
                for call in message["tool_calls"]:
                    assert_valid_call(call)
        else:
            assert not message.get("tool_calls") and choice["finish_reason"] in ("stop", "length"), choice
            if choice["finish_reason"] == "stop":
                jsonschema.validate(json.loads(message["content"]), ANSWER["json_schema"]["schema"])


def allowed(mode: str, *names: str) -> dict:
    return {"type": "allowed_tools", "allowed_tools": {
        "mode": mode, "tools": [{"type": "function", "function": {"name": name}} for name in names]}}


def test_allowed_tools_required_calls_only_those_and_auto_offers_only_those(client):
    """OpenAI's `allowed_tools` choice (a 400 before: an outside pass with openai 2.54's types)."""
    r = chat(client, tool_choice=allowed("required", "get_time"), temperature=1.0, seed=5, n=4)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        for call in choice["message"]["tool_calls"]:
            assert call["function"]["name"] == "get_time"
            if choice["finish_reason"] != "length":
                assert_valid_call(call, names=("get_time",))

    def prompt_tokens(tool_choice) -> int:
        return chat(client, tool_choice=tool_choice, max_tokens=1).json()["usage"]["prompt_tokens"]
    only_weather = client.post("/tokenize", json={"model": TINY_NAME, "messages": QUESTION,
                                                  "tools": TOOLS[:1]}).json()["count"]
    assert prompt_tokens(allowed("auto", "get_weather")) == only_weather < prompt_tokens("auto")
    r = chat(client, tool_choice=allowed("auto", "get_time", "get_date"))
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tool_choice.allowed_tools.tools[1]")


# -- streaming and the SDKs -------------------------------------------------------------------

def test_streamed_tool_calls_equal_the_whole_response():
    import openai

    with ServerThread(long_context_app()) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        args = dict(model=TINY_NAME, messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0,
                    max_tokens=120)
        whole = client.chat.completions.create(**args)
        calls: dict[int, dict] = {}
        finish, fragments = None, 0
        for chunk in client.chat.completions.create(stream=True, **args):
            for delta_call in chunk.choices[0].delta.tool_calls or []:
                entry = calls.setdefault(delta_call.index, {"name": "", "arguments": ""})
                entry["name"] += delta_call.function.name or ""
                entry["arguments"] += delta_call.function.arguments or ""
                fragments += bool(delta_call.function.arguments)
            finish = chunk.choices[0].finish_reason or finish
    expected = [{"name": c.function.name, "arguments": c.function.arguments}
                for c in whole.choices[0].message.tool_calls]
    assert [calls[i] for i in sorted(calls)] == expected
    assert finish == whole.choices[0].finish_reason
    assert fragments > 2 * len(expected)  # a forced call's arguments stream as they are decoded


def test_a_tool_round_trip_with_the_openai_sdk():
    """Call, run the tool, hand the result back, get the answer: the SDK's own objects go back in."""
    import openai

    with ServerThread(long_context_app()) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
        messages = list(QUESTION)
        first = client.chat.completions.create(model=TINY_NAME, messages=messages, tools=TOOLS, max_tokens=150,
                                               temperature=0,
                                               tool_choice={"type": "function", "function": {"name": "get_weather"}})
        message = first.choices[0].message
        (call,) = message.tool_calls
        messages.append(message)
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"})
        # as litellm passes a streamed call back: with its index
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"index": 0, "id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}}]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "still sunny"})
        second = client.chat.completions.create(model=TINY_NAME, messages=messages, tools=TOOLS, max_tokens=5)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


def test_langchain_binds_tools_and_structures_outputs():
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel

    class Verdict(BaseModel):
        answer: bool

    with ServerThread(long_context_app()) as server:
        llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model=TINY_NAME, temperature=0,
                         max_tokens=200)
        reply = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
        (call,) = reply.tool_calls
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], WEATHER["parameters"])
        for method in ("json_schema", "function_calling"):
            verdict = llm.with_structured_output(Verdict, method=method).invoke("Is water wet?")
            assert isinstance(verdict, Verdict), method


# -- bad requests ---------------------------------------------------------------------------

@pytest.mark.parametrize("body, param", [
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ({"tools": None, "parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"tools": TOOLS + TOOLS[:1]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tool_choice": "required", "structured_outputs": {"regex": "a"}}, "structured_outputs"),
    ({"tool_choice": allowed("auto", "get_time", "get_date")}, "tool_choice"),
    ({"tool_choice": allowed("required")}, "tool_choice"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "any", "tools": []}}}, "tool_choice"),
    # a forced call is the answer, but the format a later turn's text would take is still checked
    ({"tool_choice": "required", "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "objectx"}}}}, "response_format"),
    ({"messages": QUESTION + [{"role": "tool", "content": "18"}]}, "messages"),
    # an outside review: a schema was checked only when a call was forced, and none had to be an object's
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objectx"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"x": {"type": "nonsense"}}}}}], "tool_choice": "none"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "boolean"}}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
    ({"messages": QUESTION + [{"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
     "messages"),
])
def test_bad_tool_requests_are_400_naming_the_field(client, body, param):
    r = chat(client, **body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].split(".")[0].split("[")[0] == param, r.json()


@pytest.mark.parametrize("kind", ["functoin", "allowed_tool", "web_search", None, 5])
def test_a_tool_choice_of_an_unknown_type_is_refused_by_its_type(client, kind):
    """A review: a typo in its type was told it "should be 'function'", an allowed_tools choice's too
    (and an outside pass: a type sent as null or a number, with a message and a param of their own)."""
    r = chat(client, tool_choice={"type": kind, "function": {"name": "get_time"}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    shown = f"'{kind}'" if isinstance(kind, str) else json.dumps(kind)
    assert error["param"] == "tool_choice" and f"type {shown} is" in error["message"], error
    assert error["message"].endswith("must be 'function' or 'allowed_tools'."), error


# -- the parser and the prompt, alone ---------------------------------------------------------

CALL = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'


@pytest.mark.parametrize("text, content, names", [
    ("Hello there.", "Hello there.", []),
    (CALL, "", ["f"]),
    ("Sure.\n" + CALL + "\n" + CALL + "\n", "Sure.", ["f", "f"]),
    ("<tool_call>\nnot json\n</tool_call>", "<tool_call>\nnot json\n</tool_call>", []),
    ('<tool_call>\n{"name": "f", "arguments": {}}', "", ["f"]),  # left open when the output ended
    ('<tool_call>\n{"name": "f", "arguments": {}}\n</tool_c', "", ["f"]),
    ('<tool_call>\n{"name": "f", "argu', '<tool_call>\n{"name": "f", "argu', []),  # cut by max_tokens
    ("a <tool_ca", "a <tool_ca", []),
    ("It uses <tool_call> tags, like <tool_call>x", "It uses <tool_call> tags, like <tool_call>x", []),  # spaces kept
    ("Look: <tool_call>not json</tool_call> done", "Look: <tool_call>not json</tool_call> done", []),
    ("Sure. \n" + CALL + " Done.", "Sure. Done.", ["f"]),
    ("1 < 2 and <b>", "1 < 2 and <b>", []),
    ("def f():\n    return 1\n\n", "def f():\n    return 1\n\n", []),  # no calls: the text whole (a review)
    ("Sure.\n" + CALL + "\n\n", "Sure.", ["f"]),
])
def test_the_parser_gives_the_same_split_whatever_the_chunks(text, content, names):
    for size in range(1, len(text) + 1):
        parser = ToolCallParser()
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert "".join(p[0] for p in pieces) == content, size
        assert [d.name for p in pieces for d in p[1]] == names, size
        assert [c.name for c in parser.calls] == names


def test_parallel_tool_calls_false_keeps_the_first_call_of_a_free_answer():
    """An outside review: under `auto` the flag shaped forced grammars only; vLLM keeps the first call."""
    text = CALL + "\n" + CALL.replace('"f"', '"g"')
    for size in (1, 7, len(text)):
        parser = ToolCallParser(parallel=False)
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert [d.name for p in pieces for d in p[1]] == ["f"] and "".join(p[0] for p in pieces) == ""
        assert [c.name for c in parser.calls] == ["f"]


def test_a_stop_string_does_not_cut_a_forced_calls_layout(client):
    """An outside review: `stop: ["\\n"]` ended every forced call inside the markup around
    it, before its arguments, which came back empty with finish reason "tool_calls"."""
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = chat(client, tool_choice=choice, stop=["\n", ","], temperature=0.0)
        call = r.json()["choices"][0]["message"]["tool_calls"][0]
        assert_valid_call(call)


FORCED = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "unit": "celsius"}}\n</tool_call>'


@pytest.mark.parametrize("text, arguments", [
    (FORCED, '{"city": "Pa}ris", "unit": "celsius"}'),
    (FORCED + "\n" + FORCED.replace("Pa}ris", "Rome"), None),
    (FORCED[:FORCED.index("ris") + 1], '{"city": "Pa}r'),  # cut by max_tokens: the call as far as it got
])
def test_streamed_arguments_add_up_to_the_whole_call_whatever_the_chunks(text, arguments):
    whole = ToolCallParser(stream_arguments=True)
    whole.feed(text)
    whole.finish()
    expected = [(c.name, c.arguments) for c in whole.calls]
    if arguments is not None:
        assert expected == [("get_weather", arguments)]
    assert whole.invalid_blocks == 0
    for size in range(1, len(text) + 1):
        parser = ToolCallParser(stream_arguments=True)
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert "".join(p[0] for p in pieces) == "", size
        streamed: dict[int, list] = {}
        for delta in (d for p in pieces for d in p[1]):
            if delta.id is not None:
                assert delta.index not in streamed and delta.arguments == ""
                streamed[delta.index] = [delta.name, ""]
            streamed[delta.index][1] += delta.arguments
        assert [tuple(streamed[i]) for i in sorted(streamed)] == expected, size
        assert [(c.name, c.arguments) for c in parser.calls] == expected


BOTH = ("get_weather", "get_time")


@pytest.mark.parametrize("text, names, expected", [
    ("<too", ("get_weather",), [("get_weather", "")]),  # a named call: its name is known from the start
    ('<tool_call>\n{"name": "get_', BOTH, []),  # either function: no call yet
    ('<tool_call>\n{"name": "get_w', BOTH, [("get_weather", "")]),
    ('<tool_call>\n{"name": "get_time", "argu', BOTH, [("get_time", "")]),
    (FORCED[:FORCED.index("ris") + 1], BOTH, [("get_weather", '{"city": "Pa}r')]),
    (FORCED + "\n<tool_", BOTH, [("get_weather", '{"city": "Pa}ris", "unit": "celsius"}')]),
])
def test_a_forced_call_cut_short_is_a_call_once_its_name_is_certain(text, names, expected):
    for size in range(1, len(text) + 1):
        parser = ToolCallParser(forced_names=names)
        pieces = [parser.feed(text[i:i + size]) for i in range(0, len(text), size)] + [parser.finish()]
        assert "".join(p[0] for p in pieces) == "", size  # the grammar's markup is never content
        streamed: dict[int, list] = {}
        for delta in (d for p in pieces for d in p[1]):
            streamed.setdefault(delta.index, [delta.name, ""])[1] += delta.arguments
        assert [tuple(streamed[i]) for i in sorted(streamed)] == expected, size
        assert [(c.name, c.arguments) for c in parser.calls] == expected, size


def test_the_fallback_prompt_writes_tool_turns_in_the_hermes_convention():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "a", "type": "function", "function": {"name": "get_weather",
                                                                 "arguments": '{"city": "Paris"}'}},
                    {"id": "b", "type": "function", "function": {"name": "get_time", "arguments": '{"utc": true}'}}]},
                {"role": "tool", "tool_call_id": "a", "content": "18 C"},
                {"role": "tool", "tool_call_id": "b", "content": "noon"}]
    rendered = fallback_messages(messages, [WEATHER])
    assert rendered[0]["role"] == "system" and rendered[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps({"type": "function", "function": WEATHER}) in rendered[0]["content"]
    assert rendered[2] == {"role": "assistant", "content":
                           '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
                           '<tool_call>\n{"name": "get_time", "arguments": {"utc": true}}\n</tool_call>'}
    assert rendered[3] == {"role": "user", "content":
                           "<tool_response>\n18 C\n</tool_response>\n<tool_response>\nnoon\n</tool_response>"}
    assert len(rendered) == 4
    assert fallback_messages(messages[1:2], [WEATHER])[0]["content"].startswith(FALLBACK_PROMPT[:20])


def test_a_template_with_a_tool_section_gets_tools_and_argument_objects():
    template = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                "{% for m in messages %}{{ m.role }}:{{ m.content }}"
                "{% for c in m.tool_calls or [] %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]"
                "{% endfor %}\n{% endfor %}")
    tokenizer = tiny_tokenizer()
    messages = native_messages([{"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]}])
    text = tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": WEATHER}],
                                         chat_template=template, tokenize=False)
    assert text == 'TOOLS:get_weather;assistant:[f {"x": 1}]'


def test_a_special_tool_call_token_opens_a_forced_call():
    tokenizer = tiny_tokenizer()
    special = tokenizer.convert_tokens_to_ids("<|im_start|>")  # stands in for Qwen's <tool_call>
    compiler = GrammarCompiler(tokenizer, len(tokenizer))
    matcher = compiler.matcher(ToolUse([WEATHER], "required").grammar(special))
    import llguidance.torch as llt
    bitmask = llt.allocate_token_bitmask(1, len(tokenizer))
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = [t for t in range(len(tokenizer)) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert allowed == [special]
    # with `auto` and a response_format: the token, or the format's JSON
    matcher = compiler.matcher(ToolUse([WEATHER], "auto").grammar(special, ({"type": "object"}, "json_object")))
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    allowed = [t for t in range(len(tokenizer)) if bitmask[0, t // 32] >> (t % 32) & 1]
    assert special in allowed and all(tokenizer.decode([t]).startswith("{") for t in allowed if t != special)
    assert len(allowed) > 1


def test_constrained_and_tool_requests_are_counted(client):
    import re

    def counts():
        text = client.get("/metrics").text
        return {f"{name}{{{labels}}}": float(value)
                for name, labels, value in re.findall(r"^alchemist:(\w+_total)\{([^}]*)\} (\S+)$", text, re.M)}

    before = counts()
    chat(client, tool_choice="required", parallel_tool_calls=False, temperature=0.0)
    chat(client, tool_choice="auto", temperature=0.0, max_tokens=200, structured_outputs={"regex": WRITTEN_REGEX})
    chat(client, tool_choice="auto", temperature=0.0, max_tokens=200,
         structured_outputs={"regex": "<tool_call>\\nnot a call\\n</tool_call>"})
    after = counts()

    def grew(key):
        return after[key] - before.get(key, 0.0)
    assert grew('constrained_requests_total{constraint="tool_call"}') == 1
    assert grew('constrained_requests_total{constraint="regex"}') == 2
    assert grew('tool_requests_total{tool_choice="required"}') == 1
    assert grew('tool_requests_total{tool_choice="auto"}') == 2
    assert grew('tool_calls_total{outcome="parsed"}') == 2
    assert grew('tool_calls_total{outcome="invalid"}') == 1


def test_tokenize_counts_the_tools_as_a_chat_completion_renders_them(client):
    counted = client.post("/tokenize", json={"model": TINY_NAME, "messages": QUESTION, "tools": TOOLS}).json()
    served = chat(client, max_tokens=1, temperature=0.0).json()
    assert counted["count"] == served["usage"]["prompt_tokens"]
    plain = client.post("/tokenize", json={"model": TINY_NAME, "messages": QUESTION}).json()
    assert plain["count"] < counted["count"]
