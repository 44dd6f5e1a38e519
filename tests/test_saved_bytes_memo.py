"""Recorded prefills without saved-tensor hooks (engine/saved_bytes_memo.py): where every
LoRA product comes from a training copy (a bfloat16 model) or from the CPU's current
merged copy (a float32 model) and nothing offloads, a shape recorded before is recorded
without hooks, counted as it was measured, and trains to the same gradients — fresh and
stale, with the live or the stashed weights; a float32 model whose merged copies are
stale (just after an optimizer step), PEFT's float32 LoRA math on a bfloat16 model and an
offloader keep the hooks."""

import logging

import pytest
import torch

from engine.model_runner import run_to_end
from engine.recording import SavedTensor, SavedTensorTracker
from engine.saved_bytes_memo import RecordingShape, SavedBytesMemo
from offload.config import OffloadConfig
from tests.conftest import engine_of, make_training
from tests.test_training import gradients_of, label, serve
from tests.tiny import FAMILIES
from trainer.adapter import lora_parameters, merge_all
from trainer.config import TrainConfig

PROMPT = "The quick brown fox jumps over the lazy dog. What is the capital of France?"
# other tokens, as many: the same shape
OTHER = "The quick brown dog jumps over the lazy fox. What is the capital of France?"


@pytest.fixture
def packs(monkeypatch):
    """Counts the saved tensors the tracker's hooks pack (one SavedTensor each)."""
    counted = [0]
    original = SavedTensor.__init__

    def counting(self, *args, **kwargs):
        counted[0] += 1
        original(self, *args, **kwargs)

    monkeypatch.setattr(SavedTensor, "__init__", counting)
    return counted


# the two ways a recording saves activations only: bfloat16 training copies, float32 merged copies
PATHS = ("copies", "merged")
# a prompt recorded again is recorded whole, in the shape of its first recording (not after
# the beginning that one left in the prefix cache)
WHOLE = {"record_after_cached_prefix": False}


def bfloat16_training(mode: str = "dpo", offload: OffloadConfig | None = None, family: str = "llama"):
    torch.manual_seed(0)
    return make_training(TrainConfig(mode=mode, lora_rank=4, lora_compute_dtype="model", **WHOLE), family,
                         dtype=torch.bfloat16, offload=offload, init_lora_weights=False)


def training(path: str, mode: str = "dpo", family: str = "llama"):
    if path == "copies":
        return bfloat16_training(mode, family=family)
    torch.manual_seed(0)
    return make_training(TrainConfig(mode=mode, lora_rank=4, **WHOLE), family, init_lora_weights=False)


def recorded(trainer, request_id: str, packs, prompt: str = PROMPT) -> tuple[object, int]:
    """(the cache entry of `prompt` served recorded, the saved tensors its hooks packed)."""
    before = packs[0]
    serve(trainer, request_id, prompt=prompt, max_tokens=4)
    return trainer.cache.get(request_id), packs[0] - before


@pytest.mark.parametrize("path", PATHS)
def test_a_shape_recorded_before_runs_without_hooks_and_counts_what_the_hooks_measured(packs, path):
    trainer = training(path)
    first, first_packs = recorded(trainer, "first", packs)
    second, second_packs = recorded(trainer, "second", packs, OTHER)
    assert first_packs > 0 and second_packs == 0
    assert second.recording.saved_bytes == first.recording.saved_bytes > 0
    assert second.recording.saved_sizes == first.recording.saved_sizes
    # measured again by a tracker of its own, the second shape's recording saves those very bytes
    runner = engine_of(trainer).runner
    runner.record_tracker = tracker = SavedTensorTracker()
    third, third_packs = recorded(trainer, "third", packs, OTHER)
    runner.record_tracker = None
    assert third_packs > 0 and third.recording.saved_bytes == tracker.live_bytes == first.recording.saved_bytes
    # another length is another shape: measured with the hooks
    _, other_length_packs = recorded(trainer, "longer", packs, PROMPT + " And of Italy?")
    assert other_length_packs > 0


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("mode,family", [("dpo", f) for f in FAMILIES] + [("cpt", "llama")])
def test_a_recording_without_hooks_trains_to_the_same_gradients(packs, mode, family, path):
    trainer = training(path, mode, family)
    hooked, hooked_packs = recorded(trainer, "hooked", packs)
    plain, plain_packs = recorded(trainer, "without", packs)
    assert hooked_packs > 0 and plain_packs == 0
    if mode == "dpo":
        label(trainer, "hooked")
        label(trainer, "without")
    expected = gradients_of(trainer, trainer.method.reuse_job(hooked, trainer.context))
    got = gradients_of(trainer, trainer.method.reuse_job(plain, trainer.context))
    assert expected.keys() == got.keys() and all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("stale_weights", ["live", "stashed"])
def test_a_stale_recording_without_hooks_trains_as_one_with_them(packs, stale_weights, path):
    """The live LoRA weights change in place after both recordings (as an optimizer step
    does): neither graph saved them (their nodes hold them, and resolve them to the stash's
    copies), so the one without hooks trains as the one with them — with the stash's
    copies swapped in, or re-aimed at the live values."""
    trainer = training(path, "cpt")
    hooked, _ = recorded(trainer, "hooked", packs)
    plain, plain_packs = recorded(trainer, "without", packs)
    assert plain_packs == 0
    version = trainer.optimizer.version
    trainer.stash.keep(version)
    with torch.no_grad():
        for p in lora_parameters(trainer.peft_model):
            p.add_(torch.randn_like(p) * 1e-2)

    def stale_gradients(entry) -> dict:
        if stale_weights == "live":
            trainer.stash.aim_at_live(version)
            return gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
        trainer.optimizer.zero_grad()
        job = trainer.method.reuse_job(entry, trainer.context)
        with trainer.stash.weights_of(version):
            run_to_end(job)
        grads = {n: p.grad.clone() for n, p in trainer.peft_model.named_parameters() if p.grad is not None}
        trainer.optimizer.zero_grad()
        return grads

    expected, got = stale_gradients(hooked), stale_gradients(plain)
    assert expected and all(torch.equal(got[k], expected[k]) for k in expected)


def test_a_graph_that_holds_the_lora_weights_refuses_them_changed_without_a_stashed_copy():
    trainer = training("merged", "cpt")
    serve(trainer, "r", prompt=PROMPT, max_tokens=4)
    entry = trainer.cache.get("r")
    with torch.no_grad():
        for p in lora_parameters(trainer.peft_model):
            p.add_(1e-2)  # no stash.keep: nothing to resolve them to
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))


def test_float32_merged_copies_made_stale_by_an_optimizer_step_record_with_the_hooks(packs):
    """Until the merged copies are rebuilt, a recorded forward runs PEFT's path, which
    saves the LoRA weights: the hooks resolve them if the recording goes stale."""
    trainer = training("merged")
    _, first = recorded(trainer, "first", packs)
    _, known = recorded(trainer, "known", packs, OTHER)
    with torch.no_grad():
        for p in lora_parameters(trainer.peft_model):
            p.add_(1e-2)
    _, after_step = recorded(trainer, "after-step", packs)
    merge_all(trainer.peft_model)
    _, merged_again = recorded(trainer, "merged-again", packs, OTHER)
    assert first > 0 and known == 0 and after_step > 0 and merged_again == 0


def test_peft_float32_math_and_an_offloader_keep_the_hooks_on_every_recording(packs):
    peft_math = make_training(TrainConfig(mode="dpo", lora_rank=4, lora_compute_dtype="float32", **WHOLE),
                              dtype=torch.bfloat16, init_lora_weights=False)
    assert engine_of(peft_math).runner.saved_bytes_memo is None  # PEFT's float32 LoRA math on a bfloat16 model
    offloaded = bfloat16_training(offload=OffloadConfig(device_budget_bytes=1 << 30))
    _, first = recorded(offloaded, "first", packs)
    _, second = recorded(offloaded, "second", packs, OTHER)
    assert first > 0 and second == first  # the offloader places every recording's saved tensors


def test_the_memo_measures_again_every_so_often_and_takes_a_different_figure_with_a_warning(caplog):
    memo = SavedBytesMemo(remeasure_every=3)
    shape = RecordingShape(rows=12, riders=0, query_rows=16, num_keys=16, all_logit_rows=False)
    assert memo.lookup(shape) is None
    memo.measured(shape, 100, [60, 40])
    assert [memo.lookup(shape) is None for _ in range(6)] == [False, False, True, False, False, True]
    assert memo.lookup(shape).total == 100 and memo.mismatches == 0
    memo.measured(shape, 100, [60, 40])  # the same figure confirmed: no warning
    with caplog.at_level(logging.WARNING, logger="engine.saved_bytes_memo"):
        memo.measured(shape, 120, [60, 60])
    assert memo.mismatches == 1 and "not the 100" in caplog.text
    assert memo.lookup(shape).sizes == [60, 60]


def test_the_memo_keeps_the_most_recent_shapes():
    memo = SavedBytesMemo(max_shapes=2)
    shapes = [RecordingShape(rows=n, riders=0, query_rows=n, num_keys=n, all_logit_rows=False) for n in (1, 2, 3)]
    for n, shape in enumerate(shapes):
        memo.measured(shape, n, [n])
    assert memo.lookup(shapes[0]) is None and memo.lookup(shapes[2]).total == 2


@pytest.mark.parametrize("stale_weights", ["live", "stashed"])
def test_the_trainer_trains_recordings_without_hooks_fresh_and_stale(packs, stale_weights):
    """The server's trainer on recordings of one shape, one entry per optimizer step: the
    first is fresh, the rest stale by one version and more — each on its own recording,
    none failed."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="dpo", lora_rank=4, lora_compute_dtype="model", max_staleness=4, **WHOLE,
                                        entries_per_step=1, cohort_max_entries=1, stale_weights=stale_weights),
                            dtype=torch.bfloat16, init_lora_weights=False)
    prompts = [PROMPT, OTHER, PROMPT, OTHER]
    for i, prompt in enumerate(prompts):
        serve(trainer, f"r{i}", prompt=prompt, max_tokens=4)
        label(trainer, f"r{i}")
    assert packs[0] > 0  # the first recording measured its shape
    before = packs[0]
    trainer.train_until_idle()
    trained = trainer.stats.trained_entries
    assert trainer.stats.failed_jobs == 0 and trainer.optimizer.version == len(prompts)
    assert trained.get(("dpo", "reuse"), 0) == 1 and trained.get(("dpo", "stashed"), 0) == len(prompts) - 1
    assert packs[0] == before  # nor did training make a saved-tensor object
