"""A recorded prefill after the prompt's cached beginning: it reads that beginning's K/V
from the prefix cache, holds them once (in the whole prompt's K/V, their gradients landing
beside) and records only the rest; its job recomputes the
beginning. Every method's reuse job gives the separate trainer's gradients (every
family; one backward sweep or two; layers offloaded or recomputed; the beginning a layer
at a time where its graph does not fit the budget; a stale recording under its stashed
weights), the served tokens are those of a recording of the whole
prompt, and the prefix cache counts what the recording read."""

import dataclasses

import pytest

from engine.recording import SavedTensorTracker
from engine.sampling_params import SamplingParams
from offload.config import OffloadConfig
from tests.conftest import encode, engine_of
from tests.test_grpo import make_trainer as make_grpo_trainer, reward, serve_group
from tests.test_offload import room_for_graph_layers
from tests.test_stash import advance, hold, make_trainer as make_stash_trainer, stale_and_fresh_gradients, \
    stashed_gradients
from tests.test_training import PROMPT, gradients_of, label, make_trainer, relative_difference, serve
from tests.tiny import FAMILIES
from trainer.adapter import lora_parameters
from trainer.config import TrainConfig

BLOCK_SIZE = 4  # tests/conftest.make_config's
CONTINUED = PROMPT + " And what is the capital of Spain?"


def cache_beginning(trainer, prompt: str = PROMPT) -> None:
    """Serves `prompt` untrained: its full blocks are cached for the next request."""
    engine = engine_of(trainer)
    engine.add_request("warm", encode(prompt), SamplingParams(temperature=0.0, max_tokens=2), train=False)
    while engine.has_unfinished():
        engine.step()


def cached_tokens(prompt: str) -> int:
    return len(encode(prompt)) // BLOCK_SIZE * BLOCK_SIZE


def assert_recorded_after(entry, cached: int) -> None:
    recording = entry.recording
    assert recording.prefix_len == cached > 0
    assert len(recording.prefix_grads) == len(recording.segments)
    assert recording.head_leaf.shape[1] == len(entry.prompt_token_ids) - cached
    assert all(s.key.shape[2] == len(entry.prompt_token_ids) for s in recording.segments)  # the whole prompt's


def graph_leaves(tensors) -> list:
    """Every autograd leaf the graphs of `tensors` reach (what their AccumulateGrad nodes hold)."""
    stack, seen, leaves = [t.grad_fn for t in tensors if t.grad_fn is not None], set(), []
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if hasattr(node, "variable"):
            leaves.append(node.variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


@pytest.mark.parametrize("bucketed", [False, True])
def test_a_recording_holds_its_cached_beginnings_keys_and_values_once(bucketed):
    """The beginning's rows live in the whole prompt's K/V alone: no autograd leaf of them
    beside (the graph would keep it as long as the recording), and what the recording
    counts beyond its recorded tokens is those rows, once."""
    from tests.test_training_buckets import bucketed as gpu_shapes
    trainer = make_trainer("llama", "dpo")
    gpu_shapes(trainer, bucketed)  # a GPU's: the recorded K/V padded to a bucketed key length
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
    recording = trainer.cache.get("r").recording
    cached = recording.prefix_len
    assert cached > 0
    segments = recording.segments
    leaves = graph_leaves([t for s in segments for t in (s.out, s.key, s.value)])
    assert not [leaf for leaf in leaves if leaf.dim() == 4 and leaf.shape[2] == cached]
    assert recording.prefix_bytes == sum(t[:, :, :cached].nbytes for s in segments for t in (s.key, s.value)) > 0


@pytest.mark.parametrize("mode", ["cpt", "dpo-served", "dpo-both"])
@pytest.mark.parametrize("family", FAMILIES)
def test_reuse_after_a_cached_beginning_gives_the_separate_trainers_gradients(family, mode):
    trainer = make_trainer(family, mode.split("-")[0])
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
    entry = trainer.cache.get("r")
    assert_recorded_after(entry, cached_tokens(PROMPT))
    if mode == "dpo-served":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.")
    elif mode == "dpo-both":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    context = trainer.context
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, context))
    baseline = gradients_of(trainer, trainer.method.baseline_job(entry, context))
    assert set(reuse) == set(baseline) and len(reuse) == len(lora_parameters(trainer.peft_model))
    assert all(g.norm() > 0 for g in baseline.values())
    assert relative_difference(reuse, baseline) <= 1e-4


@pytest.mark.parametrize("one_sweep", [True, False])
@pytest.mark.parametrize("schedule", ["batched", "one_at_a_time"])
def test_every_dpo_schedule_after_a_cached_beginning(one_sweep, schedule):
    trainer = make_trainer("llama", "dpo", one_backward_sweep=one_sweep)
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
    label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    entry = trainer.cache.get("r")
    job = trainer.method.reuse_job if schedule == "batched" else trainer.method._reuse_one_response_at_a_time
    reuse = gradients_of(trainer, job(entry, trainer.context))
    baseline = gradients_of(trainer, trainer.method.baseline_job(entry, trainer.context))
    assert relative_difference(reuse, baseline) <= 1e-4


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_a_grpo_group_after_a_cached_beginning(family):
    trainer = make_grpo_trainer(family)
    cache_beginning(trainer)
    serve_group(trainer, prompt=CONTINUED)
    entry = trainer.cache.get("g")
    assert_recorded_after(entry, cached_tokens(PROMPT))
    assert reward(trainer).accepted
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    packed = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    assert all(g.norm() > 0 for g in packed.values())
    assert relative_difference(reuse, packed) <= 1e-4


@pytest.mark.parametrize("policy", ["load", "recompute"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_offloaded_layers_of_a_recording_after_a_cached_beginning(mode, policy):
    """Every recorded layer freed: reloaded, or recomputed attending to the beginning's rows."""
    grads = {}
    for offload in (None, OffloadConfig(device_budget_bytes=1 << 40, policy=policy)):
        trainer = make_stash_trainer(mode, offload=offload)  # (the same seed: the same weights)
        cache_beginning(trainer)
        serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
        if offload is not None:
            trainer.offloader.free_to(0)
        if mode == "dpo":
            label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
        entry = trainer.cache.get("r")
        assert_recorded_after(entry, cached_tokens(PROMPT))
        grads[offload is None] = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    stats = trainer.offloader.stats
    assert stats.reloaded_layers + stats.recomputed_layers == len(engine_of(trainer).runner.layers)
    assert relative_difference(grads[False], grads[True]) <= 1e-5


def set_budget(trainer, budget: int) -> None:
    """The device budget changed after the recording was admitted under a roomy one."""
    trainer.offloader.config = dataclasses.replace(trainer.offloader.config, device_budget_bytes=budget)


def serve_and_label(mode: str, offload: OffloadConfig | None):
    """A trainer of `mode` with its entry "r" recorded after the cached beginning and labelled."""
    if mode == "grpo":
        trainer = make_grpo_trainer(offload=offload)
        cache_beginning(trainer)
        serve_group(trainer, request_id="r", prompt=CONTINUED)
        assert reward(trainer, "r").accepted
    else:
        trainer = make_stash_trainer(mode, offload=offload)
        cache_beginning(trainer)
        serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
        if mode == "dpo":
            label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    entry = trainer.cache.get("r")
    assert_recorded_after(entry, cached_tokens(PROMPT))
    return trainer, entry


@pytest.mark.parametrize("kept", [0, 1])
@pytest.mark.parametrize("mode", ["cpt", "dpo", "grpo"])
def test_a_beginning_whose_graphs_do_not_fit_the_budget_runs_its_lower_layers_again(mode, kept):
    """Where the budget has room for `kept` of the beginning's layer graphs (of two), the
    layers below keep only their input through its forward and run again in its backward:
    the gradients of every layer's graph kept (no budget), holding less."""
    grads, peaks = {}, {}
    for tight in (False, True):
        trainer, entry = serve_and_label(mode, OffloadConfig(device_budget_bytes=1 << 40, policy="recompute")
                                         if tight else None)
        if tight:
            # (the recorded layers back-propagated and released by then, their kept tensors held)
            held = entry.recording.placement.kept_bytes
            set_budget(trainer, room_for_graph_layers(trainer.offloader, cached_tokens(PROMPT), kept, held))
        tracker = SavedTensorTracker()
        with tracker.hooks():
            grads[tight] = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
        peaks[tight] = tracker.peak_bytes
    num_layers = len(engine_of(trainer).runner.layers)
    assert trainer.offloader.stats.rerun_training_layers == num_layers - kept
    assert all(g.norm() > 0 for g in grads[False].values())
    assert relative_difference(grads[True], grads[False]) <= 1e-5
    if mode == "cpt":  # (the job's only graph is the beginning's: its layers', then fewer, and their inputs)
        inputs = num_layers * cached_tokens(PROMPT) * trainer.peft_model.config.hidden_size * 4
        assert peaks[True] + inputs < (0.75 if kept == 0 else 1.0) * peaks[False]


def test_a_tight_budget_records_a_new_turn_by_what_it_keeps_of_its_cached_beginning():
    """The offloader admits a recording by what it keeps — of its cached beginning, the
    keys and values — and the rows its step computes: a budget with room for those and not
    for a whole prompt's recording records it, and its job gives the gradients of no budget."""
    whole, cached = len(encode(CONTINUED)), cached_tokens(PROMPT)
    probe = make_stash_trainer("cpt", offload=OffloadConfig(device_budget_bytes=1 << 40))
    cache_beginning(probe)
    offloader = probe.offloader
    model = offloader.map.model
    assert 0 < model.kept_per_cached_token < model.kept_per_token

    def need(cached_part: int) -> int:  # what admission reckons for a prompt of `whole` tokens
        rows = whole - cached_part
        scores = int(model.step_per_score * rows * cached_part)
        step = max(offloader.map.serving_bytes(rows, 1) + scores, offloader._max_step_bytes)
        kept = model.kept_per_token * rows + model.kept_per_cached_token * cached_part
        return int(kept) + offloader.in_flight_bytes(rows + offloader._max_batch - 1) + step

    budget = need(cached)
    assert budget < need(0)
    offloader.config = dataclasses.replace(offloader.config, device_budget_bytes=budget)
    assert offloader.admits(whole, cached) and not offloader.admits(whole)

    reference = make_stash_trainer("cpt")
    cache_beginning(reference)
    serve(reference, "r", prompt=CONTINUED, max_tokens=8)
    expected = gradients_of(reference, reference.method.reuse_job(reference.cache.get("r"), reference.context))
    trainer = make_stash_trainer("cpt", offload=OffloadConfig(device_budget_bytes=budget, policy="recompute"))
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
    entry = trainer.cache.get("r")
    assert_recorded_after(entry, cached)
    placement = entry.recording.placement  # what it keeps is within what admission reckoned
    assert placement.kept_bytes <= model.kept_per_token * placement.rows + model.kept_per_cached_token * cached
    grads = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    assert relative_difference(grads, expected) <= 1e-5


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_a_stale_recording_after_a_cached_beginning_trains_under_its_served_version(mode):
    """The beginning is recomputed under the stashed weights the job runs with, as the
    recorded rest was recorded under them."""
    trainer = make_stash_trainer(mode, max_staleness=4)
    cache_beginning(trainer)
    stale, fresh, current = stale_and_fresh_gradients(trainer, mode, 2)
    assert relative_difference(stale, fresh) <= 1e-5
    assert relative_difference(current, fresh) > 1e-3


def test_a_stale_cpt_recording_with_live_weights_after_a_cached_beginning_is_nearer_todays_gradient():
    """Under `stale_weights = "live"` a stale recording trains with today's LoRA weights on
    the activations of the version that served it. A CPT recording that read its cached
    beginning recomputes that beginning, and its tokens' loss, under today's weights, so its
    gradient is nearer a fresh forward's today than a recording of the whole prompt's is
    (`bench backlog`'s CPT finding). (DPO's responses read the beginning's K/V as served:
    its recomputation changes only the path back through the beginning's layers.)"""
    distance = {}
    for reads in (True, False):
        trainer = make_stash_trainer("cpt", max_staleness=4, record_after_cached_prefix=reads)
        cache_beginning(trainer)
        serve(trainer, "s", prompt=CONTINUED, max_tokens=8)
        hold(trainer, "s")
        advance(trainer, 1, "cpt")
        entry = trainer.cache.get("s")
        assert entry.recording.prefix_len == (cached_tokens(PROMPT) if reads else 0)
        trainer.stash.aim_at_live(0)  # as the trainer starts such a job (trainer/trainer.py, `_start`)
        trainer.context.under_served_weights = False
        live = stashed_gradients(trainer, entry, 0)
        today = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
        distance[reads] = relative_difference(live, today)
    assert 0 < distance[True] < 0.75 * distance[False]


def test_the_served_answer_is_the_whole_prompts_recordings_and_its_usage_counts_the_cache():
    answers, recordings, cached = {}, {}, {}
    for reads in (True, False):
        trainer = make_trainer("llama", "cpt", record_after_cached_prefix=reads)
        cache_beginning(trainer)
        engine = engine_of(trainer)
        engine.add_request("r", encode(CONTINUED), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
                           train=True)
        answers[reads] = []
        while engine.has_unfinished():
            for out in engine.step()[0]:
                answers[reads] += out.outputs[0].token_ids
                cached[reads] = out.metrics.num_cached_tokens
        recordings[reads] = trainer.cache.get("r").recording
    assert answers[True] == answers[False] and len(answers[True]) == 12
    assert cached == {True: cached_tokens(PROMPT), False: 0}
    assert recordings[True].prefix_len == cached_tokens(PROMPT) and recordings[False].prefix_len == 0
    assert recordings[True].saved_bytes < recordings[False].saved_bytes


def test_a_method_that_reads_every_recorded_row_records_the_whole_prompt():
    """A custom method keeping every row's logits (the base class's default) is never given
    a recording that begins after a cached beginning."""
    from trainer.methods import CPTMethod, TrainingMethod
    assert TrainingMethod.reads_cached_prefix is False
    assert TrainingMethod().record_spec(0).reads_cached_prefix is False
    assert TrainConfig().record_after_cached_prefix is True

    class EveryRowCPT(CPTMethod):  # a subclass that reads every row inherits CPT's reads_cached_prefix
        all_logit_rows = True
    assert CPTMethod().record_spec(0).reads_cached_prefix is True
    assert EveryRowCPT().record_spec(0).reads_cached_prefix is False


@pytest.mark.parametrize("reads", [True, False])
def test_max_record_tokens_counts_the_tokens_recorded_after_the_cached_beginning(reads):
    """A conversation longer than `max_record_tokens` whose new turn is shorter is still
    recorded when its recording reads the cached beginning (it records only the new turn);
    recording whole prompts, it is served unrecorded."""
    whole, new = len(encode(CONTINUED)), len(encode(CONTINUED)) - cached_tokens(PROMPT)
    trainer = make_trainer("llama", "cpt", record_after_cached_prefix=reads, max_record_tokens=new + 1)
    assert whole > new + 1
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=4)
    entry = trainer.cache.get("r")
    if reads:
        assert_recorded_after(entry, cached_tokens(PROMPT))
    else:
        assert entry is None and trainer.stats.not_recorded == 1


def test_a_recording_whose_cached_beginning_was_evicted_before_its_step_is_confirmed_by_what_it_would_record():
    """Admitted on a cached beginning that is gone by its step (evicted for other tokens),
    a recording would record more than `max_record_tokens`: it runs unrecorded instead."""
    ids = encode(CONTINUED)
    trainer = make_trainer("llama", "dpo", max_record_tokens=len(ids) - cached_tokens(PROMPT))
    spec = trainer.method.record_spec(0)
    assert trainer.recorder.confirm("r", ids, spec, num_cached_tokens=cached_tokens(PROMPT)) is spec
    assert trainer.stats.not_recorded == 0
    assert trainer.recorder.confirm("r", ids, spec, num_cached_tokens=0) is None
    assert trainer.stats.not_recorded == 1  # (`alchemist:unrecorded_prefills_total` counts it)


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_bucketed_shapes_after_a_cached_beginning(mode):
    """A GPU's bucketed shapes (the recorded keys padded past the whole prompt's): the same
    gradients as the separate trainer's."""
    from tests.test_training_buckets import bucketed
    trainer = make_trainer("llama", mode)
    bucketed(trainer, True)
    cache_beginning(trainer)
    serve(trainer, "r", prompt=CONTINUED, max_tokens=8)
    entry = trainer.cache.get("r")
    assert_recorded_after(entry, cached_tokens(PROMPT))
    if mode == "dpo":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    bucketed(trainer, False)
    baseline = gradients_of(trainer, trainer.method.baseline_job(entry, trainer.context))
    assert relative_difference(reuse, baseline) <= 1e-4


def test_decodes_riding_along_a_recording_after_a_cached_beginning():
    """Another request decoding meanwhile rides along in the recorded step: both answers are
    those each gets alone, and the recording trains as one made alone."""
    answers = {}
    for together in (False, True):
        trainer = make_trainer("llama", "cpt")
        cache_beginning(trainer)
        engine = engine_of(trainer)
        greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
        engine.add_request("rider", encode("Tell me about the ocean."), greedy, train=False)
        if together:
            engine.step()  # the rider's prefill: it decodes from the next step on
        else:
            while engine.has_unfinished():
                engine.step()
        engine.add_request("r", encode(CONTINUED), greedy, train=True)
        kinds, tokens = [], {"rider": [], "r": []}
        while engine.has_unfinished():
            outputs, stats = engine.step()
            kinds.append(stats.kind)
            for out in outputs:
                tokens[out.request_id] += out.outputs[0].token_ids
        assert ("recorded_mixed" in kinds) == together
        answers[together] = tokens
        entry = trainer.cache.get("r")
        assert_recorded_after(entry, cached_tokens(PROMPT))
        reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
        baseline = gradients_of(trainer, trainer.method.baseline_job(entry, trainer.context))
        assert relative_difference(reuse, baseline) <= 1e-4
    assert answers[True]["r"] == answers[False]["r"] and len(answers[True]["r"]) == 10
