"""A stream consumer that falls behind the engine (a busy event loop) takes the outputs
that queued up meanwhile as one: the same tokens, text, log-probs and finish, in order,
in fewer chunks — what a prompt consumer gets one step at a time."""

import asyncio

from engine.async_engine import AsyncEngine
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob, merged
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_engine


def _output(index_texts, finished=False, prompt_logprobs=None):
    metrics = RequestMetrics(0.0, None, None, 3, 0)
    choices = [CompletionOutput(i, text, ids, [TokenLogprob(t, -0.5) for t in ids], reason, None, [-0.5] * len(ids))
               for i, text, ids, reason in index_texts]
    return RequestOutput("r", choices, finished, metrics, prompt_logprobs)


def test_merged_concatenates_each_choice_in_order_and_keeps_the_later_finish():
    first = _output([(0, "He", [1], None), (1, "A", [5], None)], prompt_logprobs=[None, TokenLogprob(2, -1.0)])
    second = _output([(0, "llo", [2, 3], "stop"), (1, "", [], None)], finished=False)
    out = merged(first, second)
    assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
        (0, "Hello", [1, 2, 3], "stop"), (1, "A", [5], None)]
    assert [lp.token_id for lp in out.outputs[0].logprobs] == [1, 2, 3]
    assert out.outputs[0].token_logprob_values == [-0.5] * 3
    assert out.prompt_logprobs == first.prompt_logprobs and out.metrics is second.metrics
    without = merged(_output([(0, "x", [1], None)]), _output([(0, "y", [2], None)]))
    without.outputs[0].logprobs = None
    assert merged(_output([(0, "", [], None)]), without).outputs[0].text == "xy"


def _collect(slow: bool) -> tuple[list[int], str, int, str | None]:
    engine = make_engine()
    async_engine = AsyncEngine(engine)
    params = SamplingParams(max_tokens=24, min_tokens=24, temperature=0.0, logprobs=1)

    async def run():
        async_engine.start()
        try:
            ids, text, chunks, reason = [], "", 0, None
            async for output in async_engine.generate(async_engine.make_request("r", encode("Hello there"), params)):
                chunks += 1
                ids += output.outputs[0].token_ids
                text += output.outputs[0].text
                reason = output.outputs[0].finish_reason
                assert len(output.outputs[0].logprobs) == len(output.outputs[0].token_ids)
                if slow:  # the engine runs several steps while this consumer is away
                    while async_engine.serving_steps < len(ids) + 4 and engine.has_unfinished():
                        await asyncio.sleep(0.005)
            return ids, text, chunks, reason
        finally:
            await async_engine.stop()

    return asyncio.run(run())


def test_a_consumer_that_falls_behind_gets_the_same_stream_in_fewer_outputs():
    prompt_ids, prompt_text, prompt_chunks, prompt_reason = _collect(slow=False)
    slow_ids, slow_text, slow_chunks, slow_reason = _collect(slow=True)
    assert len(prompt_ids) == 24 and prompt_reason == "length"
    assert (slow_ids, slow_text, slow_reason) == (prompt_ids, prompt_text, prompt_reason)
    # each time, the slow consumer is away for at least four steps (the prompt one may fall
    # behind too on a loaded machine: only the slow one's count is bounded)
    assert prompt_chunks >= slow_chunks and slow_chunks <= 24 // 4 + 2, (slow_chunks, prompt_chunks)
