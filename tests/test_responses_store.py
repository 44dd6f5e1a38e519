"""Stored responses (server/response_store.py, server/responses_stored.py), through the
official SDK against a real server: `previous_response_id` continues a conversation as the
chat completion of all its turns would (the tool loop too), `retrieve` and `input_items`
answer as OpenAI's do, `store: false` keeps nothing, a deletion breaks what continues it,
and a training server's stored responses outlive a restart."""

from __future__ import annotations

import dataclasses

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.response_store import RESPONSES_FILE, ResponseStore, StoredResponse
from tests.servers import TINY_NAME, ServerThread, long_context_app, tiny_app
from tests.test_responses_api import CHAT_WEATHER, WEATHER
from trainer.config import AdapterConfig, TrainConfig


@pytest.fixture(scope="module")
def server():
    with ServerThread(long_context_app()) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def _chat(client, messages: list[dict], max_tokens: int, **kwargs):
    return client.chat.completions.create(model=TINY_NAME, messages=messages, temperature=0, max_tokens=max_tokens,
                                          **kwargs)


def test_a_continued_response_is_the_chat_completion_of_the_whole_conversation(client):
    first = client.responses.create(model=TINY_NAME, instructions="Be brief.", input="Hello there", temperature=0,
                                    max_output_tokens=6)
    second = client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="And again?",
                                     instructions="Answer in French.", temperature=0, max_output_tokens=6)
    third = client.responses.create(model=TINY_NAME, previous_response_id=second.id,
                                    input=[{"role": "user", "content": "Once more"}], temperature=0,
                                    max_output_tokens=6)
    assert first.store and second.previous_response_id == first.id and third.previous_response_id == second.id
    turns = [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": first.output_text},
             {"role": "user", "content": "And again?"}]
    # the earlier instructions are not carried over (OpenAI's rule): each turn's own only
    chat = _chat(client, [{"role": "system", "content": "Answer in French."}, *turns], 6)
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    turns += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Once more"}]
    chat = _chat(client, turns, 6)
    assert third.output_text == chat.choices[0].message.content
    assert third.usage.input_tokens == chat.usage.prompt_tokens


def test_the_tool_loop_continues_from_the_stored_call(client):
    call = client.responses.create(model=TINY_NAME, input="Weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=60)
    [item] = call.output
    assert item.type == "function_call"
    answer = client.responses.create(model=TINY_NAME, previous_response_id=call.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "22 C and sunny"}], temperature=0, max_output_tokens=8)
    chat = _chat(client, [{"role": "user", "content": "Weather in Paris?"},
                          {"role": "assistant", "content": None, "tool_calls": [
                              {"id": item.call_id, "type": "function",
                               "function": {"name": item.name, "arguments": item.arguments}}]},
                          {"role": "tool", "tool_call_id": item.call_id, "content": "22 C and sunny"}], 8,
                 tools=[CHAT_WEATHER])
    assert answer.output_text == (chat.choices[0].message.content or "")
    assert answer.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stored_response_is_retrieved_and_its_input_listed_a_page_at_a_time(client, server):
    items = [{"role": "user", "content": f"part {i}"} for i in range(5)]
    response = client.responses.create(model=TINY_NAME, input=items, max_output_tokens=3)
    got = client.responses.retrieve(response.id)
    assert got.model_dump() == response.model_dump()
    listed = client.responses.input_items.list(response.id)  # newest first, as OpenAI's
    assert [i.content[0].text for i in listed.data] == [f"part {i}" for i in reversed(range(5))]
    assert listed.first_id == listed.data[0].id and listed.last_id == listed.data[-1].id and not listed.has_more
    assert len({i.id for i in listed.data}) == 5 and all(i.status == "completed" for i in listed.data)
    page = client.responses.input_items.list(response.id, order="asc", limit=2)
    assert [i.content[0].text for i in page.data] == ["part 0", "part 1"] and page.has_more
    rest = client.responses.input_items.list(response.id, order="asc", limit=2, after=page.last_id)
    assert [i.content[0].text for i in rest.data] == ["part 2", "part 3"] and rest.has_more
    # the SDK's pager walks every page
    assert [i.content[0].text for i in client.responses.input_items.list(response.id, order="asc", limit=2)] == \
        [f"part {i}" for i in range(5)]
    for query, param in (("limit=0", "limit"), ("limit=101", "limit"), ("order=up", "order"), ("after=nope", "after")):
        r = httpx.get(f"{server.url}/v1/responses/{response.id}/input_items?{query}", timeout=120)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp-0123")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp-0123")


def test_a_streamed_response_is_stored_before_its_last_event(client):
    events = client.responses.create(model=TINY_NAME, input="Hi", temperature=0, max_output_tokens=4, stream=True)
    for event in events:
        if event.type in ("response.completed", "response.incomplete"):
            # continued at once, while the stream is still open
            continued = client.responses.create(model=TINY_NAME, previous_response_id=event.response.id,
                                                input="Then?", max_output_tokens=2)
            assert continued.previous_response_id == event.response.id
            assert client.responses.retrieve(event.response.id).output_text == event.response.output_text


def test_store_false_keeps_nothing_and_cannot_be_continued(client):
    response = client.responses.create(model=TINY_NAME, input="Hi", store=False, max_output_tokens=2)
    assert response.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=TINY_NAME, previous_response_id=response.id, input="x", max_output_tokens=2)
    assert error.value.body["code"] == "previous_response_not_found"
    assert error.value.body["param"] == "previous_response_id"


def test_deleting_a_turn_breaks_the_conversations_that_continue_it(client, server):
    first = client.responses.create(model=TINY_NAME, input="One", max_output_tokens=2)
    second = client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="Two", max_output_tokens=2)
    r = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=120)  # training off: the stored copy only
    assert r.status_code == 200 and r.json() == {"id": first.id, "object": "response", "deleted": True,
                                                 "trained_into_version": None}
    with pytest.raises(openai.NotFoundError):
        client.responses.delete(first.id)
    assert client.responses.retrieve(second.id).id == second.id  # kept, but its conversation lacks a turn
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=TINY_NAME, previous_response_id=second.id, input="x", max_output_tokens=2)
    assert first.id in error.value.body["message"] and error.value.body["code"] == "previous_response_not_found"


def test_a_training_servers_stored_responses_outlive_a_restart(tmp_path):
    train, adapter = TrainConfig(mode="dpo", lora_rank=4), AdapterConfig(dir=str(tmp_path))
    with ServerThread(long_context_app(train=train, adapter=adapter)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        first = client.responses.create(model=TINY_NAME, input="Remember me", temperature=0, max_output_tokens=4)
        deleted = client.responses.create(model=TINY_NAME, input="Forget me", max_output_tokens=2)
        assert client.responses.delete(deleted.id) is None  # its request, its label and its stored copy
    assert (tmp_path / RESPONSES_FILE).is_file()
    with ServerThread(long_context_app(train=train, adapter=adapter)) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        assert client.responses.retrieve(first.id).output_text == first.output_text
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(deleted.id)
        second = client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="Who?",
                                         temperature=0, max_output_tokens=4)
        chat = _chat(client, [{"role": "user", "content": "Remember me"},
                              {"role": "assistant", "content": first.output_text},
                              {"role": "user", "content": "Who?"}], 4)
        assert second.output_text == chat.choices[0].message.content


def test_a_server_that_stores_no_responses_says_so():
    app = tiny_app(server=dataclasses.replace(ServerConfig(), max_stored_responses=0))
    with ServerThread(app) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)
        response = client.responses.create(model=TINY_NAME, input="Hi", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=TINY_NAME, previous_response_id=response.id, input="x", max_output_tokens=2)
        assert "max_stored_responses" in error.value.body["message"]
        paths = httpx.get(running.url + "/openapi.json", timeout=120).json()["paths"]
        assert "/v1/responses/{response_id}" not in paths  # neither retrieved nor deleted here


def test_the_store_keeps_the_newest_and_forgets_what_is_deleted(tmp_path):
    store = ResponseStore(tmp_path / RESPONSES_FILE, max_stored=2)
    for i in range(3):
        previous = f"resp-{i - 1}" if i else None
        store.put(StoredResponse({"id": f"resp-{i}", "output": []}, [{"id": f"msg_{i}"}], previous))
    assert len(store) == 2 and store.get("resp-0") is None
    assert store.get("resp-2") == StoredResponse({"id": "resp-2", "output": []}, [{"id": "msg_2"}], "resp-1")
    assert store.delete("resp-1") and not store.delete("resp-1") and len(store) == 1
    store.close()
    assert ResponseStore(tmp_path / RESPONSES_FILE, max_stored=2).get("resp-2") is not None  # on disk
    with pytest.raises(ValueError):
        ResponseStore(None, max_stored=0)
