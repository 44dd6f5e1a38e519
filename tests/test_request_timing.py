"""A request's timings: its first scheduling is stamped when its first step begins, so
prefill time (first scheduled to first token) is the prefill's, not zero."""

import time

from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_engine


def test_prefill_time_is_the_first_steps_duration():
    engine = make_engine()
    engine.add_request("r", encode("The quick brown fox jumps over the lazy dog."),
                       SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    started = time.monotonic()
    finished = None
    while engine.has_unfinished():
        for out in engine.step()[0]:
            if out.finished:
                finished = out
    meta = finished.metrics
    assert meta.arrival_time <= meta.first_scheduled_time
    assert started <= meta.first_scheduled_time < meta.first_token_time  # the prefill took time
