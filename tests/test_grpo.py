"""GRPO on groups: the loss against hand-computed values; the shared-prefix schedule on
the served recording against the dense trainer (same gradients, offloading on and off);
group entries, rewards and their errors; DPO between two served choices."""

import math
import sys
import time
import types

import pytest
import torch

from engine.sampling_params import SamplingParams
from offload.config import OffloadConfig
from tests.conftest import encode, engine_of, make_training
from tests.test_training import PROMPT, gradients_of, relative_difference
from tests.tiny import FAMILIES
from trainer.adapter import lora_gradients, lora_parameters
from trainer.entries import EntryState, GroupEntry
from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel, FeedbackOutcome
from trainer.forward import forward_segments
from trainer.losses import group_advantages, grpo_token_loss, token_logprobs
from engine.model_runner import run_to_end

GROUP = 4


def make_trainer(family="llama", mode="grpo", offload=None, fork_choices=True, **train_kwargs):
    torch.manual_seed(0)
    return make_training(TrainConfig(mode=mode, lora_rank=4, **train_kwargs), family, offload,
                         fork_choices=fork_choices, init_lora_weights=False)


def serve_group(trainer, request_id="g", n=GROUP, max_tokens=8, prompt=PROMPT, seed=1, temperature=1.0,
                logprobs=None, served_logprobs=None) -> list[list[int]]:
    """The group's choices' token ids; `served_logprobs`, a dict, takes each choice's
    log-probs as the client was answered them (`logprobs`: how many alternatives asked for)."""
    engine = engine_of(trainer)
    params = SamplingParams(n=n, temperature=temperature, seed=seed, max_tokens=max_tokens, ignore_eos=True,
                            logprobs=logprobs)
    engine.add_request(request_id, encode(prompt), params, train=True)
    choices = [[] for _ in range(n)]
    while engine.has_unfinished():
        outputs, _ = engine.step()
        for out in outputs:
            for c in out.outputs:
                choices[c.index] += c.token_ids
                if served_logprobs is not None:
                    served_logprobs.setdefault(c.index, []).extend(c.logprobs or [])
    return choices


def reward(trainer, request_id="g", rewards=(1.0, 0.0, 0.5, 0.0)):
    return trainer.feedback.submit(FeedbackLabel(request_id, rewards=list(rewards)))


@pytest.mark.parametrize("fork_choices", [True, False])
def test_every_choice_keeps_its_served_log_probs_forked_or_not(fork_choices):
    """An outside review: with `scheduler.fork_choices = false` only choice 0 tracked them,
    so the others' ratio to the old policy read 1 and clipping did nothing."""
    trainer = make_trainer(fork_choices=fork_choices)
    served = serve_group(trainer, max_tokens=6)
    entry = trainer.cache.get("g")
    assert sorted(entry.served_token_logps) == list(range(GROUP))
    assert all(len(entry.served_token_logps[i]) == len(served[i]) == 6 for i in range(GROUP))


# -- the loss ------------------------------------------------------------------------------

def test_group_advantages_are_normalised_by_the_group():
    advantages = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]))
    std = math.sqrt(1 / 3)  # unbiased: sum of squares 1, over 3
    assert advantages.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4)] * 1
                                                + [-0.5 / (std + 1e-4), 0.5 / (std + 1e-4)], rel=1e-6)
    assert group_advantages(torch.tensor([2.0, 2.0, 2.0])).tolist() == [0.0, 0.0, 0.0]
    # an outside pass: rewards of 1e300 were accepted and gave all-zero advantages (the spread's square overflowed)
    for rewards in ([1e300, 0.0, 0.0, 0.0], [1e308, -1e308, 0.0, 1.0], [1e308, 1e308, 0.0, 0.0]):
        scale = max(abs(r) for r in rewards)
        expected = group_advantages(torch.tensor([r / scale for r in rewards], dtype=torch.float64)).tolist()
        assert group_advantages(torch.tensor(rewards, dtype=torch.float64)).tolist() == pytest.approx(expected)
        assert any(a != 0 for a in expected)


def test_grpo_token_loss_clips_the_ratio_as_the_paper_says():
    logps = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    served = torch.tensor([-1.3, -2.0, -0.2])  # ratios e^0.3 (above 1.2), 1, e^-0.3 (below 0.8)
    r = [math.exp(0.3), 1.0, math.exp(-0.3)]
    # positive advantage: min(r·A, clip(r)·A) clips the high ratio only
    loss = grpo_token_loss(logps, served, 2.0, 0.5)
    assert loss.item() == pytest.approx(-0.5 * 2.0 * (1.2 + 1.0 + r[2]), rel=1e-6)
    loss.backward()
    # d/dlogp of −w·A·r is −w·A·r where unclipped, 0 where the clip binds
    assert logps.grad.tolist() == pytest.approx([0.0, -1.0, -r[2]], rel=1e-6)
    # negative advantage: the low ratio is clipped (min picks the larger magnitude)
    loss = grpo_token_loss(logps.detach(), served, -1.0, 1.0)
    assert loss.item() == pytest.approx(r[0] + 1.0 + 0.8, rel=1e-6)


def test_grpo_kl_term_is_the_papers_estimator():
    logps = torch.tensor([-1.0, -2.0])
    reference = torch.tensor([-1.5, -1.0])
    loss = grpo_token_loss(logps, logps, 0.0, 1.0, reference_logps=reference, beta=0.1)
    expected = sum(math.exp(d) - d - 1 for d in (-0.5, 1.0)) * 0.1
    assert loss.item() == pytest.approx(expected, rel=1e-6)


# -- the shared-prefix schedule against the dense trainer ------------------------------------

@pytest.mark.parametrize("family, beta, temperature", [(family, beta, 1.0) for family in FAMILIES
                                                       for beta in (0.0, 0.05)] + [("llama", 0.05, 0.7)])
def test_reuse_and_recompute_give_the_same_gradients(family, beta, temperature):
    trainer = make_trainer(family, grpo_beta=beta)
    served = serve_group(trainer, temperature=temperature)
    entry = trainer.cache.get("g")
    assert entry.logprob_temperature == temperature
    assert isinstance(entry, GroupEntry) and entry.recording is not None
    assert [entry.responses[i] for i in range(GROUP)] == served
    assert all(len(entry.served_token_logps[i]) == len(served[i]) for i in range(GROUP))
    assert reward(trainer).accepted
    method, context = trainer.method, trainer.context
    reuse = gradients_of(trainer, method.reuse_job(entry, context))
    packed = gradients_of(trainer, method.recompute_job(entry, context))  # the prompt once, the group after it
    method.recompute_rows = GROUP  # the dense trainer's: the prompt once per row
    batched = gradients_of(trainer, method.baseline_job(entry, context))
    method.recompute_rows = 1
    one_row = gradients_of(trainer, method.baseline_job(entry, context))
    method.recompute_rows = None  # micro-batches of as many rows as fit the token bound
    prompt_len, longest = len(entry.prompt_token_ids), max(map(len, served))
    method.recompute_tokens = 2 * (prompt_len + longest)
    assert method._rows_per_forward(prompt_len, method._samples(entry)) == 2
    micro = gradients_of(trainer, method.baseline_job(entry, context))
    method.recompute_tokens = prompt_len + 2 * longest  # packs of the prompt and two samples
    assert method._samples_per_pack(prompt_len, [s[1] for s in method._samples(entry)]) == 2
    packs = gradients_of(trainer, method.recompute_job(entry, context))
    assert len(reuse) == len(lora_parameters(trainer.peft_model))
    assert all(g.norm() > 0 for g in batched.values())
    for other in (reuse, packed, one_row, micro, packs):
        assert relative_difference(other, batched) <= 1e-5


def test_reuse_suffixes_one_at_a_time_give_the_batched_gradients():
    """The samples' suffixes go in batches as large as the dense trainer's token bound
    holds (the whole group without one), or one at a time: the same gradients."""
    grads = {}
    for rows in (None, 1):
        trainer = make_trainer()
        serve_group(trainer)
        assert reward(trainer).accepted
        entry, method = trainer.cache.get("g"), trainer.method
        samples = [s for s in method._samples(entry) if len(s[1]) > 1]
        method.recompute_tokens = None if rows is None else max(len(s[1]) for s in samples)  # room for one
        assert method._suffix_rows(trainer.context, samples) == (rows or len(samples)) > 0
        grads[rows] = gradients_of(trainer, method.reuse_job(entry, trainer.context))
    assert relative_difference(grads[1], grads[None]) <= 1e-5


@pytest.mark.parametrize("policy", ["load", "recompute"])
def test_reuse_gradients_equal_with_every_layer_offloaded(policy):
    reference_trainer = make_trainer()
    serve_group(reference_trainer)
    reward(reference_trainer)
    entry = reference_trainer.cache.get("g")
    reference = gradients_of(reference_trainer, reference_trainer.method.reuse_job(entry, reference_trainer.context))
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40, policy=policy))
    serve_group(trainer)
    trainer.offloader.free_to(0)
    reward(trainer)
    entry = trainer.cache.get("g")
    grads = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    stats = trainer.offloader.stats
    assert stats.reloaded_layers + stats.recomputed_layers == len(engine_of(trainer).runner.layers)
    assert relative_difference(grads, reference) <= 1e-5


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_served_token_logprobs_equal_the_training_forward(temperature):
    """At the serving version the ratio is 1: decoding's log-probs are the sampling
    distribution's, the model's logits over the group's temperature (TRL's), while those the
    client asked for stay the model's own (OpenAI's and vLLM's)."""
    trainer = make_trainer()
    answered = {}
    serve_group(trainer, temperature=temperature, logprobs=2, served_logprobs=answered)
    entry = trainer.cache.get("g")
    assert entry.logprob_temperature == temperature
    runner, prompt_len = engine_of(trainer).runner, len(entry.prompt_token_ids)
    prefix = [(s.key.detach(), s.value.detach()) for s in entry.recording.segments]
    last = entry.recording.logits[-1:].detach()
    with torch.no_grad():
        for i in range(GROUP):
            response = torch.tensor(entry.responses[i])
            fwd = run_to_end(forward_segments(runner, [entry.responses[i][:-1]], [prompt_len], prefix, False))
            logits = torch.cat([last, runner.lm_head(runner.norm(fwd.head_leaf[0]))])
            assert token_logprobs(logits, response, temperature).tolist() == pytest.approx(
                entry.served_token_logps[i], abs=1e-4)
            own = logits.float().log_softmax(-1)
            assert [lp.logprob for lp in answered[i]] == pytest.approx(own.gather(1, response[:, None])[:, 0].tolist(),
                                                                       abs=1e-4)
            assert [[t for t, _ in lp.top] for lp in answered[i]] == own.topk(2).indices.tolist()


@pytest.mark.parametrize("temperature", [0.7, 1.6])
def test_the_loss_is_trls_on_the_sampling_distribution(temperature):
    """GRPO's loss written out as TRL's GRPOTrainer computes it (`prompt + completion` rows
    through the PEFT model, the logits over the sampling temperature, the clipped ratio
    against the served log-probs, each sample's mean over its tokens, the mean over the
    group): the reuse job's gradients equal its. A trainer that took the model's own
    log-probs would read a ratio other than 1 here and give other gradients."""
    trainer = make_trainer()
    served = serve_group(trainer, temperature=temperature)
    rewards = (1.0, 0.0, 0.5, 0.0)
    assert reward(trainer, rewards=rewards).accepted
    entry = trainer.cache.get("g")
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    prompt, advantages = entry.prompt_token_ids, group_advantages(torch.tensor(rewards)).tolist()
    loss = 0.0
    for i, response in enumerate(served):
        logits = trainer.peft_model(torch.tensor([prompt + response[:-1]])).logits[0, len(prompt) - 1:]
        logps = (logits.float() / temperature).log_softmax(-1).gather(1, torch.tensor(response)[:, None])[:, 0]
        ratio = torch.exp(logps - torch.tensor(entry.served_token_logps[i]))
        assert ratio.detach().tolist() == pytest.approx([1.0] * len(response), abs=1e-4)
        surrogate = torch.minimum(ratio * advantages[i], ratio.clamp(0.8, 1.2) * advantages[i])
        loss = loss - surrogate.mean() / len(served)
    trainer.optimizer.zero_grad()
    loss.backward()
    assert relative_difference(reuse, lora_gradients(trainer.peft_model)) <= 1e-4


def test_the_group_is_prefilled_and_recorded_once():
    trainer = make_trainer()
    engine = engine_of(trainer)
    prompt_len = len(encode(PROMPT))
    computed = 0
    engine.add_request("g", encode(PROMPT), SamplingParams(n=GROUP, temperature=1.0, seed=0, max_tokens=4,
                                                           ignore_eos=True), train=True)
    while engine.has_unfinished():
        _, stats = engine.step()
        computed += stats.num_scheduled_tokens
    assert computed == prompt_len + GROUP * 3  # one prefill; each choice's first token sampled from it
    assert trainer.stats.recorded == 1 and len(trainer.cache) == 1


def test_a_group_trains_and_moves_the_adapter():
    trainer = make_trainer()
    serve_group(trainer)
    assert reward(trainer).accepted
    before = [p.detach().clone() for p in lora_parameters(trainer.peft_model)]
    trainer.train_until_idle()
    assert trainer.stats.trained_entries[("grpo", "reuse")] == 1
    assert trainer.optimizer.version == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, lora_parameters(trainer.peft_model)))
    assert trainer.stats.rewarded_groups == 1 and trainer.stats.rewards_received == GROUP


def test_rewards_near_float64s_limit_read_finite_in_the_groups_mean():
    trainer = make_trainer()
    serve_group(trainer)
    assert reward(trainer, rewards=(1e308, 1e308, 0.0, 1.0)).accepted
    assert trainer.stats.last_group_mean_reward == pytest.approx(5e307)  # the sum of the rewards overflows
    trainer.train_until_idle()
    assert trainer.stats.trained_entries[("grpo", "reuse")] == 1


def test_stale_group_trains_on_its_recording_with_stashed_weights():
    trainer = make_trainer()
    serve_group(trainer, "old")
    serve_group(trainer, "new", seed=2)
    reward(trainer, "new")
    trainer.train_until_idle()  # version 1: "old" is one version stale
    reward(trainer, "old")
    trainer.train_until_idle()
    assert trainer.stats.trained_entries.get(("grpo", "stashed"), 0) == 1


# -- rewards over the feedback API ------------------------------------------------------------

def test_reward_errors_are_refused_with_the_field_at_fault():
    trainer = make_trainer()
    serve_group(trainer)
    cases = [([1.0, 0.0], "rewards", FeedbackOutcome.INVALID),
             ([1.0, math.inf, 0.0, 0.0], "rewards", FeedbackOutcome.INVALID),
             ([1.0, math.nan, 0.0, 0.0], "rewards", FeedbackOutcome.INVALID)]
    for rewards, param, outcome in cases:
        result = trainer.feedback.submit(FeedbackLabel("g", rewards=rewards))
        assert (result.outcome, result.param) == (outcome, param), result
    result = trainer.feedback.submit(FeedbackLabel("g", chosen="Paris."))
    assert (result.outcome, result.param) == (FeedbackOutcome.INVALID, "rewards")
    assert trainer.feedback.submit(FeedbackLabel("nope", rewards=[1.0])).outcome is FeedbackOutcome.UNKNOWN
    assert reward(trainer).accepted
    again = reward(trainer)
    assert (again.outcome, again.code) == (FeedbackOutcome.CONFLICT, "label_exists")


def test_a_single_choice_request_is_not_a_group():
    trainer = make_trainer()
    serve_group(trainer, "single", n=1)
    result = trainer.feedback.submit(FeedbackLabel("single", rewards=[1.0]))
    assert (result.outcome, result.param, result.code) == (FeedbackOutcome.INVALID, "id", "not_a_group")
    assert trainer.stats.recorded == 0


def test_equal_rewards_are_counted_not_trained():
    trainer = make_trainer()
    serve_group(trainer)
    result = reward(trainer, rewards=[0.5] * GROUP)
    assert result.accepted and result.skipped
    trainer.train_until_idle()
    assert trainer.optimizer.version == 0
    assert trainer.stats.zero_advantage_groups == 1
    assert trainer.cache.ended_counts["skipped"] == 1
    assert reward(trainer).outcome is FeedbackOutcome.CONFLICT


# -- the reward function -------------------------------------------------------------------

@pytest.fixture
def reward_module():
    module = types.ModuleType("grpo_test_rewards")
    module.calls = []

    def by_length(prompt, responses):
        module.calls.append((prompt, responses))
        return [float(len(r)) for r in responses]

    module.by_length = by_length
    module.raises = lambda prompt, responses: 1 / 0
    module.wrong_length = lambda prompt, responses: [1.0]
    module.hangs = lambda prompt, responses: time.sleep(5) or [0.0] * len(responses)
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def wait_for(condition, timeout=120.0):  # generous: a loaded CI machine is slow
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_reward_function_scores_each_group(reward_module):
    trainer = make_trainer(reward_function="grpo_test_rewards:by_length")
    serve_group(trainer)
    entry = trainer.cache.get("g")
    wait_for(lambda: entry.state is not EntryState.WAITING_LABEL)
    (prompt, responses), = reward_module.calls
    assert "capital of France" in prompt and len(responses) == GROUP
    assert entry.label.rewards == [float(len(r)) for r in responses]
    assert trainer.stats.rewarded_groups == 1


@pytest.mark.parametrize("function", ["raises", "wrong_length", "hangs"])
def test_a_failing_reward_function_drops_the_group_and_counts_it(reward_module, function):
    trainer = make_trainer(reward_function=f"grpo_test_rewards:{function}", reward_timeout_s=0.3)
    serve_group(trainer)
    wait_for(lambda: trainer.stats.reward_errors == 1)
    assert trainer.cache.get("g") is None and trainer.cache.ended_counts["dropped"] == 1
    late = trainer.feedback.submit(FeedbackLabel("g", rewards=[1.0] * GROUP))  # (an outside pass: "cut short, or…")
    assert late.outcome is FeedbackOutcome.UNKNOWN and "the reward function failed" in late.message, late


def test_reward_calls_that_hang_do_not_stop_the_later_groups_from_being_scored(reward_module, monkeypatch):
    """Four calls that never returned held the scorer's four threads: every later group was
    dropped as "timed out" without its function ever being called, until a restart (a
    review of GRPO's rewards: its queue time counted against the timeout). Each call runs
    on a thread of its own, timed from its start; past `MAX_RUNNING_CALLS` hung calls, a
    group is dropped saying so."""
    import threading

    import trainer.rewards as rewards

    release = threading.Event()

    def hangs_for_some(prompt, responses):
        reward_module.calls.append(prompt)
        if len(reward_module.calls) <= 5:
            release.wait(60)
        return [float(len(r)) for r in responses]

    reward_module.hangs_for_some = hangs_for_some  # (a timeout the 6th call meets on a loaded machine too)
    trainer = make_trainer(reward_function="grpo_test_rewards:hangs_for_some", reward_timeout_s=2.0)
    try:
        for i in range(5):
            serve_group(trainer, f"hung-{i}", seed=i)
        wait_for(lambda: trainer.stats.reward_errors == 5)
        serve_group(trainer, "later", seed=9)
        wait_for(lambda: trainer.stats.rewarded_groups == 1)
        assert len(reward_module.calls) == 6 and trainer.cache.get("later").label is not None
        monkeypatch.setattr(rewards, "MAX_RUNNING_CALLS", 5)  # the five hung calls still run
        serve_group(trainer, "refused", seed=10)
        wait_for(lambda: trainer.stats.reward_errors == 6)
        assert len(reward_module.calls) == 6  # not called: dropped, saying why
    finally:
        release.set()
    trainer.close()


def test_a_reward_function_returns_numbers_and_nothing_float_merely_takes():
    """An outside pass: ["1", "1"] and booleans were taken (float() reads them)."""
    from trainer.rewards import checked_rewards

    assert checked_rewards([1, 2.5], 2) == [1.0, 2.5] and checked_rewards((x for x in (0, 1)), 2) == [0.0, 1.0]
    assert checked_rewards(torch.tensor([0.5, 1.0]), 2) == [0.5, 1.0]
    for value in (["1", "1"], [True, False], "12", None, [1.0], [float("nan"), 1.0], {0: 5.0, 1: -3.0}):
        with pytest.raises(ValueError, match="the reward function must return 2"):
            checked_rewards(value, 2)


def test_a_reward_function_that_cannot_be_loaded_is_a_config_error():
    with pytest.raises(ValueError, match="cannot import"):
        make_trainer(reward_function="no_such_module_here:f")
    with pytest.raises(ValueError, match="reward_function is used by train.mode grpo"):
        TrainConfig(mode="dpo", reward_function="x:y")


# -- DPO between two served choices -------------------------------------------------------------

def test_dpo_between_two_served_choices_uses_both_served_logprobs():
    """Sampled at a temperature, its served log-probs are still the model's own (DPO's policy's)."""
    trainer = make_trainer(mode="dpo")
    served = serve_group(trainer, n=3, temperature=0.7)
    assert trainer.cache.get("g").logprob_temperature == 1.0
    for label, param in ((FeedbackLabel("g", chosen_index=1, rejected_index=1), "rejected_index"),
                         (FeedbackLabel("g", chosen_index=5, rejected_index=0), "chosen_index"),
                         (FeedbackLabel("g", chosen_index=0), "rejected_index"),
                         (FeedbackLabel("g", rewards=[1.0, 0.0, 0.0]), "rewards")):
        assert trainer.feedback.submit(label).param == param
    result = trainer.feedback.submit(FeedbackLabel("g", chosen_index=2, rejected_index=0))
    assert result.accepted, result
    entry = trainer.cache.get("g")
    assert (entry.label.chosen, entry.label.rejected) == (served[2], served[0])
    assert set(entry.label.served_logps) == {"chosen", "rejected"}
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    recompute = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    assert relative_difference(reuse, recompute) <= 1e-4


@pytest.mark.parametrize("when", ["queued", "decoding-unrecorded"])
def test_a_group_cut_short_before_it_had_an_entry_says_so_and_is_counted(when):
    """A stream cut while its request was still queued (or decoding unrecorded) left no
    entry: its rewards were answered "unknown (or so old that the server no longer
    remembers it)" and no drop was counted, where one cut a moment later was "dropped (its
    request was cut short…)" and counted (a review of GRPO's rewards)."""
    trainer = make_trainer(record_fraction=0.0 if when == "decoding-unrecorded" else 1.0)
    engine = engine_of(trainer)
    params = SamplingParams(n=GROUP, temperature=1.0, seed=1, max_tokens=8, ignore_eos=True)
    engine.add_request("g", encode(PROMPT), params, train=True)
    if when == "decoding-unrecorded":
        engine.step()
        engine.step()
    engine.abort_request("g")
    while engine.has_unfinished():
        engine.step()
    result = trainer.feedback.submit(FeedbackLabel("g", rewards=[1.0, 0.0, 0.0, 0.0]))
    assert result.outcome is FeedbackOutcome.UNKNOWN and "cut short" in result.message, result
    assert trainer.cache.ended_counts["dropped"] == 1
    trainer.close()
