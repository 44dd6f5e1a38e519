"""A label for a request still in flight — queued, prefilling, or decoding — is 409
`response_pending` (try again once it has finished), whether or not its prefill is
recorded: a client that gives up on 404, as the README says 404 means, loses no label.
Once the request has finished, the label is accepted; a request that cannot take one
says why once it has ended."""

import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_training
from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel, FeedbackOutcome

PARAMS = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def _label(training, request_id: str):
    """A chosen text against the served response, which only a finished request has."""
    return training.feedback.submit(FeedbackLabel(request_id, "Yes.", None, 0))


@pytest.mark.parametrize("record_fraction", [1.0, 0.0], ids=["recorded", "not-recorded"])
def test_a_label_for_a_request_in_flight_is_pending_until_it_has_finished(record_fraction):
    training = make_training(TrainConfig(mode="dpo", lora_rank=4, record_fraction=record_fraction))
    engine = engine_of(training)
    engine.add_request("r", encode("What is the capital of France?"), PARAMS, train=True)
    pending = []
    while engine.has_unfinished():
        result = _label(training, "r")
        pending.append((result.outcome, result.code))
        engine.step()
    assert set(pending) == {(FeedbackOutcome.CONFLICT, "response_pending")} and len(pending) >= 2  # queued, then on
    assert _label(training, "r").accepted
    assert "r" not in training.cache.expected


def test_a_request_that_takes_no_label_is_not_pending_and_says_why_once_ended():
    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    engine = engine_of(training)
    engine.add_request("off", encode("Hello"), PARAMS, train=False)
    assert _label(training, "off").code == "entry_not_found"  # never trainable: not expected
    engine.add_request("gone", encode("Hello"), PARAMS, train=True)
    engine.step()
    engine.abort_request("gone")
    while engine.has_unfinished():
        engine.step()
    assert "gone" not in training.cache.expected and _label(training, "gone").outcome is not FeedbackOutcome.CONFLICT


@pytest.mark.parametrize("record_fraction", [1.0, 0.0], ids=["recorded", "not-recorded"])
def test_a_label_naming_a_batch_of_prompts_in_flight_is_pending_too(record_fraction):
    """A /v1/completions request of two prompts keeps an entry per prompt (`<id>-<i>`);
    the batch's own id, with choices past prompt 0's, is answered alike."""
    training = make_training(TrainConfig(mode="dpo", lora_rank=4, record_fraction=record_fraction))
    engine = engine_of(training)
    params = SamplingParams(temperature=1.0, n=2, max_tokens=6, ignore_eos=True, seed=1)
    for i in range(2):
        engine.add_request(f"cmpl-b-{i}", encode(f"Prompt number {i}"), params, train=True)
    seen = set()
    while engine.has_unfinished():
        result = training.feedback.submit(FeedbackLabel("cmpl-b", None, None, None, 2, 3))
        seen.add((result.outcome, result.code))
        engine.step()
    assert seen == {(FeedbackOutcome.CONFLICT, "response_pending")}
    assert training.feedback.submit(FeedbackLabel("cmpl-b", None, None, None, 2, 3)).accepted


def test_a_request_is_pending_from_the_moment_it_is_made_before_the_device_thread_queues_it():
    """A stream's first chunk carries the id before the device thread has queued the
    request (it may be in a training slice): its label is pending from then on, and a
    request the engine then refuses is expected no more."""
    from engine.async_engine import AsyncEngine

    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    async_engine = AsyncEngine(engine_of(training))  # its loop not started: nothing reaches the device thread
    request = async_engine.make_request("early", encode("What is the capital of France?"), PARAMS, train=True)
    assert (_label(training, "early").outcome, _label(training, "early").code) == (FeedbackOutcome.CONFLICT,
                                                                                  "response_pending")
    engine_of(training).expect(request, expected=False)
    assert "early" not in training.cache.expected
