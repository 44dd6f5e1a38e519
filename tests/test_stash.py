"""Weight stashing: a recording k adapter versions stale trains exactly as a fresh
forward and backward under the version that served it (CPT and DPO, with offloaded and
recomputed layers too), the trainer takes that path within `max_staleness`, frees the
stashed weights with the last recording that needs them, and learns about as much as
strict recomputation on the same requests."""

import pytest
import torch

from engine.model_runner import run_to_end
from engine.sampling_params import SamplingParams
from offload.config import OffloadConfig
from tests.conftest import encode, engine_of, make_training
from tests.test_training import PROMPT, label, relative_difference, serve
from tests.tiny import TEST_DEVICE
from trainer.adapter import lora_gradients, lora_parameters
from trainer.config import TrainConfig

OTHERS = ["Tell me about the ocean and its tides.", "Why do cats purr when they are happy?",
          "Name three rivers in Europe, please.", "What makes bread rise in the oven?"]


def make_trainer(mode="cpt", offload=None, learning_rate=1e-2, **train_kwargs):
    torch.manual_seed(0)
    return make_training(TrainConfig(mode=mode, lora_rank=4, learning_rate=learning_rate, **train_kwargs),
                         offload=offload, init_lora_weights=False)


def hold(trainer, request_id):
    """Keeps an entry out of training (as a DPO entry waiting for its label is)."""
    trainer.cache.hold(trainer.cache.get(request_id))


def advance(trainer, steps: int, mode: str) -> None:
    """`steps` optimizer steps on other requests."""
    for i in range(steps):
        serve(trainer, f"other-{i}", prompt=OTHERS[i % len(OTHERS)])
        if mode == "dpo":
            label(trainer, f"other-{i}", chosen="A short and friendly answer.")
        trainer.train_until_idle()
    assert trainer.optimizer.version == steps


def live_weights(trainer) -> list[torch.Tensor]:
    return [p.detach().clone() for p in lora_parameters(trainer.peft_model)]


def load_weights(trainer, weights) -> None:
    with torch.no_grad():
        for p, w in zip(lora_parameters(trainer.peft_model), weights):
            p.copy_(w)


def stale_and_fresh_gradients(trainer, mode: str, stale_by: int, free_layers: bool = False):
    """(gradient of the stale entry's job with its version's weights stashed, gradient of
    a fresh forward and backward with that version's weights loaded, and with today's)."""
    serve(trainer, "s", max_tokens=8)
    if free_layers:
        trainer.offloader.free_to(0)
    hold(trainer, "s")
    served_weights = live_weights(trainer)
    advance(trainer, stale_by, mode)
    entry = trainer.cache.get("s")
    assert entry.recording is not None and trainer.stash.has(0) and entry.adapter_version == 0
    if mode == "dpo":
        label(trainer, "s", chosen="Paris, of course. It is a lovely city.")
    stale = stashed_gradients(trainer, entry, 0)
    today = live_weights(trainer)
    load_weights(trainer, served_weights)
    fresh = lora_gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    load_weights(trainer, today)
    current = lora_gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    return stale, fresh, current


def stashed_gradients(trainer, entry, version: int) -> dict:
    """The LoRA gradients of `entry`'s reuse job, run slice by slice with `version`'s
    weights swapped in, as the trainer runs a stale entry's job."""
    trainer.optimizer.zero_grad()
    job = trainer.method.reuse_job(entry, trainer.context)
    while True:
        with trainer.stash.weights_of(version):
            try:
                next(job)
            except StopIteration:
                break
    grads = lora_gradients(trainer.peft_model)
    trainer.optimizer.zero_grad()
    return grads


def lora_gradients_of(trainer, job) -> dict:
    trainer.optimizer.zero_grad()
    run_to_end(job)
    grads = lora_gradients(trainer.peft_model)
    trainer.optimizer.zero_grad()
    return grads


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "peft"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
@pytest.mark.parametrize("stale_by", [1, 3])
def test_stale_recording_trains_as_a_fresh_pass_under_its_served_version(mode, stale_by, merged):
    """merged: recorded through the merged GEMM (the weights saved as they are); peft:
    through PEFT's forward, which saves views of them (weight.t())."""
    trainer = make_trainer(mode, max_staleness=4, merged_serving=merged)
    stale, fresh, current = stale_and_fresh_gradients(trainer, mode, stale_by)
    assert relative_difference(stale, fresh) <= 1e-5
    assert relative_difference(current, fresh) > 1e-3  # the versions differ: the stash is what makes it exact


@pytest.mark.parametrize("merged", [True, False], ids=["merged", "peft"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_live_stale_weights_train_a_stale_recording_with_todays_lora_weights(mode, merged):
    """`stale_weights = "live"`: two same recordings two versions stale; one trains with
    its version's weights (exactly a fresh pass under them), the other with today's LoRA
    weights re-aimed into the copies: not its version's gradient. (What that is worth is
    measured over HTTP: `alchemist bench backlog`.)"""
    trainer = make_trainer(mode, max_staleness=4, merged_serving=merged, stale_weights="live")
    for request_id in ("s", "t"):
        serve(trainer, request_id, max_tokens=8)
        hold(trainer, request_id)
    served = live_weights(trainer)
    advance(trainer, 2, mode)
    entries = [trainer.cache.get(request_id) for request_id in ("s", "t")]
    if mode == "dpo":
        for request_id in ("s", "t"):
            label(trainer, request_id, chosen="Paris, of course. It is a lovely city.")
    stashed = stashed_gradients(trainer, entries[0], 0)
    trainer.stash.aim_at_live(0)
    reaimed = stashed_gradients(trainer, entries[1], 0)
    today = lora_gradients_of(trainer, trainer.method.recompute_job(entries[0], trainer.context))
    moved = live_weights(trainer)
    load_weights(trainer, served)
    fresh = lora_gradients_of(trainer, trainer.method.recompute_job(entries[0], trainer.context))
    load_weights(trainer, moved)
    assert relative_difference(stashed, fresh) <= 1e-5
    assert relative_difference(reaimed, fresh) > 1e-3
    assert relative_difference(reaimed, stashed) > 1e-3 and relative_difference(today, fresh) > 1e-3


def test_dpo_schedules_agree_on_a_stale_entry_under_the_live_weights():
    """A DPO reuse job without room for both responses' graphs takes its served response's
    log-prob from decoding; under the live weights that was the served version's, where the
    batched schedule scores both responses under today's: the two schedules' gradients
    differed by 1e-3 (a review of the offloader). The served value is used only under the
    weights that decoded it."""
    # the same recording twice, one for each schedule: the second recorded whole too (a
    # cached beginning recomputed under the live weights would not be the recording's)
    trainer = make_trainer("dpo", max_staleness=4, stale_weights="live", record_after_cached_prefix=False)
    for request_id in ("s", "t"):
        serve(trainer, request_id, max_tokens=8)
        hold(trainer, request_id)
    advance(trainer, 2, "dpo")
    for request_id in ("s", "t"):
        label(trainer, request_id, chosen="Paris, of course. It is a lovely city.")
    entries = [trainer.cache.get(request_id) for request_id in ("s", "t")]
    assert all(entry.label.served_logps for entry in entries) and trainer.stash.has(0)
    trainer.stash.aim_at_live(0)
    trainer.context.under_served_weights = False  # as the trainer starts a stale entry's job under "live"
    batched = stashed_gradients(trainer, entries[0], 0)
    graph_fits = type(trainer.context).graph_fits
    type(trainer.context).graph_fits = lambda self, rows: False
    try:
        one_at_a_time = stashed_gradients(trainer, entries[1], 0)
    finally:
        type(trainer.context).graph_fits = graph_fits
    assert relative_difference(one_at_a_time, batched) <= 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bfloat16: the training copies re-aimed
@pytest.mark.parametrize("stale_weights", ["stashed", "live"])
def test_live_stale_weights_give_a_fresh_adapters_a_a_gradient(stale_weights, dtype):
    """From a fresh adapter (LoRA's B = 0) a recording's gradient for every A is zero under
    its own version; once B has moved, "live" re-aims it and A learns from it."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4, learning_rate=1e-2, max_staleness=4,
                                        stale_weights=stale_weights), dtype=dtype)
    serve(trainer, "s", max_tokens=8)
    hold(trainer, "s")
    advance(trainer, 1, "cpt")
    entry = trainer.cache.get("s")
    if stale_weights == "live":
        trainer.stash.aim_at_live(0)
    grads = stashed_gradients(trainer, entry, 0)
    a_norm = sum(g.norm() ** 2 for name, g in grads.items() if "lora_A" in name) ** 0.5
    assert (a_norm > 0) == (stale_weights == "live"), a_norm


@pytest.mark.parametrize("policy", ["load", "recompute"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_stale_recording_with_offloaded_or_recomputed_layers(mode, policy):
    trainer = make_trainer(mode, offload=OffloadConfig(device_budget_bytes=1 << 40, policy=policy), max_staleness=4)
    stale, fresh, _ = stale_and_fresh_gradients(trainer, mode, 2, free_layers=True)
    stats = trainer.offloader.stats
    assert stats.reloaded_layers + stats.recomputed_layers >= len(engine_of(trainer).runner.layers)
    assert relative_difference(stale, fresh) <= 1e-5


def test_trainer_takes_the_stashed_path_within_max_staleness_and_frees_the_stash():
    trainer = make_trainer(max_staleness=2, entries_per_step=1, cohort_max_entries=1)
    for request_id in ("a", "b", "c", "d"):  # all recorded under version 0, trained one per step
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 4
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 1, ("cpt", "stashed"): 2, ("cpt", "recompute"): 1}
    assert trainer.stats.stale_entries == 1  # only "d", 3 versions stale
    assert trainer.stats.staleness == {0: 1, 1: 1, 2: 1, 3: 1}
    assert trainer.stash.versions == [] and trainer.cache.bytes == 0
    assert trainer.status().stash_bytes == 0


def test_stashed_copies_count_as_weights_for_the_offloader_while_they_live():
    """A prefill recorded under a stashed version (the eval gate's candidate is live)
    saves the copies: the offloader must not take them for activations."""
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40))
    trainer.stash.keep(0)
    with trainer.stash.weights_of(0):
        copies = {p.untyped_storage().data_ptr() for p in lora_parameters(trainer.peft_model)}
    assert copies <= trainer.offloader.param_keys
    trainer.stash.release_except(set())
    assert not copies & trainer.offloader.param_keys


def test_stash_is_kept_only_while_a_recording_needs_it():
    trainer = make_trainer(max_staleness=4)
    serve(trainer, "a")
    trainer.train_until_idle()
    assert trainer.stash.versions == []  # nothing waited under version 0
    serve(trainer, "s")
    hold(trainer, "s")
    serve(trainer, "b", prompt=OTHERS[0])
    trainer.train_until_idle()
    assert trainer.stash.versions == [1] and trainer.status().stash_bytes > 0
    trainer.cache.attach_label(trainer.cache.get("s"), None)
    trainer.train_until_idle()
    assert trainer.stash.versions == [] and trainer.stats.trained_entries[("cpt", "stashed")] == 1


def fact_logprob(trainer, fact_ids: list[int], prompt_ids: list[int]) -> float:
    """log p(fact | prompt) under the live adapter (a held-out prompt)."""
    engine = engine_of(trainer)
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt_ids + fact_ids], device=TEST_DEVICE)).logits[0].float()
    rows = logits[len(prompt_ids) - 1:-1].log_softmax(-1)
    return rows.gather(1, torch.tensor(fact_ids, device=rows.device).unsqueeze(1)).sum().item()


def burst_gain(trainer, bursts: int = 4, burst: int = 3) -> float:
    """The gain of log p(fact | held-out prompt) after requests that teach it arrive in
    bursts and training catches up between bursts."""
    fact = encode(" The secret word is marmalade.")
    held_out = encode("Tell me, what is the secret word?")
    engine = engine_of(trainer)
    before = fact_logprob(trainer, fact, held_out)
    for b in range(bursts):
        for i in range(burst):
            engine.add_request(f"r{b}-{i}", encode(f"Note {b}{i}: The secret word is marmalade."),
                               SamplingParams(max_tokens=1), train=True)
        while engine.has_unfinished():
            engine.step()
        trainer.train_until_idle()
    return fact_logprob(trainer, fact, held_out) - before


def test_learning_with_stashing_matches_strict_recomputation():
    """Requests arrive in bursts of 3 and training catches up between bursts, one entry
    per step, so two of each three are 1 and 2 versions stale when trained: within the
    default max_staleness they train on their recordings with delayed gradients; with 0,
    each is recomputed at the current version. The gain on a held-out prompt is at least
    90% of it."""
    gains = {}
    default = TrainConfig().max_staleness
    for max_staleness in (0, default):
        trainer = make_trainer(max_staleness=max_staleness, learning_rate=3e-3, entries_per_step=1,
                               cohort_max_entries=1)
        gains[max_staleness] = burst_gain(trainer)
        paths = trainer.stats.trained_entries
        stale_trained = 4 * min(max_staleness, 2) if max_staleness else 8
        assert paths.get(("cpt", "stashed" if max_staleness else "recompute")) == stale_trained, paths
    assert gains[0] > 1.0  # it learns at all
    assert gains[default] >= 0.9 * gains[0], gains


def test_learning_with_cohorts_matches_strict_recomputation():
    """Two bursts of 8, four entries per AdamW update: strict recomputation trains each
    burst in two steps, recomputing the second four; a cohort trains it in one step of two
    updates, all on their recordings. The gain on a held-out prompt is at least 90% of
    strict's. (At learning rates of 1e-3 and more on this tiny model, a cohort's updates
    along one version's gradient learn much less than strict's re-aimed ones: BENCHMARKS.md,
    "Reuse under a backlog".)"""
    gains = {}
    for name, max_staleness, cohort in (("strict", 0, 4), ("cohort", 1, 32)):
        trainer = make_trainer(max_staleness=max_staleness, learning_rate=3e-4, entries_per_step=4,
                               cohort_max_entries=cohort)
        gains[name] = burst_gain(trainer, bursts=2, burst=8)
        if name == "cohort":
            assert trainer.stats.trained_entries == {("cpt", "reuse"): 16} and trainer.optimizer.version == 2
    assert gains["strict"] > 1.0
    assert gains["cohort"] >= 0.9 * gains["strict"], gains
