"""Online learning on tiny models: the reuse path gives the recompute path's gradients,
stale graphs are never back-propagated, the cache keeps its bounds and timeouts."""

import concurrent.futures
import dataclasses
import math
import threading
import time

import pytest
import torch

from trainer.config import TrainConfig
from engine.model_runner import run_to_end
from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_training
from tests.tiny import FAMILIES, TEST_DEVICE
from trainer.adapter import lora_gradients, lora_parameters
from trainer.entries import EntryState
from trainer.feedback import FeedbackLabel
from trainer.online import OnlineTraining

PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"


def make_trainer(family="llama", mode="cpt", **train_kwargs) -> OnlineTraining:
    config = TrainConfig(mode=mode, lora_rank=4, **train_kwargs)
    # random B as well as A, so that every LoRA tensor gets a non-zero gradient
    return make_training(config, family, init_lora_weights=False)


def serve(trainer: OnlineTraining, request_id: str, prompt: str = PROMPT, max_tokens: int = 6) -> list[int]:
    engine = engine_of(trainer)
    ids = encode(prompt)
    engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       train=True)
    tokens = []
    while engine.has_unfinished():
        outputs, _ = engine.step()
        for out in outputs:
            tokens += out.outputs[0].token_ids
    return tokens


def label(trainer: OnlineTraining, request_id: str, chosen="Paris is the capital.", rejected=None):
    result = trainer.feedback.submit(FeedbackLabel(request_id, chosen, rejected, 0))
    assert result.accepted, result


def relative_difference(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm()).item() for k in b)


def gradients_of(trainer: OnlineTraining, job) -> dict:
    trainer.optimizer.zero_grad()
    run_to_end(job)
    grads = lora_gradients(trainer.peft_model)
    trainer.optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("mode", ["cpt", "dpo-served", "dpo-both"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_and_recompute_paths_give_the_same_lora_gradients(family, mode):
    """dpo-served: rejected is the served response (its log-prob comes from decoding);
    dpo-both: both responses given (the shorter is first scored without grad)."""
    trainer = make_trainer(family, mode.split("-")[0])
    serve(trainer, "r", max_tokens=8)  # decoded after recording: the graph must be intact
    entry = trainer.cache.get("r")
    if mode == "dpo-served":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.")
        assert set(entry.label.served_logps) == {"rejected"}
    elif mode == "dpo-both":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
        assert not entry.label.served_logps
    context = trainer.context
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, context))
    recompute = gradients_of(trainer, trainer.method.recompute_job(entry, context))
    baseline = gradients_of(trainer, trainer.method.baseline_job(entry, context))  # the separate trainer's
    assert set(reuse) == set(recompute) == set(baseline) and len(reuse) == len(lora_parameters(trainer.peft_model))
    assert all(g.norm() > 0 for g in baseline.values())
    assert relative_difference(reuse, baseline) <= 1e-4
    assert relative_difference(recompute, baseline) <= 1e-4


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_a_request_its_client_left_is_not_trained_on_but_a_label_given_before_its_end_is(mode):
    """An outside pass (litellm retrying a chat after its timeout, three times): a CPT
    server trained the prompt once per abandoned attempt. A request cut short by its
    client is dropped, in every method; a DPO label that came with both texts before the
    answer ended was accepted, and keeps its entry."""
    trainer = make_trainer(mode=mode)
    engine = engine_of(trainer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    for request_id in ("left", "labelled"):
        engine.add_request(request_id, encode(PROMPT), params, train=True)
        engine.step()  # its prefill recorded
        if request_id == "labelled" and mode == "dpo":
            assert trainer.feedback.submit(FeedbackLabel("labelled", "Paris.", "Rome.", 0)).accepted
        engine.abort_request(request_id)
        while engine.has_unfinished():
            engine.step()
    trainer.train_until_idle()
    assert trainer.cache.ended_counts["dropped"] == (2 if mode == "cpt" else 1)
    assert sum(trainer.stats.trained_entries.values()) == (0 if mode == "cpt" else 1)
    serve(trainer, "served")
    trainer.train_until_idle()
    assert sum(trainer.stats.trained_entries.values()) == 1  # a CPT prompt served whole trains; DPO waits for a label


def test_an_entry_a_custom_method_held_keeps_the_label_it_got_before_its_client_left():
    """A review: the drop-on-abort rule dropped a held entry's label (a custom method holds
    any entry until `attach_label`; `needs_label` is not what says it has one)."""
    from trainer.cache import ActivationCache
    from trainer.entries import CacheEntry

    cache = ActivationCache(1 << 20)
    held, plain = CacheEntry("held", [1, 2, 3], None, 0, 0), CacheEntry("plain", [1, 2, 3], None, 0, 0)
    for entry in (held, plain):
        assert cache.add(entry, owed=True)
    cache.hold(held)
    assert cache.attach_label(held, None) and held.state is EntryState.READY
    for entry in (held, plain):
        cache.response_finished(entry.completion_id, {0: [5]}, aborted=True)
    assert (held.state, plain.state) == (EntryState.READY, EntryState.DROPPED)


def test_training_steps_bump_the_adapter_version_and_change_the_model():
    trainer = make_trainer()
    before = [p.detach().clone() for p in lora_parameters(trainer.peft_model)]
    serve(trainer, "a")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 1}
    assert trainer.cache.bytes == 0 and len(trainer.cache) == 0
    assert any(not torch.equal(b, p) for b, p in zip(before, lora_parameters(trainer.peft_model)))


def test_stale_entry_is_recomputed_never_back_propagated():
    trainer = make_trainer(max_staleness=0, entries_per_step=1, cohort_max_entries=1)
    serve(trainer, "a")
    serve(trainer, "b", prompt="Hello, how are you today? I am fine.")
    stale = trainer.cache.get("b")
    recording = dataclasses.replace(stale.recording)  # keeps the graph the trainer releases
    trainer.train_until_idle()
    assert trainer.optimizer.version == 2
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 1, ("cpt", "recompute"): 1}
    assert trainer.stats.stale_entries == 1
    # what the trainer avoided: the old graph saved the adapter weights the step changed
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stale.recording = recording
        run_to_end(trainer.method.reuse_job(stale, trainer.context))


def test_stale_policy_drop_drops_the_entry():
    trainer = make_trainer(stale_policy="drop", max_staleness=0, entries_per_step=1, cohort_max_entries=1)
    serve(trainer, "a")
    serve(trainer, "b")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1
    assert trainer.stats.stale_dropped == 1 and trainer.cache.ended_counts["dropped"] == 1


def test_cache_full_drop_new_keeps_old_entries_and_evict_oldest_evicts():
    probe = make_trainer()
    serve(probe, "a")
    size = probe.cache.get("a").nbytes
    # (each recording of the one prompt whole: one after the first's cached beginning is smaller)
    keep_old = make_trainer(cache_bytes=int(size * 1.5), cache_full_policy="drop_new", record_after_cached_prefix=False)
    serve(keep_old, "a")
    serve(keep_old, "b")
    assert keep_old.cache.get("a") is not None and keep_old.cache.get("b") is None
    evict = make_trainer(cache_bytes=int(size * 1.5), cache_full_policy="evict_oldest", record_after_cached_prefix=False)
    serve(evict, "a")
    serve(evict, "b")
    assert evict.cache.get("a") is None and evict.cache.get("b") is not None
    assert evict.cache.ended_counts["evicted"] == 1 and evict.cache.bytes <= int(size * 1.5)


def test_unlabelled_recordings_give_way_to_new_ones_and_labelled_ones_keep_theirs():
    probe = make_trainer(mode="dpo")
    serve(probe, "a")
    size = probe.cache.get("a").nbytes
    # (one prompt served again and again, each recording of it whole: the sizes this counts on)
    trainer = make_trainer(mode="dpo", cache_bytes=int(size * 2.5), cache_full_policy="unlabelled_give_way",
                           record_after_cached_prefix=False)
    cache = trainer.cache
    serve(trainer, "a")
    serve(trainer, "b")
    label(trainer, "a")  # labelled: protected until trained
    assert cache.has_room_for(size)  # b, still unlabelled, would give way
    serve(trainer, "c")
    assert cache.get("a").recording is not None and cache.get("c").recording is not None
    assert cache.get("b").recording is None and cache.get("b").state is EntryState.WAITING_LABEL  # a label entry
    label(trainer, "c")
    assert not cache.has_room_for(size)  # both recordings are labelled now
    serve(trainer, "d")
    assert cache.get("d").recording is None and cache.get("a").recording is not None
    assert cache.bytes <= int(size * 2.5) and cache.ended_counts["evicted"] == 0
    label(trainer, "b")
    label(trainer, "d")
    trainer.train_until_idle()  # every label trains: a and c on their recordings, b and d recomputed
    assert sum(trainer.stats.trained_entries.values()) == 4
    assert trainer.stats.trained_entries[("dpo", "recompute")] == 2


def test_label_timeout_expires_waiting_dpo_entries():
    trainer = make_trainer(mode="dpo", label_timeout_s=0.05)
    serve(trainer, "a")
    assert trainer.cache.get("a").state is EntryState.WAITING_LABEL
    time.sleep(0.1)
    trainer.train_until_idle()  # idle slices expire it (after rebuilding merged weights)
    assert trainer.optimizer.version == 0
    assert trainer.cache.get("a") is None and trainer.cache.ended_state("a") is EntryState.EXPIRED
    assert trainer.cache.bytes == 0


def test_non_finite_loss_skips_the_step_and_counts_it():
    trainer = make_trainer()
    with torch.no_grad():
        lora_parameters(trainer.peft_model)[0].fill_(math.nan)
    serve(trainer, "a")
    trainer.train_until_idle()
    assert trainer.optimizer.skipped_steps == 1 and trainer.optimizer.version == 0
    assert trainer.stats.trained_entries == {}  # in no weights: dropped, for its loss was not finite
    assert trainer.cache.ended_state("a") is EntryState.DROPPED


def test_a_weight_changed_after_recording_makes_backward_raise_not_lie():
    trainer = make_trainer()
    serve(trainer, "a")
    with torch.no_grad():
        lora_parameters(trainer.peft_model)[0].add_(1.0)  # what an optimizer step does
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run_to_end(trainer.method.reuse_job(trainer.cache.get("a"), trainer.context))


def test_served_log_prob_equals_the_training_forward():
    trainer = make_trainer(mode="dpo")
    served = serve(trainer, "a", max_tokens=8)
    entry = trainer.cache.get("a")
    method, context = trainer.method, trainer.context
    last = entry.recording.logits[-1:].detach()
    prefix = [(s.key.detach(), s.value.detach()) for s in entry.recording.segments]
    value, _, _ = run_to_end(method._response_logp(context, len(entry.prompt_token_ids), served, last, prefix,
                                                   False))
    assert entry.served_logps[0] == pytest.approx(value.item(), rel=1e-5)


def test_served_tokens_are_unchanged_by_recording():
    trainer = make_trainer()
    recorded = serve(trainer, "a", max_tokens=12)
    plain_engine = engine_of(trainer)
    ids = encode(PROMPT)
    plain = plain_engine.generate([ids], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0][0]
    assert recorded == plain


def test_sampling_edits_do_not_touch_the_recorded_logits():
    trainer = make_trainer()
    engine = engine_of(trainer)
    ids = encode(PROMPT)
    # min_tokens bans EOS and logit_bias edits logits: both used to write into the recording
    engine.add_request("a", ids, SamplingParams(max_tokens=3, min_tokens=3, logit_bias={5: 3.0}), train=True)
    while engine.has_unfinished():
        engine.step()
    entry = trainer.cache.get("a")
    with torch.inference_mode():
        fresh = engine_of(trainer).model(torch.tensor([ids], device=TEST_DEVICE)).logits[0]
    assert torch.allclose(entry.recording.logits.detach(), fresh[-1:], atol=1e-4)  # the last row, kept
    trainer.train_until_idle()
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 1}


@pytest.mark.parametrize("alone", [True, False])
@pytest.mark.parametrize("mode", ["cpt", "dpo-served"])
@pytest.mark.parametrize("family", FAMILIES)
def test_recorded_prefill_shares_its_step_with_decodes_without_changing_anything(family, mode, alone):
    """Running decodes ride along in a recorded prefill's forward (the default); with
    `recorded_prefill_alone` it takes its step alone and the decodes the next one, before
    another recorded prefill. Either way: the same tokens, and the same gradients."""
    # each recording of its whole prompt, whose shapes this checks (the answers alone, served
    # first, leave the prompts cached; a recording after a cached beginning with riders:
    # tests/test_recorded_after_cached_prefix.py)
    trainer = make_trainer(family, mode.split("-")[0], record_after_cached_prefix=False)
    engine = engine_of(trainer)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, recorded_prefill_alone=alone)
    other_ids, recorded_ids, first_ids = encode("Hello, how are you today?"), encode(PROMPT), encode("Hi there!")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    other_alone, recorded_alone, first_alone = (engine.generate([ids], params)[0][0]
                                                for ids in (other_ids, recorded_ids, first_ids))
    steps = []
    schedule = engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    tokens = {"other": [], "first": [], "rec": []}

    def step():
        for out in engine.step()[0]:
            tokens[out.request_id] += out.outputs[0].token_ids

    engine.add_request("other", other_ids, params)
    for _ in range(3):
        step()
    engine.add_request("first", first_ids, params, train=True)
    engine.add_request("rec", recorded_ids, params, train=True)
    while engine.has_unfinished():
        step()
    ids = [[e.seq.request_id for e in s.scheduled] for s in steps]
    recorded = [i for i, s in enumerate(steps) if s.recorded]
    if alone:  # each alone, the decodes' step between them
        assert [ids[i] for i in recorded] == [["first"], ["rec"]]
        assert recorded[1] == recorded[0] + 2 and ids[recorded[0] + 1] == ["other", "first"]
    else:
        assert [ids[i] for i in recorded] == [["first", "other"], ["rec", "other", "first"]]
    assert tokens == {"other": other_alone, "first": first_alone, "rec": recorded_alone}
    trainer.cache.end(trainer.cache.get("first"), EntryState.DROPPED)
    # only the recorded request has an entry: the decodes sharing its step got none
    assert trainer.cache.get("other") is None and len(trainer.cache) == 1 and trainer.stats.recorded == 2
    entry = trainer.cache.get("rec")
    assert trainer.cache.bytes == entry.nbytes
    # the recording's K/V and head rows are the prompt's; its layers' inputs hold the riders' rows too
    recording, riders = entry.recording, 0 if alone else 2
    assert {s.leaf.shape[1] for s in recording.segments} == {len(recorded_ids) + riders}
    assert {s.key.shape[2] for s in recording.segments} == {len(recorded_ids)}
    assert recording.head_leaf.shape[1] == len(recorded_ids)
    # the riders' rows cost what rows do in the layers' saved inputs, and nothing of their attention
    engine.add_request("again", recorded_ids, params, train=True)
    while engine.has_unfinished():
        engine.step()
    alone_bytes = trainer.cache.get("again").recording.saved_bytes
    assert alone_bytes <= recording.saved_bytes <= alone_bytes * (len(recorded_ids) + riders) / len(recorded_ids)
    if mode == "dpo-served":
        label(trainer, "rec", chosen="Paris, of course.")
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    recompute = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    assert relative_difference(reuse, recompute) <= 1e-4


def test_a_chunked_prompt_riding_along_completes_and_forks_its_choices():
    """A prompt chunked down to its last token rides along in a recorded prefill's step
    as a decode does (one row), completes its prompt there and forks its n choices from
    that row: the same tokens as served with no recorded prefill beside it."""
    trainer = make_trainer("llama", "cpt")
    engine = engine_of(trainer)
    ids, recorded_ids = encode(PROMPT), encode("Hi there!")
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=len(ids) - 1)
    params = SamplingParams(n=2, temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = engine.generate([ids], params)[0]
    engine.scheduler.allocator.forget_names()  # (not read from the prefix cache: prefilled in chunks again)
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    choices = [[], []]
    engine.add_request("chunked", ids, params)
    engine.step()  # all but its last token
    engine.add_request("rec", recorded_ids, SamplingParams(temperature=0.0, max_tokens=4), train=True)
    while engine.has_unfinished():
        for out in engine.step()[0]:
            if out.request_id == "chunked":
                for completion in out.outputs:
                    choices[completion.index] += completion.token_ids
    recorded = steps[1]
    assert recorded.recorded and [(e.seq.request_id, e.num_new_tokens) for e in recorded.scheduled][1] == ("chunked", 1)
    assert recorded.forks and choices == expected


@pytest.mark.parametrize("alone", [True, False])
def test_a_prompt_prefilled_in_chunks_waits_one_recorded_prefill_at_most(alone):
    """A running prompt still being prefilled in chunks cannot ride along in a recorded
    prefill's step; it takes the next step, before the next recorded prefill in the queue."""
    trainer = make_trainer("llama", "cpt")
    engine = engine_of(trainer)
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_num_batched_tokens=6,
                                                  recorded_prefill_alone=alone)
    steps, schedule = [], engine.scheduler.schedule
    engine.scheduler.schedule = lambda: steps.append(schedule()) or steps[-1]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    engine.add_request("chunked", encode(PROMPT), params)
    engine.step()  # its first chunk
    for request_id in ("rec1", "rec2"):
        engine.add_request(request_id, encode("Hi there!"), params, train=True)
    while engine.has_unfinished():
        engine.step()
    ids = [[e.seq.request_id for e in s.scheduled] for s in steps]
    first, second = [i for i, s in enumerate(steps) if s.recorded]
    assert ids[first] == ["rec1"] and ids[second][0] == "rec2"
    assert second == first + 2 and ids[first + 1][0] == "chunked"


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_an_entry_dropped_without_backward_frees_its_whole_graph(mode):
    """Expired, evicted and stale entries are released without a backward; the saved-
    tensor hooks must not keep their graph alive through a reference cycle."""
    import gc
    import weakref

    from engine.recording import SavedTensorTracker

    trainer = make_trainer(mode=mode)
    tracker = engine_of(trainer).runner.record_tracker = SavedTensorTracker()
    serve(trainer, "a")
    entry = trainer.cache.get("a")
    assert tracker.live_bytes > 0 and tracker.live_bytes == entry.nbytes
    output = weakref.ref(entry.recording.segments[0].out)
    trainer.cache.end(entry, EntryState.EXPIRED)
    gc.collect()
    assert output() is None and tracker.live_bytes == 0 and trainer.cache.bytes == 0


def test_labels_racing_for_one_completion_attach_exactly_one():
    """Labels are validated with no lock held: of many sent at once, the cache attaches one;
    the others learn that the completion already has its label."""
    trainer = make_trainer(mode="dpo")
    serve(trainer, "a")
    barrier = threading.Barrier(8, timeout=300)

    def send(i: int):
        barrier.wait()
        return trainer.feedback.submit(FeedbackLabel("a", f"Answer number {i} is the one.", None, 0))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(send, range(8)))
    assert sum(r.accepted for r in results) == 1
    assert {r.code for r in results if not r.accepted} == {"label_exists"}
    assert trainer.cache.get("a").state is EntryState.READY and trainer.stats.feedback == {"accepted": 1,
                                                                                            "conflict": 7}
