"""Labels that once failed a training job, and what a failed job costs the others: rewards
that differ only past float32's precision or lie past its range, a one-token CPT prompt,
and any entry whose job raises — which is dropped alone, the other entries of its job
training again (it dropped them all, with their gradients, and said they were dropped)."""

import math

from engine.sampling_params import SamplingParams
from tests.conftest import engine_of
from tests.test_grpo import make_trainer, reward, serve_group
from tests.test_training import serve
from trainer.entries import EntryState


def _states(training, ids) -> dict[str, str]:
    ended = {request_id: training.cache.ended_state(request_id) for request_id in ids}
    return {request_id: state.value if state is not None else None for request_id, state in ended.items()}


def test_rewards_equal_in_float32_but_not_in_float64_or_past_its_range_train_with_the_others():
    training = make_trainer(entries_per_step=3)
    rewards = {"a": (1.0, 0.0, 0.5, 0.0), "near": (0.1 + 0.2, 0.3, 0.3, 0.3), "huge": (1e39, 0.0, 0.0, 0.0)}
    for seed, (request_id, values) in enumerate(rewards.items()):
        serve_group(training, request_id, seed=seed + 1)
        assert reward(training, request_id, values).accepted
    training.train_until_idle()
    assert training.stats.copy().failed_jobs == 0 and math.isfinite(training.stats.copy().last_loss)
    assert _states(training, rewards) == dict.fromkeys(rewards, "trained")
    assert training.optimizer.version == 1


def test_a_one_token_prompt_scores_nothing_and_fails_no_job():
    training = make_trainer(mode="cpt", entries_per_step=2)
    serve(training, "fact", prompt="Paris is the capital of France.")
    engine = engine_of(training)
    engine.add_request("one", [7], SamplingParams(max_tokens=2, ignore_eos=True), train=True)  # a single token
    while engine.has_unfinished():
        engine.step()
    training.train_until_idle()
    assert training.stats.copy().failed_jobs == 0
    assert _states(training, ["fact", "one"]) == {"fact": "trained", "one": "trained"}


def test_a_job_that_fails_on_one_entry_drops_that_entry_alone():
    training = make_trainer(entries_per_step=3)
    for seed, request_id in enumerate(("first", "bad", "last")):
        serve_group(training, request_id, seed=seed + 1)
        assert reward(training, request_id).accepted
    method = training.method
    reuse, recompute = method.reuse_job, method.recompute_job

    def failing(job):
        def run(entry, ctx):
            if entry.completion_id == "bad":
                raise RuntimeError("a bug in one entry's job")
            return (yield from job(entry, ctx))
        return run

    method.reuse_job, method.recompute_job = failing(reuse), failing(recompute)
    training.train_until_idle()
    assert training.stats.copy().failed_jobs == 1
    assert _states(training, ["first", "bad", "last"]) == {"first": "trained", "bad": "dropped", "last": "trained"}
    assert training.cache.count(EntryState.READY) == 0 and training.optimizer.version >= 1
