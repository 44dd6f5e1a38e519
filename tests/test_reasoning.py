"""A thinking model's reasoning apart from its answer (`--reasoning-parser`, server/reasoning.py):
the split whatever pieces the text is decoded in, and over HTTP — chat completions whole
and streamed (read by the OpenAI SDK), with tools, the Responses API — on a tiny model
whose answer a `guided_choice` fixes."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient
from openai import OpenAI

from server.config import ServerConfig
from server.reasoning import ReasoningSplitter, opens_reasoning
from tests.conftest import encode
from tests.servers import TINY_NAME, ServerThread, long_context_app, tiny_app

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
            "guided_choice": [FORCED], **extra}


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


def test_an_answer_cut_while_thinking_is_all_reasoning(server):
    client = TestClient(server.app)
    body = client.post("/v1/chat/completions", json=_ask(max_tokens=len(encode("<think>\nTwo")) + 1)).json()
    message = body["choices"][0]["message"]
    assert message["content"] is None and message["reasoning"] and FORCED.startswith("<think>\n" + message["reasoning"])
    assert body["choices"][0]["finish_reason"] == "length"


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
    """A response's `Answer` over decoded `pieces` (the last ending for `reason`), with the qwen3 parser."""
    from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
    from engine.sampling_params import SamplingParams
    from server.protocol_responses import ResponsesRequest
    from server.responses_api import Answer
    from server.routes_openai import ChatRun

    async def outputs():
        for i, piece in enumerate(pieces):
            last = i == len(pieces) - 1
            yield RequestOutput("resp-1", [CompletionOutput(0, piece, [1], None, reason if last else None)], last,
                                RequestMetrics(0.0, None, None, 3, i + 1))

    body = ResponsesRequest.model_validate({"model": TINY_NAME, "input": "2+2?"})
    return Answer(ChatRun("resp-1", SamplingParams(), 3, outputs(), None, [ReasoningSplitter(False)]), body, 0)


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


def test_an_unknown_parser_is_refused_at_start():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ServerConfig(reasoning_parser="granite")
