"""Serving steps follow each other on the device thread while nothing else is due: a
request's steps take one device item, not one round trip through the event loop each; a
device item that waits (an adapter rollback), or one cancelled before it began, is
honoured; a failed step's error comes after the tokens that preceded it. With
`async_output`, a step's tokens reach the loop from inside the next step, once its device
work is queued, and nothing changes in what each stream gets."""

import asyncio
import contextlib
import threading

import pytest

from fastapi.testclient import TestClient

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from server.config import ServerConfig
from tests.conftest import encode, make_engine
from tests.servers import TINY_NAME, tiny_app
from tests.test_server import sse_events
from tests.tiny import TEST_DEVICE

PARAMS = SamplingParams(max_tokens=30, min_tokens=30, temperature=0.0)


def _run(async_engine: AsyncEngine, body):
    async def main():
        async_engine.start()
        try:
            return await body()
        finally:
            await async_engine.stop()

    return asyncio.run(main())


def _counting_chains(async_engine: AsyncEngine) -> list[int]:
    """Counts the device items that ran serving steps (one per chain)."""
    chains = []
    serving_steps = async_engine._serving_steps

    def counted(messages):
        chains.append(1)
        return serving_steps(messages)

    async_engine._serving_steps = counted
    return chains


async def _tokens(async_engine: AsyncEngine, request_id: str) -> list[int]:
    ids = []
    async for output in async_engine.generate(async_engine.make_request(request_id, encode("Hello there"), PARAMS)):
        ids += output.outputs[0].token_ids
    return ids


def test_a_requests_steps_run_as_one_chain_with_the_same_tokens():
    engine = make_engine()
    reference = engine.generate([encode("Hello there")], PARAMS)[0][0]
    async_engine = AsyncEngine(engine)
    chains = _counting_chains(async_engine)
    tokens = _run(async_engine, lambda: _tokens(async_engine, "r"))
    assert tokens == reference
    assert async_engine.serving_steps >= 30 and len(chains) <= 3, (async_engine.serving_steps, len(chains))


def test_a_device_item_ends_a_chain_and_a_cancelled_one_does_not_stop_chaining():
    engine = make_engine()
    async_engine = AsyncEngine(engine)
    chains = _counting_chains(async_engine)
    step, steps, submitted, ran = engine.step, [], threading.Event(), []

    def step_held_at_the_fifth():  # the device waits, mid-request, until the item is queued
        steps.append(1)
        if len(steps) == 5:
            submitted.wait(60)
        return step()

    engine.step = step_held_at_the_fifth

    async def body():
        held = threading.Event()
        busy = asyncio.ensure_future(async_engine.run_on_device(held.wait, 60))
        cancelled = asyncio.ensure_future(async_engine.run_on_device(lambda: ran.append(1)))
        await asyncio.sleep(0)  # both submitted; the device holds the first, the second waits in the queue
        cancelled.cancel()  # before it began: it never runs
        with contextlib.suppress(asyncio.CancelledError):  # the cancel reaches the queued item on the loop's next
            await cancelled  # turn: freeing the device before then let it begin (a CI run under load)
        held.set()
        assert await busy
        served = asyncio.ensure_future(_tokens(async_engine, "r"))
        while len(steps) < 5:
            await asyncio.sleep(0.001)
        item = asyncio.ensure_future(async_engine.run_on_device(lambda: engine.has_unfinished()))
        await asyncio.sleep(0)  # submitted
        submitted.set()
        assert await item  # it ran at the next step boundary, mid-request
        return await served

    tokens = _run(async_engine, body)
    assert len(tokens) == 30 and not ran
    assert len(chains) <= 4, len(chains)  # chaining goes on after the cancelled item


@pytest.mark.parametrize("fails", ["before sampling", "after sampling"])
@pytest.mark.parametrize("async_output", [False, True])
def test_a_failed_steps_error_comes_after_the_tokens_before_it(async_output, fails):
    engine = make_engine()
    step, update, calls = engine.step, engine.outputs.update, []

    def failing_step():
        calls.append(1)
        if len(calls) == 12 and fails == "before sampling":
            raise RuntimeError("boom")
        return step()

    def failing_update(*args):  # after the step sampled its token (async_output sent the step before's then)
        if len(calls) == 12 and fails == "after sampling":
            raise RuntimeError("boom")
        return update(*args)

    engine.step, engine.outputs.update = failing_step, failing_update
    async_engine = AsyncEngine(engine, async_output=async_output)

    async def body():
        outputs = []
        async for output in async_engine.generate(async_engine.make_request("r", encode("Hello there"), PARAMS)):
            outputs.append(output)
            while len(calls) < 12:  # a consumer behind the engine: the outputs queue up
                await asyncio.sleep(0.005)
        return outputs

    outputs = _run(async_engine, body)
    assert outputs[-1].error is not None and outputs[-1].finished
    assert sum(len(o.outputs[0].token_ids) for o in outputs[:-1]) == 11  # every token before the failure
    assert engine.runner.sampler.before_read_back is None


def _deliveries(async_engine: AsyncEngine) -> list[tuple[str, bool]]:
    """For each chained step's results sent to the loop: the kind of the step running then,
    and whether they were sent from inside its sampling (its device work queued, before
    its read-back)."""
    engine = async_engine.engine
    sampler, scheduler, state, sent = engine.runner.sampler, engine.scheduler, threading.local(), []
    sample, schedule, deliver_soon = sampler.sample, scheduler.schedule, async_engine._deliver_soon

    def scheduling():
        scheduled = schedule()
        state.kind = scheduled.kind
        return scheduled

    def sampling(*args):
        state.sampling = True
        try:
            return sample(*args)
        finally:
            state.sampling = False

    def delivering(results):
        sent.append((getattr(state, "kind", ""), getattr(state, "sampling", False)))
        deliver_soon(results)

    sampler.sample, scheduler.schedule, async_engine._deliver_soon = sampling, scheduling, delivering
    return sent


async def _streams(async_engine: AsyncEngine, prompts: dict[str, str], params: SamplingParams) -> dict[str, list]:
    async def one(request_id, prompt):
        ids = []
        async for output in async_engine.generate(async_engine.make_request(request_id, encode(prompt), params)):
            ids += output.outputs[0].token_ids
        return ids
    results = await asyncio.gather(*(one(r, p) for r, p in prompts.items()))
    return dict(zip(prompts, results))


PROMPTS = {"a": "Hello there", "b": "What is the capital of France?", "c": "The quick brown fox " * 12}


def test_with_async_output_a_steps_tokens_go_to_the_loop_from_inside_the_next_decode_steps_sampling():
    """Each stream gets the same tokens either way. With async_output a chained step's
    results are sent from inside the next step: while a decode step's device work is
    queued, before its read-back; as any other step begins (a prefill's forward is longer:
    the long prompt is prefilled in chunks of 16 tokens, steps of their own)."""
    params = SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0, logprobs=2)
    streamed, sent = {}, {}
    for async_output in (False, True):
        async_engine = AsyncEngine(make_engine(max_num_batched_tokens=16), async_output=async_output)
        sent[async_output] = _deliveries(async_engine)

        async def body():  # the long one alone (its prefill's chunks are steps of their own), then two together
            alone = await _streams(async_engine, {"c": PROMPTS["c"]}, params)
            return {**alone, **await _streams(async_engine, {"a": PROMPTS["a"], "b": PROMPTS["b"]}, params)}

        streamed[async_output] = _run(async_engine, body)
        assert async_engine.engine.runner.sampler.before_read_back is None  # nothing left for a later step
    assert streamed[True] == streamed[False] and all(len(ids) == 12 for ids in streamed[True].values())
    assert not any(sampling for _, sampling in sent[False])
    assert len(sent[True]) >= 20 and all(sampling == (kind == "decode") for kind, sampling in sent[True]), sent
    assert sum(kind == "prefill" for kind, _ in sent[True]) >= -(-len(encode(PROMPTS["c"])) // 16) - 1, sent


def test_a_server_with_async_output_streams_what_it_answers_whole_and_auto_is_on_only_on_a_gpu():
    assert tiny_app().state.alchemist.engine.async_output == (TEST_DEVICE.type == "cuda")
    app = tiny_app(server=ServerConfig(async_output="on"))
    assert app.state.alchemist.engine.async_output
    body = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 10,
            "temperature": 0, "ignore_eos": True}
    with TestClient(app) as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as r:
            events = sse_events(r)[:-1]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in events) == whole


def test_an_observer_that_raises_loses_no_request(caplog):
    """A fault in training's recorder on a finished request's output raised out of the
    step: its output was lost with it, and the client waited for ever (a bookkeeping slip
    of this round's did so). An observer's fault is logged; serving goes on."""
    class Faulty:
        def on_step(self, stats):
            raise RuntimeError("on_step")

        def on_output(self, output):
            if output.finished:
                raise RuntimeError("on_output")

    engine = make_engine(observers=(Faulty(),))
    with caplog.at_level("ERROR"):
        tokens = engine.generate([encode("Hello there")], SamplingParams(temperature=0.0, max_tokens=4,
                                                                          ignore_eos=True))
    assert len(tokens[0][0]) == 4
    assert any("Faulty failed" in r.getMessage() for r in caplog.records)
