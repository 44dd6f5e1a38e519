"""The OpenAI-compatible routes on a tiny model: shapes of responses and of errors."""

import json

import pytest
from fastapi.testclient import TestClient

from tests.servers import TINY_NAME, tiny_app


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app(max_model_len=256)) as c:
        yield c


def chat(client, **body):
    payload = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello, how are you?"}], **body}
    return client.post("/v1/chat/completions", json=payload)


def sse_events(response) -> list:
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def test_chat_completion_shape_and_usage(client):
    r = chat(client, max_tokens=8, temperature=0, ignore_eos=True)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == TINY_NAME
    choice = body["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + 8


def test_streaming_chat_with_usage_matches_non_streaming(client):
    # (each its own cache salt: neither reads the other's prompt from the prefix cache, so their usage is equal)
    expected = chat(client, max_tokens=10, temperature=0, ignore_eos=True, cache_salt="whole").json()
    with client.stream("POST", "/v1/chat/completions", json={
            "model": TINY_NAME, "messages": [{"role": "user", "content": "Hello, how are you?"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
            "cache_salt": "streamed"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == expected["choices"][0]["message"]["content"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == expected["usage"]
    assert [c for c in chunks if c["choices"]][-1]["choices"][0]["finish_reason"] == "length"


def test_each_streamed_choice_of_n_ends_once(client):
    """An outside review: a choice that finished before its siblings rides along in the
    request's later outputs, and its finish_reason was sent again in every later chunk
    (streamed tool calls were counted again each time too)."""
    for route, body in (("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hello"}]}),
                        ("/v1/completions", {"prompt": ["Hello, how are you", "Good day"]})):
        with client.stream("POST", route, json={**body, "model": TINY_NAME, "n": 4, "temperature": 1.5, "seed": 1,
                                                  "max_tokens": 30, "stop": ["e", "a", "o"], "stream": True}) as r:
            chunks = sse_events(r)[:-1]
        ends = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
        assert sorted(ends) == list(range(4 if "messages" in body else 8)), ends


def test_stream_events_end_as_openais_do(client):
    """An outside pass: events ended in CRLF pairs, which SSE allows, but a client that
    splits OpenAI's streams on "\\n\\n" found no event in them."""
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "messages": [{"role": "user", "content": "Hi"}],
                                                  "max_tokens": 3, "stream": True})
    events = [event for event in r.text.split("\n\n") if event]
    assert "\r" not in r.text and events[-1] == "data: [DONE]" and len(events) >= 2
    assert all(event.startswith("data: ") and "\n" not in event for event in events)


def test_chat_logprobs(client):
    body = chat(client, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert len(content) == body["usage"]["completion_tokens"]
    assert all(len(c["top_logprobs"]) == 2 and c["logprob"] <= 0 for c in content)


def test_chat_logprobs_bytes_rebuild_characters_that_span_tokens(client):
    """A character of several tokens: each token's text is U+FFFD, its bytes its own."""
    body = chat(client, max_tokens=8, temperature=0, logprobs=True, structured_outputs={"regex": "🌍 日本"}).json()
    content = body["choices"][0]["logprobs"]["content"]
    assert body["choices"][0]["message"]["content"] == "🌍 日本" and "\ufffd" in {c["token"] for c in content}
    assert b"".join(bytes(c["bytes"]) for c in content).decode("utf-8") == "🌍 日本"


def test_completions_echo_with_logprobs_scores_the_prompt(client):
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "The quick brown fox", "max_tokens": 3,
                                             "echo": True, "logprobs": 1, "temperature": 0})
    assert r.status_code == 200
    choice = r.json()["choices"][0]
    assert choice["text"].startswith("The quick brown fox")
    lp = choice["logprobs"]
    prompt_len = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == prompt_len + 3
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])
    assert lp["text_offset"][0] == 0


def test_a_streamed_completions_text_offsets_are_the_whole_ones_across_split_characters(client):
    """Characters of several tokens, streamed a token or so per chunk: each chunk's offsets
    carry on from the last chunk's, partial characters included, as the whole response's."""
    body = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 24, "temperature": 0, "logprobs": 0,
            "structured_outputs": {"regex": "🌍 日本!"}}
    whole = client.post("/v1/completions", json=body).json()["choices"][0]
    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        chunks = [e for e in sse_events(r) if e != "[DONE]" and e["choices"]]
    assert len(chunks) > 2 and whole["text"] == "🌍 日本!"
    streamed = [offset for c in chunks for offset in (c["choices"][0]["logprobs"] or {}).get("text_offset", [])]
    assert streamed == whole["logprobs"]["text_offset"]
    tokens, offsets = whole["logprobs"]["tokens"], whole["logprobs"]["text_offset"]
    assert whole["text"][offsets[tokens.index("!")]:] == "!"


def test_a_streamed_completion_sends_no_empty_chunk_while_a_stop_string_may_begin(client):
    """Text held back because a stop string may begin there is sent once it is known; no
    chunk without text, finish reason or log-probs comes before it."""
    body = {"model": TINY_NAME, "prompt": "Hello", "max_tokens": 30, "temperature": 0, "ignore_eos": True}
    full = client.post("/v1/completions", json=body).json()["choices"][0]["text"]
    stop = full[10:16]
    with client.stream("POST", "/v1/completions", json={**body, "stop": [stop], "stream": True}) as r:
        choices = [e["choices"][0] for e in sse_events(r) if e != "[DONE]" and e["choices"]]
    assert "".join(c["text"] for c in choices) == full[:full.index(stop)]
    assert all(c["text"] or c["finish_reason"] for c in choices), choices


def test_completions_batch_of_prompts_and_n(client):
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["Hello", "Paris"], "max_tokens": 2,
                                             "n": 2, "seed": 1})
    assert r.status_code == 200
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2, 3]


def test_completions_take_max_completion_tokens_as_chat_does(client):
    """Some clients (guidellm) send chat's newer name to /v1/completions too; it wins over max_tokens."""
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hello", "max_tokens": 8,
                                             "max_completion_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 3


@pytest.mark.parametrize("bad", [-1, 10**6, 2**32, 2**63], ids=["negative", "past the vocabulary", "past 32 bits",
                                                              "past 63 bits"])
def test_completions_prompt_token_ids_outside_the_vocabulary_get_a_400_naming_the_prompt(client, bad):
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": [[1, 2], [1, bad]], "max_tokens": 1})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"].startswith("prompt[1]") and ("must be in [0, " in error["message"] or bad < 0)


def test_streaming_completions(client):
    with client.stream("POST", "/v1/completions", json={"model": TINY_NAME, "prompt": "Hello", "max_tokens": 5,
                                                        "stream": True, "ignore_eos": True}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


def test_models_health_and_metrics(client):
    models = client.get("/v1/models").json()
    assert models["data"][0]["id"] == TINY_NAME
    assert client.get(f"/v1/models/{TINY_NAME}").status_code == 200
    assert client.get("/health").status_code == 200
    chat(client, max_tokens=3)
    text = client.get("/metrics").text
    for name in ["alchemist:time_to_first_token_seconds_bucket", "alchemist:request_time_per_output_token_seconds_bucket",
                 "alchemist:e2e_request_latency_seconds_bucket", "alchemist:num_requests_running",
                 "alchemist:num_requests_waiting", "alchemist:prompt_tokens_total",
                 "alchemist:generation_tokens_total"]:
        assert name in text, name


BAD_BODIES = [
    ("malformed json", b'{"model": ', 400, None),
    ("empty body", b"", 400, None),
    ("not an object", b"[1, 2]", 400, None),
    ("missing messages", {"model": TINY_NAME}, 400, "messages"),
    ("empty messages", {"model": TINY_NAME, "messages": []}, 400, "messages"),
    ("bad role", {"model": TINY_NAME, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    ("temperature as string", {"temperature": "hot"}, 400, "temperature"),
    ("temperature too high", {"temperature": 3.5}, 400, "temperature"),
    ("negative max_tokens", {"max_tokens": -1}, 400, "max_tokens"),
    ("negative max_completion_tokens", {"max_completion_tokens": -1}, 400, "max_completion_tokens"),
    ("max_tokens 0 (OpenAI's minimum is 1)", {"max_tokens": 0}, 400, "max_tokens"),
    ("max_completion_tokens 0", {"max_completion_tokens": 0}, 400, "max_completion_tokens"),
    ("max_new_tokens 0", {"max_new_tokens": 0}, 400, "max_new_tokens"),
    ("negative max_tokens beside a valid max_completion_tokens", {"max_tokens": -3, "max_completion_tokens": 2}, 400,
     "max_tokens"),
    ("max_tokens as float", {"max_tokens": 2.5}, 400, "max_tokens"),
    ("n as bool", {"n": True}, 400, "n"),
    ("top_p zero", {"top_p": 0}, 400, "top_p"),
    ("too many logprobs", {"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
    ("unknown field", {"max_token": 5}, 400, "max_token"),
    ("stop wrong type", {"stop": 5}, 400, "stop"),
    ("unknown model", {"model": "gpt-9"}, 404, "model"),
    ("context too long", {"max_tokens": 100000}, 400, "max_tokens"),
    ("stream_options without stream", {"stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("audio output", {"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, 400, None),
    ("deprecated functions", {"functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ("web search", {"web_search_options": {}}, 400, "web_search_options"),
    ("continuing a user's message", {"continue_final_message": True, "add_generation_prompt": False}, 400,
     "continue_final_message"),
    ("continuing and opening a turn", {"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "It"}],
                                       "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message"),
    ("template argument the request sets", {"chat_template_kwargs": {"add_generation_prompt": False}}, 400,
     "chat_template_kwargs"),
    ("an image part", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}]},
     400, "messages[0].content"),
    ("a user message without content", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("a user message of no parts", {"messages": [{"role": "user", "content": []}]}, 400, "messages[0].content"),
    ("a system message with null content", {"messages": [{"role": "system", "content": None},
                                                         {"role": "user", "content": "hi"}]}, 400,
     "messages[0].content"),
]


@pytest.mark.parametrize("name, body, status, param", BAD_BODIES, ids=[b[0] for b in BAD_BODIES])
def test_bad_chat_requests_get_openai_errors(client, name, body, status, param):
    if isinstance(body, dict):
        full = {"model": TINY_NAME, "messages": [{"role": "user", "content": "hi"}], **body}
        if "messages" not in body and name == "missing messages":
            full.pop("messages")
        if name in ("empty messages", "bad role", "an image part", "continuing and opening a turn",
                    "a user message without content", "a system message with null content",
                    "a user message of no parts"):
            full["messages"] = body["messages"]
        r = client.post("/v1/chat/completions", json=full)
    else:
        r = client.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if name == "an image part":
        assert "type 'image_url' are not supported" in error["message"]
    if param is not None:
        assert error["param"] == param


def test_openai_fields_without_effect_here_are_accepted_and_null_means_the_default(client):
    r = chat(client, max_tokens=3, n=None, stream=None, logprobs=None, audio=None, functions=None,
             reasoning_effort="low", verbosity="low", prompt_cache_key="k", safety_identifier="s",
             prediction={"type": "content", "content": "Hi"}, modalities=["text"], user="u", store=False,
             prompt_cache_retention="24h")
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 1 and r.json()["choices"][0]["logprobs"] is None
    r = chat(client, max_tokens=2, stream=True, stream_options={"include_usage": True, "include_obfuscation": False})
    assert r.status_code == 200 and "data: [DONE]" in r.text, r.text  # (the SDK's newer fields: a 400 before)
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2, "echo": None,
                                             "n": None, "stream": None, "prompt_logprobs": None, "ignore_eos": True})
    assert r.status_code == 200, r.text  # (its two tokens may decode to no text: a tiny random model's)
    assert len(r.json()["choices"]) == 1 and r.json()["usage"]["prompt_tokens"] == r.json()["usage"]["total_tokens"] - 2
    r = chat(client, functions=[{"name": "f"}])
    assert "deprecated" in r.json()["error"]["message"] and "tools" in r.json()["error"]["message"]


def test_chat_template_controls_as_vllm_takes_them(client):
    """`continue_final_message` goes on with the assistant's last message, left open;
    `add_generation_prompt: false` ends with the user's turn; `chat_template_kwargs` reach the template."""
    messages = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My answer is"}]

    def rendered(**controls) -> str:
        r = client.post("/tokenize", json={"model": TINY_NAME, "messages": messages, **controls})
        assert r.status_code == 200, r.text
        return client.post("/detokenize", json={"tokens": r.json()["tokens"]}).json()["prompt"]

    assert rendered(continue_final_message=True, add_generation_prompt=False).endswith("My answer is")
    # going on with the last message opens no turn unless add_generation_prompt is sent (true: refused)
    assert rendered(continue_final_message=True) == rendered(continue_final_message=True, add_generation_prompt=False)
    closed = rendered(add_generation_prompt=False)
    assert "My answer is" in closed and not closed.endswith("My answer is")
    assert rendered(chat_template_kwargs={"unused_variable": 1}) == rendered()
    r = chat(client, messages=messages, continue_final_message=True, add_generation_prompt=False, max_tokens=3)
    assert r.status_code == 200, r.text
    assert chat(client, messages=messages, continue_final_message=True, max_tokens=3).status_code == 200


def test_a_prompt_longer_than_the_context_is_named_as_the_prompt_whatever_max_tokens_is(client):
    long_text = "word " * 400  # past the fixture's 256-token context
    r = chat(client, messages=[{"role": "user", "content": long_text}], max_tokens=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": long_text, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text


def test_a_prompt_that_fills_the_context_is_scored_with_max_tokens_0_and_refused_with_more(client):
    """lm-evaluation-harness scores prompts with `echo` and `max_tokens` 0 (an outside pass:
    one of exactly the context's length was refused, "requested 256 tokens" of 256)."""
    body = {"model": TINY_NAME, "prompt": [[7] * 256], "echo": True, "logprobs": 1, "max_tokens": 0}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == 256 and logprobs["token_logprobs"][0] is None
    assert all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    r = client.post("/v1/completions", json={**body, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text
    assert "may have at most 255 tokens (a completion's prompt only scored, with max_tokens 0, all 256)" in r.text
    r = client.post("/v1/completions", json={**body, "prompt": [[7] * 257]})
    assert r.status_code == 400 and "requested 257 tokens (257 in the prompt, 0 in the completion)" in r.text


def test_an_output_limit_past_the_context_is_named_as_the_field_sent(client):
    """`max_completion_tokens` (chat's newer name, and guidellm's on completions) or
    `max_new_tokens` past the room left is named as sent, not as `max_tokens` (an outside
    pass): OpenAI's `param` names the client's field."""
    question = [{"role": "user", "content": "hi"}]
    for field in ("max_completion_tokens", "max_tokens", "max_new_tokens"):
        r = chat(client, messages=question, **{field: 5000})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
        assert r.json()["error"]["code"] == "context_length_exceeded"
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "hi", field: 5000})
        assert r.status_code == 400 and r.json()["error"]["param"] == field, (field, r.text)
    r = chat(client, messages=question, max_tokens=5000, max_new_tokens=4000)  # the smaller one applies
    assert r.json()["error"]["param"] == "max_new_tokens", r.text


def test_bad_completion_requests(client):
    for body, param in [({"prompt": []}, "prompt"), ({"prompt": "x", "suffix": "y"}, "suffix"),
                        ({"prompt": [[-1]]}, "prompt[0][0]"), ({"prompt": [10**9]}, "prompt"),
                        ({"prompt": "x", "best_of": 3}, "best_of"), ({"prompt": ["a", ""]}, "prompt[1]"),
                        ({"prompt": [[1], []]}, "prompt[1]"), ({"prompt": [""]}, "prompt")]:
        r = client.post("/v1/completions", json={"model": TINY_NAME, **body})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param
    # an empty suffix is none (the document's maxLength 0, which a fuzzer sends)
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "x", "suffix": "", "max_tokens": 1})
    assert r.status_code == 200, r.text
    # a union's error is the one of the member that got furthest: a negative token id, not "a valid string"
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": [[5, -1]]})
    assert r.json()["error"]["message"] == "Invalid value for 'prompt[0][1]': Input should be greater than or " \
        "equal to 0 (got -1).", r.text
    for prompt, message in (([1.5], "'prompt[0]': Input should be a valid integer (got 1.5)"),  # the member for numbers
                            (["a", 1], "'prompt[1]': Input should be a valid string (got 1)")):  # the furthest item
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": prompt})
        assert r.status_code == 400 and r.json()["error"]["message"] == f"Invalid value for {message}.", r.text
    r = chat(client, tool_choice={"type": "function"})  # a union member is named by its field, not its class
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function", r.text


def test_version_is_the_installed_packages_as_vllms_route_gives_it(client):
    import importlib.metadata

    r = client.get("/version")
    assert r.status_code == 200 and r.json() == {"version": importlib.metadata.version("alchemist")}


def test_unknown_route_and_method_get_openai_errors(client):
    r = client.get("/v1/nothing")
    assert r.status_code == 404 and "error" in r.json()
    r = client.get("/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_a_repetition_penalty_past_a_floats_range_is_a_400(client):
    """1e400 (and the literal Infinity, which Python's JSON reader takes) used to pass as a penalty."""
    for value in ("1e400", "Infinity"):
        r = client.post("/v1/chat/completions", headers={"content-type": "application/json"},
                        content=f'{{"model": "{TINY_NAME}", "max_tokens": 1, "repetition_penalty": {value}, '
                                '"messages": [{"role": "user", "content": "hi"}]}')
        assert r.status_code == 400 and r.json()["error"]["param"] == "repetition_penalty", r.text


def test_logit_bias_over_http(client):
    r = chat(client, max_tokens=3, temperature=0, ignore_eos=True, logit_bias={"42": 100})
    assert r.status_code == 200
    r = chat(client, max_tokens=3, logit_bias={"not-a-token": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = chat(client, max_tokens=3, logit_bias={"99999999": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    for digit in ("²", "٣", "１"):  # digits to str.isdigit, not token ids (the first was a 500)
        r = chat(client, max_tokens=3, logit_bias={digit: 1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias", (digit, r.text)


def test_prompt_only_requests_count_prompt_tokens(client):
    def prompt_total():
        line = next(l for l in client.get("/metrics").text.splitlines()
                    if l.startswith("alchemist:prompt_tokens_total"))
        return float(line.split()[-1])
    before = prompt_total()
    r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hello there", "max_tokens": 0,
                                             "echo": True, "logprobs": 0})
    assert prompt_total() - before == r.json()["usage"]["prompt_tokens"]


def test_continuous_usage_stats_put_running_usage_in_every_chunk(client):
    with client.stream("POST", "/v1/chat/completions", json={
            "model": TINY_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}) as r:
        chunks = sse_events(r)[:-1]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 4
    assert all(c["usage"]["prompt_tokens"] == chunks[0]["usage"]["prompt_tokens"] for c in chunks)


def test_cache_config_is_exported(client):
    line = next(l for l in client.get("/metrics").text.splitlines() if l.startswith("alchemist:cache_config_info"))
    assert 'bytes_per_token="512"' in line  # 2 (K,V) * 2 layers * 2 kv heads * 16 head_dim * 4 bytes


def test_the_generation_fields_lm_evaluation_harness_passes_on(client):
    """A task's generation_kwargs reach the server as they are: Hugging Face's
    `max_new_tokens` limits the output beside the other limits (the smallest applies; alone,
    it replaces max_tokens' default of 16), `num_beams` is 1 (no beam search), and vLLM's
    `truncate_prompt_tokens` keeps the prompt's last tokens."""
    def complete(**body):
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "ignore_eos": True,
                                                 "temperature": 0, **body})
        assert r.status_code == 200, r.text
        return r.json()

    assert complete(max_tokens=8, max_new_tokens=3, num_beams=1)["usage"]["completion_tokens"] == 3
    assert complete(max_tokens=2, max_new_tokens=5)["usage"]["completion_tokens"] == 2
    assert complete(max_new_tokens=20)["usage"]["completion_tokens"] == 20
    r = chat(client, max_completion_tokens=2, max_new_tokens=5, ignore_eos=True)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
    for bad, param in (({"num_beams": 4}, "num_beams"), ({"max_new_tokens": -1}, "max_new_tokens"),
                       ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                       ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens")):
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ids = [5, 6, 7, 8, 9]
    kept = complete(prompt=ids, max_tokens=1, echo=True, logprobs=0, truncate_prompt_tokens=3)
    assert kept["usage"]["prompt_tokens"] == 3 and len(kept["choices"][0]["logprobs"]["tokens"]) == 4
    whole = complete(prompt=ids, max_tokens=1, echo=True, truncate_prompt_tokens=9)
    assert whole["usage"]["prompt_tokens"] == 5
    long_text = "word " * 400  # past the fixture's 256-token context: the last 200 tokens fit it
    assert complete(prompt=long_text, max_tokens=1, truncate_prompt_tokens=200)["usage"]["prompt_tokens"] == 200
    # -1: as many as the context holds beside the output
    assert complete(prompt=long_text, max_tokens=6, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 250
    assert complete(prompt=long_text, max_tokens=0, truncate_prompt_tokens=-1)["usage"]["prompt_tokens"] == 256
    r = chat(client, max_tokens=1, truncate_prompt_tokens=4)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 4, r.text


def test_several_served_names_are_each_accepted_and_answered_under_the_one_asked_for():
    """vLLM's `--served-model-name a b`: every name is a model of /v1/models, a request may
    give any, and its response names the one it gave (an outside pass: a launch script
    with two names did not start)."""
    import dataclasses

    from server.cli import build_parser, config_from_args
    from server.serve import build_server
    from tests.conftest import make_config
    from tests.tiny import tiny_model, tiny_tokenizer

    parsed = config_from_args(build_parser().parse_args(["serve", "--served-model-name", "alpha", "beta"]))
    assert parsed.model.served_model_name == "alpha,beta"
    config = make_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, served_model_name="alpha,beta"))
    app = build_server(config, model=tiny_model("llama"), tokenizer=tiny_tokenizer(), model_name=TINY_NAME)
    with TestClient(app) as client:
        assert [card["id"] for card in client.get("/v1/models").json()["data"]] == ["alpha", "beta"]
        assert client.get("/v1/models/beta").json()["id"] == "beta"
        for name in ("alpha", "beta"):
            r = client.post("/v1/chat/completions", json={"model": name, "max_tokens": 2,
                                                          "messages": [{"role": "user", "content": "Hi"}]})
            assert r.status_code == 200 and r.json()["model"] == name, r.text
        r = client.post("/v1/completions", json={"model": "beta", "prompt": "Hi", "max_tokens": 2, "stream": True})
        assert all(json.loads(line[6:])["model"] == "beta" for line in r.text.splitlines()
                   if line.startswith("data: {"))
        r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 404 and "`alpha`, `beta`" in r.json()["error"]["message"]
        assert 'model_name="alpha"' in client.get("/metrics").text
