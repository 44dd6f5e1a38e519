"""OpenAI's Responses API (`POST /v1/responses`, server/responses_api.py), through the
official SDK against a real server: the same tokens as the chat completion it is served
as, the API's stream events, function calls and their outputs, structured text, errors
that name the field sent, and a response's id labelled for training."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.servers import TINY_NAME, ServerThread, long_context_app, wait_for
from trainer.config import AdapterConfig, TrainConfig

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                          "required": ["city"], "additionalProperties": False}}  # (a call of a few tokens, whole)
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}


@pytest.fixture(scope="module")
def server():
    with ServerThread(long_context_app()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def test_a_response_is_the_chat_completion_of_its_turns(client):
    response = client.responses.create(model=TINY_NAME, instructions="Be brief.", input="Hello there",
                                       temperature=0, max_output_tokens=8)
    chat = client.chat.completions.create(model=TINY_NAME, temperature=0, max_tokens=8, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}])
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens == 8
    assert response.usage.total_tokens == chat.usage.total_tokens
    # cut by its limit: incomplete, as the chat's finish_reason "length"
    assert chat.choices[0].finish_reason == "length"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert response.instructions == "Be brief." and response.max_output_tokens == 8


def test_the_stream_sends_the_apis_events_in_order_and_the_same_text(client):
    whole = client.responses.create(model=TINY_NAME, input=[{"role": "user", "content": "Hi"}], temperature=0,
                                    max_output_tokens=6)
    events = list(client.responses.create(model=TINY_NAME, input=[{"role": "user", "content": "Hi"}],
                                          temperature=0, max_output_tokens=6, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [event.sequence_number for event in events] == list(range(len(events)))
    text = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    final = events[-1].response
    assert final.output_text == text and final.usage.output_tokens == 6 and final.id.startswith("resp_")


def test_a_forced_call_then_its_output_in_the_next_turn(client):
    response = client.responses.create(model=TINY_NAME, input="Weather in Paris?", tools=[WEATHER],
                                       tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60,
                                       temperature=0)  # (greedy: the same call every run)
    # (the tiny model writes on after the call, to the limit: the response is incomplete, its call whole)
    [call] = response.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    # the next turn: the call sent back as the SDK returned it (null fields of newer API
    # versions included), and its output
    turns = [{"role": "user", "content": "Weather in Paris?"}, call.model_dump(),
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
    answer = client.responses.create(model=TINY_NAME, input=turns, tools=[WEATHER], temperature=0,
                                     max_output_tokens=4)
    chat = client.chat.completions.create(model=TINY_NAME, tools=[CHAT_WEATHER], temperature=0, max_tokens=4,
                                          messages=[turns[0], {"role": "assistant", "content": None, "tool_calls": [
                                              {"id": call.call_id, "type": "function",
                                               "function": {"name": call.name, "arguments": call.arguments}}]},
                                              {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"}])
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.output_text == (chat.choices[0].message.content or "")


def test_a_forced_call_streams_its_arguments_as_decoded(client):
    with client.responses.stream(model=TINY_NAME, input="Weather?", tools=[WEATHER], tool_choice="required",
                                 max_output_tokens=60, temperature=0) as stream:
        events = list(stream)
    kinds = [event.type for event in events]
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert "response.output_text.delta" not in kinds
    added = kinds.index("response.output_item.added")
    assert events[added].item.type == "function_call" and events[added].item.arguments == ""
    pieces = [event for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(pieces) > 1 and kinds.index("response.function_call_arguments.delta") > added
    done = next(event for event in events if event.type == "response.function_call_arguments.done")
    assert "".join(piece.delta for piece in pieces) == done.arguments
    assert json.loads(done.arguments)["city"] in ("Paris", "Rome")
    assert events[-1].response.output[0].arguments == done.arguments
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_a_streamed_call_is_counted_once_and_events_carry_no_raw_line_separator(server, client):
    def parsed_calls() -> float:
        text = httpx.get(server.url + "/metrics", timeout=120).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("alchemist:tool_calls_total") and 'outcome="parsed"' in line)

    before = parsed_calls()
    body = {"model": TINY_NAME, "input": "Weather?", "instructions": "Line\u2028separated\u2029and\u0085next",
            "tools": [WEATHER], "tool_choice": "required", "max_output_tokens": 60, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, timeout=120) as r:
        raw = b"".join(r.iter_raw())
    assert parsed_calls() == before + 1
    for separator in ("\u2028", "\u2029", "\u0085"):
        assert separator.encode() not in raw
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    assert events[0]["response"]["instructions"] == "Line\u2028separated\u2029and\u0085next"


def test_a_response_delete_takes_response_ids_alone(server):
    r = httpx.delete(server.url + "/v1/responses/chatcmpl-0123", timeout=120)
    assert r.status_code == 404 and "begins 'resp_'" in r.json()["error"]["message"], r.text


def test_text_format_json_schema_shapes_the_answer(client):
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}  # (an answer of a few tokens: an integer's digits could run on)
    response = client.responses.create(model=TINY_NAME, input="json", max_output_tokens=40, temperature=0, text={
        "format": {"type": "json_schema", "name": "numbers", "schema": schema, "strict": True}})
    assert response.status == "completed"
    assert set(json.loads(response.output_text)) == {"a"}
    assert response.text.format.type == "json_schema"


@pytest.mark.parametrize("extra, param, words", [
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input", "type 'web_search_call'"),
    ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "'resp_1' not found"),
    ({"input": "x", "previous_response_id": ""}, "previous_response_id", "at least 1 character"),
    ({"input": "x", "conversation": "conv_1"}, "conversation", "Conversations API is not offered"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools", "type 'web_search'"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
    ({"input": []}, "input", "at least 1 item"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools[0].parameters", "object"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content", "input_image"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input[0].output", ""),
    ({"input": [{"role": "user", "content": "x", "surprise": 1}]}, "input[0].surprise", "Unrecognized"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "bad", "schema": {"type": "nonsense"}}}},
     "text.format", ""),
    ({"input": "x", "include": ["message.output_text.logprobs"]}, "include", "log-probabilities"),
    ({"input": "x", "tools": ["get_weather"]}, "tools[0]", "should be an object"),
    ({"input": "x", "text": "json"}, "text", ""),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs 'schema'"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [
        {"type": "function", "name": "nope"}]}}, "tool_choice.tools[0]", "`nope`"),
    ({"input": "x", "stream_options": {"include_obfuscation": False}}, "stream_options", "stream is true"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "web_search_preview"}}, "tool_choice",
     "type 'web_search_preview'"),
    ({"input": [{"type": ["message"], "role": "user", "content": "x"}]}, "input[0].type", ""),
    ({"input": "x", "metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", "at most 16"),
    ({"input": "x", "metadata": {"k": "v" * 513}}, "metadata.k", "at most 512"),
    # numbers equal to false are no booleans (schemathesis sent 0.0, and it was taken)
    ({"input": "x", "background": 0.0}, "background", "valid boolean"),
    ({"input": "x", "background": 0}, "background", "valid boolean"),
    ({"input": "x", "background": True}, "background", "False"),
])
def test_what_is_refused_is_named_as_sent(server, extra, param, words):
    r = httpx.post(server.url + "/v1/responses", json={"model": TINY_NAME, **extra}, timeout=120)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error
    assert error["type"] == "invalid_request_error"


def test_what_the_responses_api_takes_that_a_chat_refuses(client):
    """`parallel_tool_calls` without tools (the chat API refuses it); parts joined as a chat joins them."""
    parts = [{"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "there"}]
    response = client.responses.create(model=TINY_NAME, input=[{"role": "user", "content": parts}],
                                       parallel_tool_calls=False, temperature=0, max_output_tokens=2)
    chat = client.chat.completions.create(model=TINY_NAME, temperature=0, max_tokens=2, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]}])
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.output_text == chat.choices[0].message.content


def test_a_response_id_is_labelled_and_trained_on(tmp_path):
    app = long_context_app(train=TrainConfig(mode="dpo", lora_rank=4, entries_per_step=1),
                           adapter=AdapterConfig(dir=str(tmp_path)))
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        response = client.responses.create(model=TINY_NAME, input="Capital of France?", temperature=0,
                                           max_output_tokens=6)
        r = httpx.post(running.url + "/v1/feedback", json={"id": response.id, "chosen": "Paris, on the Seine."},
                       timeout=120)
        assert r.status_code == 200, r.text

        def trained() -> bool:
            status = httpx.get(running.url + "/v1/adapters", timeout=120).json()
            return status["training"]["trained_entries"] >= 1

        wait_for(trained)
        deleted = httpx.delete(f"{running.url}/v1/responses/{response.id}", timeout=120)
        assert deleted.status_code == 200, deleted.text
        assert deleted.json() == {"id": response.id, "object": "response", "deleted": True,
                                  "trained_into_version": 1}
        with pytest.raises(openai.NotFoundError):  # as the SDK deletes: nothing is kept of it any more
            client.responses.delete(response.id)
        other = client.responses.create(model=TINY_NAME, input="Capital of Italy?", max_output_tokens=2)
        assert client.responses.delete(other.id) is None  # (the SDK's answer to a deletion)


def answer_of(pieces: list[str], reason: str = "stop", splitter=None):
    """A response's `Answer` over decoded `pieces` (the last ending for `reason`): tools
    offered, or with `splitter` (server/reasoning.py) none, the reasoning apart."""
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from engine.sampling_params import SamplingParams
    from server.protocol_responses import ResponsesRequest
    from server.responses_api import Answer
    from server.routes_openai import ChatRun
    from server.tool_calls import ToolCallParser

    async def outputs():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput("resp-1", [CompletionOutput(0, piece, [1], None, reason if last else None)], last,
                                RequestMetrics(0.0, None, None, 3, i + 1))

    tools = {"tools": [WEATHER]} if splitter is None else {}
    body = ResponsesRequest.model_validate({"model": TINY_NAME, "input": "x", **tools})
    run = ChatRun("resp-1", SamplingParams(), 3, outputs(), [ToolCallParser()] if splitter is None else None,
                  [splitter] if splitter is not None else None)
    return Answer(run, body, 0)


CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'


@pytest.mark.parametrize("pieces, kinds", [
    (["Let me ", "check. ", CALL[:20], CALL[20:], ""], ["message", "function_call"]),
    ([CALL[:30], CALL[30:], " It is", " sunny."], ["function_call", "message"]),
])
def test_a_call_the_model_chose_streams_in_the_order_it_was_written(pieces, kinds):
    """Each item ends before the next begins, as OpenAI's stream does; the whole answer has
    the same items in the same order."""
    import asyncio

    raw = b"".join(asyncio.run(_collect(answer_of(pieces).events())))
    events = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]
    lifecycle = [(e["type"].rsplit(".", 1)[-1], e["output_index"]) for e in events
                 if e["type"] in ("response.output_item.added", "response.output_item.done")]
    assert lifecycle == [("added", 0), ("done", 0), ("added", 1), ("done", 1)]
    open_index = None
    for e in events:  # every piece belongs to the item open then
        if e["type"] == "response.output_item.added":
            open_index = e["output_index"]
        elif "output_index" in e:
            assert e["output_index"] == open_index, e
    text = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    arguments = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [item["type"] for item in final["output"]] == kinds
    message = final["output"][kinds.index("message")]
    assert message["content"][0]["text"] == text and text.strip() in ("Let me check.", "It is sunny.")
    assert json.loads(arguments) == json.loads(final["output"][kinds.index("function_call")]["arguments"]) \
        == {"city": "Rome"}
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    whole = answer_of(pieces)  # the same pieces, answered whole
    asyncio.run(_collect(whole.decoded()))

    def without_ids(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]

    assert without_ids(whole.finish()[0]["output"]) == without_ids(final["output"])


async def _collect(events) -> list:
    return [event async for event in events]
