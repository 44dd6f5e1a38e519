"""A thinking model's reasoning apart from its answer (`--reasoning-parser`, server/reasoning.py):
the split whatever pieces the text is decoded in, and over HTTP — chat completions whole
and streamed (read by the OpenAI SDK), with tools, the Responses API — on a tiny model
whose answer a `guided_choice` fixes."""

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from server.config import ServerConfig
from server.protocol_fields import ChatMessage
from server.reasoning import ReasoningSplitter, opens_reasoning
from server.responses import assistant_message
from tests.servers import TINY_NAME, ServerThread, long_context_app, tiny_app
from tests.test_responses_api import answer_of

# (text, whether the prompt opened a <think>) -> (reasoning, content)
SPLITS = [
    (("<think>\nLet me see.\n\nYes.\n</think>\n\nHello!", False), ("Let me see.\n\nYes.", "Hello!")),
    (("Let me see.\n</think>\n\nHello!", True), ("Let me see.", "Hello!")),  # DeepSeek-R1's template opens it
    (("Hello there.\n", False), ("", "Hello there.\n")),  # no reasoning: all content, as generated
    (("<think>\n\n</think>\n\nHi", False), ("", "Hi")),  # an empty thought
    (("  <think>\ncut by max_tokens", False), ("cut by max_tokens", "")),
    (("\nSee <think> here", False), ("", "\nSee <think> here")),  # a tag not first is text
    (("<thin", False), ("", "<thin")),  # the beginning of a tag, then the end
    (("a</think>b</think>c", True), ("a", "b</think>c")),  # the first close ends it
]


def split(text: str, in_reasoning: bool, size: int) -> tuple[str, str]:
    splitter = ReasoningSplitter(in_reasoning)
    reasoning = content = ""
    for start in range(0, len(text), size):
        r, c = splitter.feed(text[start:start + size])
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


@pytest.mark.parametrize("given, expected", SPLITS)
def test_the_split_is_the_same_whatever_the_pieces(given, expected):
    text, in_reasoning = given
    for size in range(1, len(text) + 1):
        assert split(text, in_reasoning, size) == expected, size


def test_a_prompt_opens_reasoning_where_it_ends_inside_a_think():
    assert opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # Qwen3, enable_thinking false
    assert not opens_reasoning("<|im_start|>assistant\n")


THOUGHT, ANSWER = "Two and two.", "It is 4."
FORCED = f"<think>\n{THOUGHT}\n</think>\n\n{ANSWER}"


@pytest.fixture(scope="module")
def server():
    with ServerThread(tiny_app(server=ServerConfig(reasoning_parser="qwen3"))) as running:
        yield running


def _ask(**extra) -> dict:
    """A chat body whose answer is FORCED (vLLM's `guided_choice`; through the SDK, its `extra_body`)."""
    return {"model": TINY_NAME, "messages": [{"role": "user", "content": "2+2?"}], "max_tokens": 40,
            "temperature": 0, "guided_choice": [FORCED], **extra}


def _sdk_ask(**extra) -> dict:
    body = _ask(**extra)
    choice = body.pop("guided_choice")
    return {**body, "extra_body": {"guided_choice": choice}}


def test_a_chat_completion_carries_the_reasoning_apart(server):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
    message = client.chat.completions.create(**_sdk_ask()).choices[0].message
    assert message.content == ANSWER
    assert message.model_extra["reasoning"] == message.model_extra["reasoning_content"] == THOUGHT


def test_streamed_deltas_carry_the_same_reasoning_and_content(server):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
    reasoning = content = ""
    for chunk in client.chat.completions.create(**_sdk_ask(), stream=True):
        for choice in chunk.choices:
            delta = choice.delta
            assert (delta.model_extra or {}).get("reasoning") == (delta.model_extra or {}).get("reasoning_content")
            reasoning += (delta.model_extra or {}).get("reasoning") or ""
            content += delta.content or ""
    assert (reasoning, content) == (THOUGHT, ANSWER)


# letters the tiny tokenizer has no merges of: a token of it is a letter or two, so that nine
# tokens end inside the thought, past its tag
LONG_THOUGHT = "<think>\n" + "qxzj" * 15 + "\n</think>\n\nDone."


@pytest.mark.parametrize("stream", [False, True])
def test_an_answer_cut_while_thinking_is_all_reasoning(server, stream):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
    answer = client.chat.completions.create(**_sdk_ask(max_tokens=9, guided_choice=[LONG_THOUGHT]), stream=stream)
    if stream:
        chunks = list(answer)
        reasoning = "".join((c.choices[0].delta.model_extra or {}).get("reasoning") or "" for c in chunks if c.choices)
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert content == "" and chunks[-1].choices[0].finish_reason == "length"
    else:
        message = answer.choices[0].message
        reasoning = message.model_extra["reasoning"]
        assert message.content is None and answer.choices[0].finish_reason == "length"
    assert reasoning and LONG_THOUGHT.startswith("<think>\n" + reasoning)


def test_an_answer_cut_at_its_tag_has_empty_reasoning_and_no_content():
    message, _ = assistant_message("<think>\n", None, ReasoningSplitter(False))
    assert message == {"role": "assistant", "content": None, "reasoning": "", "reasoning_content": ""}


@pytest.mark.parametrize("stream", [False, True])
def test_text_held_back_as_a_tags_beginning_is_sent_when_the_answer_ends(server, stream):
    body = _ask(guided_choice=["<thi"], stream=stream)
    response = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    if stream:
        deltas = [json.loads(line[6:])["choices"] for line in response.text.splitlines()
                  if line.startswith("data: {")]
        content = "".join(c[0]["delta"].get("content") or "" for c in deltas if c)
        assert not any(c and "reasoning" in c[0]["delta"] for c in deltas)
    else:
        content = response.json()["choices"][0]["message"]["content"]
    assert content == "<thi"


def test_a_prompt_that_ends_inside_a_think_starts_the_answer_in_reasoning(server):
    """As DeepSeek-R1's template opens the reasoning: here the client's own assistant turn, continued."""
    body = _ask(messages=[{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\n"}],
                continue_final_message=True, add_generation_prompt=False,
                guided_choice=[f"{THOUGHT}\n</think>\n\n{ANSWER}"])
    message = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120).json()["choices"][0]["message"]
    assert (message["reasoning"], message["content"]) == (THOUGHT, ANSWER)


def test_a_returned_message_sent_back_gives_the_template_its_reasoning(server):
    client = OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none")
    first = client.chat.completions.create(**_sdk_ask()).choices[0].message
    messages = [{"role": "user", "content": "2+2?"}, first, {"role": "user", "content": "And 3+3?"}]
    second = client.chat.completions.create(**_sdk_ask(messages=messages)).choices[0].message
    assert second.content == ANSWER
    sent_back = ChatMessage.model_validate(first.model_dump(exclude_none=True)).template_dict()
    assert sent_back["reasoning_content"] == THOUGHT  # what Qwen3's template renders in a tool loop


def test_without_a_parser_the_answer_is_the_text_as_generated():
    with TestClient(tiny_app()) as client:
        message = client.post("/v1/chat/completions", json=_ask()).json()["choices"][0]["message"]
    assert message == {"role": "assistant", "content": FORCED}


def test_tool_calls_are_parsed_from_the_answer_after_the_reasoning():
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    with TestClient(long_context_app(server=ServerConfig(reasoning_parser="deepseek_r1"))) as client:
        body = client.post("/v1/chat/completions", json=_ask(
            tools=tools, guided_choice=[f"<think>\nWeather.\n</think>\n\n{call}"], max_tokens=300)).json()
    choice = body["choices"][0]
    assert choice["message"]["reasoning"] == "Weather."
    assert [json.loads(c["function"]["arguments"]) for c in choice["message"]["tool_calls"]] == [{"city": "Rome"}]
    assert choice["finish_reason"] == "tool_calls"


def _answer(pieces: list[str], reason: str = "stop"):
    return answer_of(pieces, reason, ReasoningSplitter(False))


def _events_of(answer) -> list[dict]:
    async def run():
        events = [e async for e in answer.events()]
        return [json.loads(e.split(b"data: ", 1)[1]) for e in events]
    return asyncio.run(run())


def test_the_responses_api_gives_a_reasoning_item_before_the_message():
    pieces = [FORCED[i:i + 3] for i in range(0, len(FORCED), 3)]
    events = _events_of(_answer(pieces))
    final = events[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["reasoning", "message"]
    assert final["output"][0]["content"] == [{"type": "reasoning_text", "text": THOUGHT}]
    assert final["output"][1]["content"][0]["text"] == ANSWER
    kinds = [e["type"] for e in events]
    assert "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta") == THOUGHT
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    # as the SDK reads the stream's end: the whole response, its types those of the OpenAI SDK
    from openai.types.responses import Response
    parsed = Response.model_validate(final)
    assert parsed.output_text == ANSWER and parsed.output[0].content[0].text == THOUGHT


def test_a_response_cut_while_thinking_is_one_incomplete_reasoning_item():
    final = _events_of(_answer(["<think>\nTwo", " and"], reason="length"))[-1]["response"]
    assert final["status"] == "incomplete"
    assert [(item["type"], item["status"]) for item in final["output"]] == [("reasoning", "incomplete")]


def test_a_response_whose_text_was_held_back_as_a_tags_beginning_gets_it_at_the_end():
    final = _events_of(_answer(["<th"]))[-1]["response"]
    assert [(item["type"], item["content"][0]["text"]) for item in final["output"]] == [("message", "<th")]


def test_a_responses_output_sent_back_as_input_gives_the_template_its_reasoning():
    """OpenAI's loop, `input += response.output`, with a reasoning item before a call."""
    from server.protocol_responses import ResponsesRequest
    output = [{"type": "reasoning", "id": "rs_1", "summary": [], "status": "completed",
               "content": [{"type": "reasoning_text", "text": "Weather first."}]},
              {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "get_weather",
               "arguments": '{"city": "Rome"}', "status": "completed"},
              {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
              {"type": "reasoning", "id": "rs_2", "summary": [],
               "content": [{"type": "reasoning_text", "text": "So."}]},
              {"type": "message", "role": "assistant", "id": "msg_2", "status": "completed",
               "content": [{"type": "output_text", "text": "It is sunny.", "annotations": []}]},
              {"role": "user", "content": "Thanks"}]
    from server.protocol import ChatCompletionRequest
    chat = ResponsesRequest.model_validate({"model": TINY_NAME, "input": [
        {"role": "user", "content": "Weather in Rome?"}, *output]}).chat_body()
    messages = chat["messages"]
    turns = [m.template_dict() for m in ChatCompletionRequest.model_validate(chat).messages]  # as served
    assert [t.get("reasoning_content") for t in turns] == [None, "Weather first.", None, "So.", None]
    assert [(m["role"], m.get("reasoning_content"), m["content"]) for m in messages] == [
        ("user", None, "Weather in Rome?"), ("assistant", "Weather first.", None), ("tool", None, "sunny"),
        ("assistant", "So.", "It is sunny."), ("user", None, "Thanks")]
    assert messages[1]["tool_calls"][0]["function"]["name"] == "get_weather"


def test_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="granite")
