"""Labels that once failed a training job, and what a failed job costs the others: rewards
that differ only past float32's precision or lie past its range, a one-token CPT prompt,
any entry whose job raises — which is dropped alone, the other entries of its job
training again (it dropped them all, with their gradients, and said they were dropped) —
and a step skipped for a non-finite loss or gradient, whose entries are in no weights (they
used to end `trained` into no version, so a restart never trained their labels again)."""

import dataclasses
import math

from engine.sampling_params import SamplingParams
from tests.conftest import engine_of
from tests.test_grpo import make_trainer, reward, serve_group
from tests.test_training import serve
from trainer.entries import EntryState


class _Fates:
    """The cache's journal, as the ledger is: each entry's fate and its reason."""

    def __init__(self):
        self.reasons: dict[str, tuple[str, str | None]] = {}

    def record_fate(self, request_id, fate, version=None, path=None, reason=None):
        self.reasons[request_id] = (fate, reason)


def _jobs_where(training, change) -> None:
    """Every job of the method runs through `change(entry, job)`."""
    method = training.method
    reuse, recompute = method.reuse_job, method.recompute_job
    method.reuse_job = lambda entry, ctx: change(entry, reuse(entry, ctx))
    method.recompute_job = lambda entry, ctx: change(entry, recompute(entry, ctx))


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

    def failing(entry, job):
        if entry.completion_id == "bad":
            raise RuntimeError("a bug in one entry's job")
        return (yield from job)

    _jobs_where(training, failing)
    training.train_until_idle()
    assert training.stats.copy().failed_jobs == 1
    assert _states(training, ["first", "bad", "last"]) == {"first": "trained", "bad": "dropped", "last": "trained"}
    assert training.cache.count(EntryState.READY) == 0 and training.optimizer.version >= 1


def _three_labelled_groups(training) -> list[str]:
    ids = ["first", "bad", "last"]
    for seed, request_id in enumerate(ids):
        serve_group(training, request_id, seed=seed + 1)
        assert reward(training, request_id).accepted
    return ids


def test_a_step_skipped_for_one_entrys_non_finite_loss_drops_it_and_trains_the_others_again():
    training = make_trainer(entries_per_step=3)
    training.cache.journal = fates = _Fates()
    ids = _three_labelled_groups(training)

    def nan_loss(entry, job):
        result = yield from job
        return dataclasses.replace(result, loss=math.nan) if entry.completion_id == "bad" else result

    _jobs_where(training, nan_loss)
    training.train_until_idle()
    assert training.optimizer.skipped_steps == 1 and training.optimizer.version == 1
    assert _states(training, ids) == {"first": "trained", "bad": "dropped", "last": "trained"}
    assert fates.reasons["bad"] == ("dropped", "non_finite_loss")
    assert sum(training.stats.copy().trained_entries.values()) == 2  # counted once, when their step applied


def test_a_gradient_that_is_never_finite_drops_its_entries_after_one_retry():
    training = make_trainer(entries_per_step=3)
    training.cache.journal = fates = _Fates()
    ids = _three_labelled_groups(training)
    optimizer = training.optimizer
    step = optimizer.step

    def poisoned_step(*args, **kwargs):
        optimizer.params[0].grad[0, 0] = math.inf
        return step(*args, **kwargs)

    def deleted_meanwhile_and_poisoned(*args, **kwargs):  # as a deletion while a replicas' round runs
        training.cache.deleted_ids.add("first")
        return poisoned_step(*args, **kwargs)

    optimizer.step = deleted_meanwhile_and_poisoned
    training.train_until_idle()
    assert optimizer.skipped_steps == 2 and optimizer.version == 0
    assert fates.reasons == {"first": ("dropped", "deleted"), **dict.fromkeys(ids[1:], ("dropped", "step_skipped"))}
    assert training.stats.copy().trained_entries == {} and training.cache.count(EntryState.READY) == 0
