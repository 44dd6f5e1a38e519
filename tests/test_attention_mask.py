"""An attention group's mask is made once per step as SDPA's additive mask in the queries'
dtype (0 where a query may attend to a key, −inf where not), and every layer reads that
one tensor. Given the boolean mask, as before, SDPA converted it in every call (a `where`
and two scalars per layer: launches on a GPU, a mask-sized write on the CPU).

Against the boolean mask: the same tokens and prompt logprobs, bit for bit, for every
family (sliding windows included) with chunked prefills and mixed steps; the same LoRA
gradients for the training jobs; and no conversion in a decode step's layers."""

from collections import Counter

import pytest
import torch

from engine.kv_cache import AttentionGroup, AttentionMetadata
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_engine
from tests.test_causal_prefill import served
from tests.test_training import gradients_of, label, make_trainer, serve
from tests.tiny import FAMILIES


def boolean_masks(monkeypatch) -> None:
    """The path before: every layer hands SDPA the boolean mask (made once), which SDPA converts."""
    def boolean_mask(self, sliding_window=None, dtype=None):
        if sliding_window not in self._masks:
            self._masks[sliding_window] = self.allowed(sliding_window)
        return self._masks[sliding_window]

    monkeypatch.setattr(AttentionGroup, "mask", boolean_mask)


def test_the_mask_is_what_sdpa_makes_of_the_boolean_one():
    group = AttentionMetadata.packed([5, 3], [0, 4], torch.device("cpu")).single
    for window, dtype in ((None, torch.float32), (3, torch.bfloat16)):
        allowed = group.allowed(window)
        mask = group.mask(window, dtype)
        assert mask.dtype == dtype and mask.shape == allowed.shape
        assert torch.equal(mask == 0, allowed) and torch.isneginf(mask[~allowed]).all()
        assert group.mask(window, dtype) is mask  # made once, read by every layer


@pytest.mark.parametrize("family", FAMILIES)
def test_served_tokens_and_prompt_logprobs_equal_the_boolean_masks_bit_for_bit(family, monkeypatch):
    additive = served(make_engine(family, max_num_batched_tokens=24))  # later chunks and decodes read masks
    boolean_masks(monkeypatch)
    boolean = served(make_engine(family, max_num_batched_tokens=24))
    assert additive == boolean


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_training_jobs_give_the_boolean_masks_gradients(mode, monkeypatch):
    jobs = {}
    for path in ("additive", "boolean"):
        torch.manual_seed(0)
        trainer = make_trainer("llama", mode)
        if path == "boolean":
            boolean_masks(monkeypatch)
        serve(trainer, "r", max_tokens=8)
        entry = trainer.cache.get("r")
        if mode == "dpo":
            label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
        jobs[path] = {name: gradients_of(trainer, getattr(trainer.method, f"{name}_job")(entry, trainer.context))
                      for name in ("reuse", "recompute")}
        monkeypatch.undo()
    for name in ("reuse", "recompute"):
        for key, tensor in jobs["boolean"][name].items():
            assert torch.equal(jobs["additive"][name][key], tensor), (name, key)


def _decode_step_events(monkeypatch, boolean: bool) -> Counter:
    """The aten ops a decode step of three streams runs, kernels inside SDPA's included."""
    engine = make_engine("llama")
    engine.runner.decode_graphs.enabled = False  # a replayed CUDA graph dispatches no ops: count the eager step
    if boolean:
        boolean_masks(monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i, prompt in enumerate(["Hello there", "The capital of France is", "One two three four five"]):
        engine.add_request(f"r{i}", encode(prompt), params)
    for _ in range(3):  # the prefills, then decodes
        engine.step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        engine.step()
    monkeypatch.undo()
    return Counter(event.name for event in profile.events())


def test_a_decode_step_converts_no_mask_in_its_layers(monkeypatch):
    layers = make_engine("llama").runner.model.config.num_hidden_layers
    additive, boolean = (_decode_step_events(monkeypatch, b) for b in (False, True))
    assert boolean["aten::where"] >= layers and boolean["aten::scalar_tensor"] == 2 * layers  # each layer's
    assert additive["aten::where"] == additive["aten::scalar_tensor"] == 0
    assert additive["aten::masked_fill_"] == 1  # the step's one mask
