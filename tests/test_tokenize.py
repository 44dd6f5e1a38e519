"""vLLM's /tokenize and /detokenize over the real app, on a tiny model."""

import pytest
from fastapi.testclient import TestClient

from tests.servers import TINY_NAME, tiny_app
from tests.tiny import tiny_tokenizer


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app()) as c:
        yield c


def test_tokenize_a_prompt_and_detokenize_it_back(client):
    text = "The quick brown fox"
    r = client.post("/tokenize", json={"model": TINY_NAME, "prompt": text, "return_token_strs": True})
    assert r.status_code == 200, r.text
    body = r.json()
    expected = tiny_tokenizer()(text)["input_ids"]
    assert body["tokens"] == expected and body["count"] == len(expected) and body["max_model_len"] > 0
    assert len(body["token_strs"]) == len(expected)
    r = client.post("/detokenize", json={"model": TINY_NAME, "tokens": body["tokens"]})
    assert r.status_code == 200 and text in r.json()["prompt"]


def test_tokenize_messages_as_chat_completions_renders_them(client):
    messages = [{"role": "user", "content": "hi"}]
    tokens = client.post("/tokenize", json={"messages": messages}).json()["tokens"]
    tokenizer = tiny_tokenizer()
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tokens == tokenizer(text, add_special_tokens=False)["input_ids"]
    without = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
    assert without["count"] < len(tokens)
    special = client.post("/tokenize", json={"messages": messages, "add_special_tokens": True}).json()["tokens"]
    assert special == tokenizer(text, add_special_tokens=True)["input_ids"]  # vLLM's field (a review: a 400)
    # the count is what a chat completion is charged for its prompt
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "messages": messages, "max_tokens": 1})
    assert r.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize("path, body, status, param", [
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),  # as a chat completion
    ("/detokenize", {"tokens": [-1]}, 400, "tokens[0]"),
    ("/detokenize", {"tokens": [10**9]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
])
def test_bad_bodies_get_openai_errors(client, path, body, status, param):
    r = client.post(path, json=body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_tokenizer_info_lets_a_client_tokenize_and_render_chats_as_the_server_does(client):
    """What lm-evaluation-harness's remote tokenizer reads (vLLM's `/tokenizer_info`): the
    special tokens, which it encodes through `/tokenize` (their ids), and the chat template,
    which it renders itself with jinja2 before tokenizing the text."""
    import jinja2

    info = client.get("/tokenizer_info")
    assert info.status_code == 200, info.text
    info = info.json()
    tokenizer = tiny_tokenizer()
    assert info["tokenizer_class"] == type(tokenizer).__name__ and info["eos_token"] == tokenizer.eos_token
    eos = client.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [tokenizer.eos_token_id]
    assert info["model_max_length"] == eos["max_model_len"]  # the served context
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    text = jinja2.Environment().from_string(info["chat_template"]).render(messages=messages,
                                                                          add_generation_prompt=True)
    rendered = client.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert rendered == client.post("/tokenize", json={"messages": messages}).json()["tokens"]


def test_tool_call_arguments_nested_past_the_recursion_limit_are_kept_as_written(client):
    """They are JSON no parser here can take apart (a 500 before): kept as text, as other
    arguments that are not JSON are."""
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[" * 1000 + "]" * 1000}}
    r = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "tool_calls": [call]}]})
    assert r.status_code == 200, r.text

