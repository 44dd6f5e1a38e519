"""Training in the idle gaps gives way to serving at once: a request that arrives during
a long training run waits for at most the slice in progress (counted in slices, not in
seconds, which a loaded machine stretches)."""

import asyncio
import time

import pytest

from engine.async_engine import AsyncEngine
from trainer.config import TrainConfig
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_config
from tests.tiny import tiny_model, tiny_tokenizer
from server.build import build_training_engine
from trainer.arbiter import Arbiter

LONG_PROMPT = ("Continuous batching lets new requests join the running batch at every step. " * 12).strip()


@pytest.mark.slow  # a training run of 300 slices
def test_request_arriving_during_a_long_training_run_starts_within_one_slice():
    # every entry trains on its recording (stashed weights once stale): multi-slice jobs to preempt
    engine, trainer = build_training_engine(
        tiny_model("llama", hidden_size=256, num_layers=6), tiny_tokenizer(),
        make_config(max_model_len=512, kv_cache_bytes=64 << 20, max_num_batched_tokens=512),
        TrainConfig(mode="cpt", lora_rank=4, max_staleness=30, entries_per_step=1, cohort_max_entries=1))
    ids = encode(LONG_PROMPT)
    for i in range(30):  # a long training run: 30 recorded entries, ~10 slices each
        engine.add_request(f"r{i}", ids, SamplingParams(max_tokens=1), train=True)
        while engine.has_unfinished():
            engine.step()
    async_engine = AsyncEngine(engine, idle_hook=Arbiter(trainer))
    slices_at_step = []  # the slices finished when each engine step began
    step = engine.step

    def counting_step(*args, **kwargs):
        slices_at_step.append(trainer.stats.slices)
        return step(*args, **kwargs)

    engine.step = counting_step

    async def probe() -> tuple[float, int, int]:
        async_engine.start()
        try:
            while trainer.stats.slices < 25:  # well inside the run, mid-job
                await asyncio.sleep(0.001)
            remaining = len(trainer.cache)
            submitted, steps_before = trainer.stats.slices, len(slices_at_step)
            started = time.perf_counter()
            async for _ in async_engine.generate(async_engine.make_request("probe", encode("Hello"),
                                                                           SamplingParams(max_tokens=1))):
                waited = time.perf_counter() - started
                break
            slices_before_its_step = slices_at_step[steps_before] - submitted
            deadline = time.monotonic() + 600  # the rest of the run: seconds here, more on a loaded machine
            while trainer.has_work() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            return waited, remaining, slices_before_its_step
        finally:
            await async_engine.stop()

    waited, remaining, slices_before_its_step = asyncio.run(probe())
    print(f"waited {waited * 1000:.1f} ms, max slice {trainer.stats.max_slice_seconds * 1000:.1f} ms, "
          f"slices {trainer.stats.slices}, busy {trainer.stats.busy_seconds:.2f} s")
    assert remaining > 5  # the request really arrived during training
    assert trainer.stats.preemptions >= 1 and trainer.optimizer.version == 30  # the run resumed and finished
    # the request's own step came next, after at most the slice that was in progress
    assert slices_before_its_step <= 1, slices_before_its_step
