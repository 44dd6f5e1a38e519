"""Stored responses (server/response_store.py, server/responses_stored.py), through the
official SDK against a real server: `previous_response_id` continues a conversation as the
chat completion of all its turns would (the tool loop too), `retrieve` and `input_items`
answer as OpenAI's do, `store: false` keeps nothing, a deletion breaks what continues it,
and a training server's stored responses outlive a restart."""

from __future__ import annotations

import contextlib
import dataclasses
import json

import httpx
import openai
import pytest

from server.config import ServerConfig
from server.response_store import RESPONSES_FILE, ResponseStore, StoredResponse
from tests import test_responses_api
from tests.servers import TINY_NAME, ServerThread, long_context_app, tiny_app
from tests.test_responses_api import CHAT_WEATHER, WEATHER
from trainer.config import AdapterConfig, TrainConfig

# the server of that module's tests (its fixtures), here too
server, client = test_responses_api.server, test_responses_api.client


@contextlib.contextmanager
def _served(**settings):
    """A tiny server with these server settings, and an SDK client of it."""
    with ServerThread(tiny_app(server=dataclasses.replace(ServerConfig(), **settings))) as running:
        yield running, openai.OpenAI(base_url=running.url + "/v1", api_key="unused", max_retries=0)


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


def test_a_continued_conversation_reads_its_earlier_turns_from_the_prefix_cache(client):
    first = client.responses.create(model=TINY_NAME, input="Tell me a long story about the sea", temperature=0,
                                    max_output_tokens=8, extra_body={"train": False})
    second = client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="Go on",
                                     max_output_tokens=2, extra_body={"train": False})
    cached = second.usage.input_tokens_details.cached_tokens
    # the first turn's prompt, whole blocks of it (4 tokens here), read back instead of computed again
    assert first.usage.input_tokens - 4 < cached < second.usage.input_tokens, (cached, first.usage)


def test_langchain_continues_a_conversation_by_its_previous_response_id(client, server):
    """LangChain's `use_previous_response_id` sends only the turns after its last answer, with
    that answer's id, where the id is OpenAI's (`resp_…`)."""
    from langchain_core.messages import HumanMessage
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=TINY_NAME, base_url=server.url + "/v1", api_key="unused", use_responses_api=True,
                     use_previous_response_id=True, max_tokens=5, temperature=0)
    first = llm.invoke([HumanMessage("Hello there")])
    second = llm.invoke([HumanMessage("Hello there"), first, HumanMessage("And again?")])
    stored = client.responses.retrieve(second.response_metadata["id"])
    assert stored.previous_response_id == first.response_metadata["id"]
    assert [item.content[0].text for item in client.responses.input_items.list(stored.id)] == ["And again?"]
    whole = _chat(client, [{"role": "user", "content": "Hello there"},
                           {"role": "assistant", "content": first.text}, {"role": "user", "content": "And again?"}], 5)
    assert second.text == whole.choices[0].message.content


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
    with pytest.raises(openai.BadRequestError):  # a stored response is not streamed again
        client.responses.retrieve(response.id, stream=True)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve("resp_0123")
    with pytest.raises(openai.NotFoundError):
        client.responses.input_items.list("resp_0123")


def test_a_streamed_response_is_stored_before_its_last_event():
    """A client may continue a response as soon as its stream says it is complete."""
    import asyncio

    from tests.test_responses_api import answer_of

    answer, stored = answer_of(["It is ", "sunny."]), []

    async def keep(response: dict):
        await asyncio.sleep(0.05)  # (a write that takes a while)
        stored.append(response)

    async def stream() -> list[tuple[str, int]]:
        seen = []
        async for event in answer.events(keep):
            seen.append((event.split(b"\n", 1)[0].decode(), len(stored)))
        return seen

    seen = asyncio.run(stream())
    assert seen[-1] == ("event: response.completed", 1) and all(n == 0 for _, n in seen[:-1])
    assert stored[0]["status"] == "completed" and stored[0]["output"][0]["content"][0]["text"] == "It is sunny."


def test_a_response_is_continued_on_the_event_that_completes_its_stream(client):
    events = client.responses.create(model=TINY_NAME, input="Hi", temperature=0, max_output_tokens=4, stream=True)
    ended = [event for event in events if event.type in ("response.completed", "response.incomplete")]
    assert len(ended) == 1
    continued = client.responses.create(model=TINY_NAME, previous_response_id=ended[0].response.id, input="Then?",
                                        max_output_tokens=2)
    assert continued.previous_response_id == ended[0].response.id
    assert client.responses.retrieve(ended[0].response.id).output_text == ended[0].response.output_text


def test_item_ids_are_each_given_once(client, server):
    message = {"type": "message", "role": "user", "content": "x", "id": "msg_1"}
    r = httpx.post(server.url + "/v1/responses", timeout=120, json={
        "model": TINY_NAME, "input": [message, {**message, "content": "y"}], "max_output_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    error = r.json()["error"]
    assert "Duplicate item found with id 'msg_1'" in error["message"] and error["code"] == "duplicate_item"
    first = client.responses.create(model=TINY_NAME, input=[message], max_output_tokens=2)
    # the output sent back beside previous_response_id, which holds it already (OpenAI refuses this too)
    with pytest.raises(openai.BadRequestError) as error:
        client.responses.create(model=TINY_NAME, previous_response_id=first.id, input=[
            *[item.model_dump(exclude_none=True) for item in first.output], {"role": "user", "content": "z"}],
            max_output_tokens=2)
    assert error.value.body["code"] == "duplicate_item" and first.output[0].id in error.value.body["message"]
    # an id no replica could have given is not found (nothing is asked of another replica)
    for odd in ("resp_r1-abc?x=1", "resp_r1-abc#x", "resp_..%2F"):
        r = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "model": TINY_NAME, "input": "x", "previous_response_id": odd, "max_output_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "previous_response_not_found", r.text


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
    def stored() -> float:
        text = httpx.get(server.url + "/metrics", timeout=120).text
        return float(next(line for line in text.splitlines() if line.startswith("alchemist:stored_responses ")
                          ).split()[1])

    before = stored()
    r = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=120)  # training off: the stored copy only
    assert stored() == before - 1
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
    with _served(max_stored_responses=0) as (running, client):
        response = client.responses.create(model=TINY_NAME, input="Hi", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=TINY_NAME, previous_response_id=response.id, input="x", max_output_tokens=2)
        assert "max_stored_responses" in error.value.body["message"]
        assert "alchemist:stored_responses " not in httpx.get(running.url + "/metrics", timeout=120).text
        paths = httpx.get(running.url + "/openapi.json", timeout=120).json()["paths"]
        assert "/v1/responses/{response_id}" not in paths  # neither retrieved nor deleted here


def _turn(i: int, previous: int | None = None, text: str = "") -> StoredResponse:
    return StoredResponse({"id": f"resp-{i}", "output": [{"text": text}]}, [{"id": f"msg_{i}"}],
                          None if previous is None else f"resp-{previous}")


def test_the_store_prunes_the_least_recently_used_and_a_conversation_going_on_is_in_use(tmp_path):
    store = ResponseStore(tmp_path / RESPONSES_FILE, max_stored=3)
    for turn in (_turn(0), _turn(1), _turn(2, previous=0)):  # continuing 0 uses it: 1 is now the oldest
        assert store.put(turn)
    assert store.put(_turn(3))
    assert store.get("resp-1") is None and store.count == 3
    turns, missing = store.chain("resp-2")
    assert [t.id for t in turns] == ["resp-2", "resp-0"] and missing is None
    assert store.get("resp-2") == _turn(2, previous=0)
    assert (store.count, store.bytes) == (3, sum(len(json.dumps(t.response)) + len(json.dumps(t.input_items))
                                                 for t in (_turn(0), _turn(2, previous=0), _turn(3))))
    assert store.delete("resp-0") and not store.delete("resp-0") and store.count == 2
    turns, missing = store.chain("resp-2")
    assert [t.id for t in turns] == ["resp-2"] and missing == "resp-0"  # a turn lacking: not continued
    assert store.chain("resp-9") == ([], "resp-9")
    store.close()
    assert ResponseStore(tmp_path / RESPONSES_FILE, max_stored=3).get("resp-3") is not None  # on disk
    with pytest.raises(ValueError):
        ResponseStore(None, max_stored=0)


def test_the_store_keeps_under_its_bytes_and_a_response_larger_than_them_is_not_kept():
    store = ResponseStore(None, max_bytes=1000)
    for i in range(5):
        assert store.put(_turn(i, text="x" * 300))
    assert store.count == 2 and store.get("resp-4") is not None and store.get("resp-2") is None
    assert not store.put(_turn(9, text="x" * 2000)) and store.get("resp-9") is None and store.count == 2


def test_a_deleted_response_leaves_no_text_in_the_files(tmp_path):
    store = ResponseStore(tmp_path / RESPONSES_FILE)
    store.put(_turn(0, text="a secret only this response holds"))
    store.put(_turn(1, text="kept"))
    assert store.delete("resp-0")
    for path in tmp_path.iterdir():  # the database, its write-ahead log and shared memory
        assert b"a secret only this response holds" not in path.read_bytes(), path
    assert store.get("resp-1") is not None


def test_truncation_auto_drops_the_oldest_turns_until_the_conversation_fits():
    """OpenAI's `truncation: "auto"`: a conversation longer than the context loses turns from
    its beginning (a call with its output); `disabled` (the default) is the context's 400."""
    with _served() as (_, client):  # (a context of 256 tokens)
        words = " ".join(["word"] * 6)
        previous, turns = None, []
        system = {"role": "system", "content": "Be terse."}  # (as LangChain sends a system message: an item)
        for i in range(30):
            sent = [system, {"role": "user", "content": f"{i}: {words}"}] if i == 0 else f"{i}: {words}"
            try:
                response = client.responses.create(model=TINY_NAME, input=sent, temperature=0,
                                                   max_output_tokens=4, previous_response_id=previous)
            except openai.BadRequestError as error:
                assert error.body["code"] == "context_length_exceeded", error.body
                break
            turns.append(response)
            previous = response.id
        else:
            raise AssertionError("the conversation never outgrew the context")
        fitted = client.responses.create(model=TINY_NAME, input=f"{len(turns)}: {words}", temperature=0,
                                         max_output_tokens=4, previous_response_id=previous, truncation="auto")
        assert fitted.truncation == "auto" and fitted.usage.input_tokens + 4 <= 256
        # the same as the chat of the turns it kept, the newest that fit, whole, and the system message
        for first in range(1, len(turns) + 1):
            messages = [system] + [m for i in range(first, len(turns)) for m in (
                {"role": "user", "content": f"{i}: {words}"}, {"role": "assistant", "content": turns[i].output_text})]
            messages.append({"role": "user", "content": f"{len(turns)}: {words}"})
            try:
                chat = _chat(client, messages, 4)
            except openai.BadRequestError:
                continue
            assert fitted.output_text == chat.choices[0].message.content
            assert fitted.usage.input_tokens == chat.usage.prompt_tokens
            break
        else:
            raise AssertionError("no kept turns fit")
        with pytest.raises(openai.BadRequestError):  # the newest turn alone does not fit: nothing to drop
            client.responses.create(model=TINY_NAME, input=" ".join(["word"] * 300), truncation="auto",
                                    max_output_tokens=4)
        # an older turn deleted: with truncation, the conversation goes on from what is kept
        assert client.responses.delete(turns[0].id) is None
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model=TINY_NAME, input="x", previous_response_id=turns[1].id, max_output_tokens=2)
        going_on = client.responses.create(model=TINY_NAME, input="x", previous_response_id=turns[1].id,
                                           truncation="auto", max_output_tokens=2, temperature=0)
        chat = _chat(client, [{"role": "user", "content": f"1: {words}"},
                              {"role": "assistant", "content": turns[1].output_text},
                              {"role": "user", "content": "x"}], 2)
        assert going_on.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stored_conversation_goes_on_without_new_input(client, server):
    first = client.responses.create(model=TINY_NAME, input="Hello there", temperature=0, max_output_tokens=3)
    for given in ({}, {"input": []}):  # (LangChain sends nothing new after an answer of its own)
        more = client.responses.create(model=TINY_NAME, previous_response_id=first.id, temperature=0,
                                       max_output_tokens=3, **given)
        chat = _chat(client, [{"role": "user", "content": "Hello there"},
                              {"role": "assistant", "content": first.output_text}], 3)
        assert more.output_text == chat.choices[0].message.content
        assert client.responses.input_items.list(more.id).data == []
    r = httpx.post(server.url + "/v1/responses", json={"model": TINY_NAME}, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["param"] == "input", r.text
    assert r.json()["error"]["code"] == "missing_required_parameter"


def test_a_call_a_limit_cut_is_not_part_of_the_conversation_that_continues(client):
    cut = client.responses.create(model=TINY_NAME, input="Weather?", tools=[WEATHER], tool_choice="required",
                                  temperature=0, max_output_tokens=3)
    assert cut.output[-1].type == "function_call" and cut.output[-1].status == "incomplete"
    more = client.responses.create(model=TINY_NAME, previous_response_id=cut.id, input="Never mind.",
                                   temperature=0, max_output_tokens=3)
    chat = _chat(client, [{"role": "user", "content": "Weather?"}, {"role": "user", "content": "Never mind."}], 3)
    assert more.usage.input_tokens == chat.usage.prompt_tokens and more.output_text == chat.choices[0].message.content


def test_a_response_larger_than_the_store_says_it_was_not_stored():
    with _served(max_stored_response_bytes=200) as (_, client):
        response = client.responses.create(model=TINY_NAME, input="Hi", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(response.id)
        streamed = list(client.responses.create(model=TINY_NAME, input="Hi", max_output_tokens=2, stream=True))
        assert streamed[-1].response.store is False



def test_truncation_names_what_is_wrong_with_a_request_as_without_it(server):
    for truncation in ("auto", "disabled"):
        r = httpx.post(server.url + "/v1/responses", timeout=120, json={
            "model": TINY_NAME, "input": "x", "truncation": truncation, "max_output_tokens": 2, "tools": [WEATHER],
            "tool_choice": {"type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "nope"}]}})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.tools[0]", r.text


def test_a_conversations_calls_and_their_outputs_pair_up(client, server):
    """OpenAI's 400s: a call left without its output, an output naming no call."""
    call = client.responses.create(model=TINY_NAME, input="Weather in Paris?", tools=[WEATHER],
                                   tool_choice="required", temperature=0, max_output_tokens=60)
    assert call.output[-1].type == "function_call" and call.output[-1].status == "completed"
    for sent, words in (("never mind", f"No tool output found for function call {call.output[-1].call_id}"),
                        ([{"type": "function_call_output", "call_id": "call_bogus", "output": "x"}],
                         "No tool call found for function call output with call_id call_bogus")):
        with pytest.raises(openai.BadRequestError) as error:
            client.responses.create(model=TINY_NAME, previous_response_id=call.id, input=sent, tools=[WEATHER],
                                    max_output_tokens=2)
        assert words in error.value.body["message"] and error.value.body["param"] == "input"
    r = httpx.post(server.url + "/v1/responses", timeout=120, json={  # (without a stored conversation too)
        "model": TINY_NAME, "max_output_tokens": 2,
        "input": [{"type": "function_call_output", "call_id": "call_bogus", "output": "x"}]})
    assert r.status_code == 400 and "call_bogus" in r.json()["error"]["message"], r.text


def test_an_error_quotes_a_long_id_by_its_beginning(server):
    long_id = "resp_" + "a" * 60_000
    for method in ("GET", "DELETE"):
        r = httpx.request(method, f"{server.url}/v1/responses/{long_id}", timeout=120)
        assert r.status_code == 404 and len(r.content) < 1000, (method, len(r.content))


def test_truncation_that_cannot_fit_the_newest_turn_reports_the_whole_prompt():
    with _served() as (_, client):
        first = client.responses.create(model=TINY_NAME, input="My name is Zed.", max_output_tokens=2)
        with pytest.raises(openai.BadRequestError) as error:  # the output alone asks for more than the context
            client.responses.create(model=TINY_NAME, previous_response_id=first.id, input="Who am I?",
                                    truncation="auto", max_output_tokens=300)
        whole = _chat(client, [{"role": "user", "content": "My name is Zed."},
                               {"role": "assistant", "content": first.output_text},
                               {"role": "user", "content": "Who am I?"}], 2).usage.prompt_tokens
        assert f"({whole} in the prompt" in error.value.body["message"], error.value.body

