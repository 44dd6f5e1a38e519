"""Serving steps follow each other on the device thread while nothing else is due: a
request's steps take one device item, not one round trip through the event loop each; a
device item that waits (an adapter rollback), or one cancelled before it began, is
honoured; a failed step's error comes after the tokens that preceded it."""

import asyncio
import threading
import time

from engine.async_engine import AsyncEngine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_engine

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
    step, steps, submitted = engine.step, [], threading.Event()

    def step_held_at_the_fifth():  # the device waits, mid-request, until the item is queued
        steps.append(1)
        if len(steps) == 5:
            submitted.wait(60)
        return step()

    engine.step = step_held_at_the_fifth

    async def body():
        busy = asyncio.ensure_future(async_engine.run_on_device(time.sleep, 0.3))
        await asyncio.sleep(0.05)  # the device is busy: the next item waits in the queue
        cancelled = asyncio.ensure_future(async_engine.run_on_device(time.sleep, 0.3))
        await asyncio.sleep(0.01)
        cancelled.cancel()  # before it began (unless the machine is slow): it never runs
        await busy
        served = asyncio.ensure_future(_tokens(async_engine, "r"))
        while len(steps) < 5:
            await asyncio.sleep(0.001)
        item = asyncio.ensure_future(async_engine.run_on_device(lambda: engine.has_unfinished()))
        await asyncio.sleep(0)  # submitted
        submitted.set()
        assert await item  # it ran at the next step boundary, mid-request
        return await served

    tokens = _run(async_engine, body)
    assert len(tokens) == 30
    assert len(chains) <= 4, len(chains)  # chaining goes on after the cancelled item


def test_a_failed_steps_error_comes_after_the_tokens_before_it():
    engine = make_engine()
    step, calls = engine.step, []

    def failing_step():
        calls.append(1)
        if len(calls) == 12:
            raise RuntimeError("boom")
        return step()

    engine.step = failing_step
    async_engine = AsyncEngine(engine)

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
