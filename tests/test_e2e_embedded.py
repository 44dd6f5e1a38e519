"""End to end: `alchemist serve` on the embedded SmolLM2-135M-Instruct, driven by the
official OpenAI Python SDK over real HTTP."""

import concurrent.futures
import time

import httpx
import openai
import pytest

from bench.launch import running_server
from bench.report import read_metric

pytestmark = pytest.mark.slow

MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server_url():
    with running_server() as url:
        yield url


@pytest.fixture(scope="module")
def client(server_url):
    return openai.OpenAI(base_url=f"{server_url}/v1", api_key="unused")


def test_sdk_chat_streaming_and_completions(client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content":
                                           "What is the capital of France?"}], max_tokens=20, temperature=0)
    assert "Paris" in reply.choices[0].message.content
    assert reply.usage.completion_tokens > 0

    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say hello."}],
                                            max_tokens=12, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices == [] and 0 < chunks[-1].usage.completion_tokens <= 12
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason in ("stop", "length")

    scored = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=0, echo=True,
                                       logprobs=1)
    lp = scored.choices[0].logprobs
    assert scored.choices[0].text == "The capital of France is"
    assert lp.token_logprobs[0] is None and all(v < 0 for v in lp.token_logprobs[1:])


def test_the_quick_start_question_without_a_temperature_gets_a_sensible_answer(client):
    """The README's first request leaves temperature out: the embedded model's defaults
    (its model card's temperature 0.2, top_p 0.9) apply, not OpenAI's temperature 1."""
    for seed in range(3):
        reply = client.chat.completions.create(model=MODEL, max_tokens=20, seed=seed, messages=[
            {"role": "user", "content": "What is the capital of France?"}])
        assert "Paris" in reply.choices[0].message.content, reply.choices[0].message.content


def test_sdk_errors_are_typed(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], temperature=9)
    assert info.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])


def engine_steps(server_url: str) -> float:
    return read_metric(httpx.get(f"{server_url}/metrics").text, "alchemist:serving_step_seconds_count")


def test_eight_concurrent_requests_are_batched_into_fewer_steps_and_finish_faster(client, server_url):
    """Continuous batching: eight requests at once take a fraction of the steps of eight in
    turn (the count is what batching changes), and less time — by a margin wide enough
    for a machine whose load changes between the two runs."""
    def one(i):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Tell me about the number {i}."}],
            max_tokens=24, temperature=0, extra_body={"min_tokens": 24})

    one(0)
    steps, started = engine_steps(server_url), time.perf_counter()
    sequential = [one(i) for i in range(8)]
    sequential_s, sequential_steps = time.perf_counter() - started, engine_steps(server_url) - steps
    steps, started = engine_steps(server_url), time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        concurrent_replies = list(pool.map(one, range(8)))
    concurrent_s, concurrent_steps = time.perf_counter() - started, engine_steps(server_url) - steps
    assert [r.choices[0].message.content for r in concurrent_replies] == \
        [r.choices[0].message.content for r in sequential]
    assert sequential_steps / concurrent_steps >= 3.0, (sequential_steps, concurrent_steps)
    assert sequential_s / concurrent_s >= 1.5, (sequential_s, concurrent_s)
