"""Prefills attend as SDPA's causal kernel, and serving steps run at their exact shapes on the CPU.

A group whose sequences all begin at position 0 (a prompt's first chunk, a training
forward, a shared-prefix pack's prompt) runs `is_causal` instead of reading a mask; on the
CPU a serving step's groups (its decodes', its prefill chunks') are not padded to buckets.
Against the plain path (bucketed, the mask read): the same tokens, prompt logprobs and
LoRA gradients, and fewer ops."""

import pytest
import torch

from bench.step_counts import AtenOps
from engine.kv_cache import AttentionGroup, AttentionMetadata
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepBuckets, layout_step
from tests.conftest import encode, make_engine
from tests.test_training import gradients_of, label, make_trainer, relative_difference, serve
from tests.tiny import FAMILIES, TEST_DEVICE

PROMPTS = ["Hello, how are you today?", "The quick brown fox jumps over the lazy dog. What is the capital of France?",
           "Paris", "Continuous batching lets new requests join a running batch at step boundaries."]


def plain_path(monkeypatch, runner) -> None:
    """The path before: prefill groups bucketed as decodes are, every group reading its mask."""
    runner.exact_shapes = False
    monkeypatch.setattr(AttentionGroup, "runs_causal", lambda self, sliding_window=None: False)


def served(engine) -> dict:
    """Greedy tokens and prompt logprobs of PROMPTS, arriving while the others decode (mixed steps)."""
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=12, prompt_logprobs=1)
    results = {}
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", encode(prompt), params)
        engine.step()
    while engine.has_unfinished():
        for out in engine.step()[0]:
            tokens, logprobs = results.setdefault(out.request_id, ([], []))
            tokens += out.outputs[0].token_ids
            if out.prompt_logprobs:
                logprobs += [p.logprob for p in out.prompt_logprobs if p is not None]
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_served_tokens_and_prompt_logprobs_equal_the_plain_paths(family, monkeypatch):
    fast = served(make_engine(family, max_num_batched_tokens=24))  # chunked: later chunks read the mask
    engine = make_engine(family, max_num_batched_tokens=24)
    plain_path(monkeypatch, engine.runner)
    plain = served(engine)
    assert fast.keys() == plain.keys() == {f"r{i}" for i in range(len(PROMPTS))}
    for request_id in plain:
        assert fast[request_id][0] == plain[request_id][0], request_id
        assert torch.allclose(torch.tensor(fast[request_id][1]), torch.tensor(plain[request_id][1]), atol=1e-5)


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="a GPU pads a serving step's prefills to its buckets")
def test_a_prefill_step_builds_no_mask_and_pads_nothing_on_the_cpu(monkeypatch):
    counts = {}
    for path in ("causal", "plain"):
        engine = make_engine("llama", max_num_batched_tokens=128, max_model_len=256)
        if path == "plain":
            plain_path(monkeypatch, engine.runner)
        engine.add_request("warm-up", encode(PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=1))
        engine.step()
        # (a prompt that does not begin as the warm-up's: none of it is in the prefix cache)
        engine.add_request("r", encode(PROMPTS[3] + " " + PROMPTS[1]), SamplingParams(temperature=0.0, max_tokens=1))
        counts[path] = AtenOps()
        with counts[path].counting():
            engine.step()
    assert counts["causal"].total < counts["plain"].total, (counts["causal"].ops, counts["plain"].ops)
    assert counts["causal"].ops["le"] == 0 < counts["plain"].ops["le"]  # the mask's comparison


def test_layout_exact_groups_on_the_cpu_and_causal_only_from_position_0():
    buckets = StepBuckets(16)
    # a prompt's first chunk (from 0), a later chunk (from 20) and two decodes
    lengths, starts = [37, 5, 1, 1], [0, 20, 9, 40]
    tables = [[0, 1, 2], [3, 4], [5], [6, 7, 8]]
    ids = list(range(sum(lengths)))
    kwargs = dict(block_size=16, scratch_slot=999)
    exact = layout_step(lengths, starts, tables, ids, [], buckets, exact_shapes=True, **kwargs)
    padded = layout_step(lengths, starts, tables, ids, [], buckets, **kwargs)
    # decodes, prefills from 0 and prefills going on from earlier tokens apart, each exact: the later
    # chunk's 5 queries are not padded to the first chunk's 37
    assert exact.shapes == [(2, 41), (1, 37), (1, 25)]
    assert padded.shapes == [(2, 64), (1, 64), (1, 32)]
    assert exact.arrays["query_index1"].shape == (1, 37) and padded.arrays["query_index1"].shape == (1, 64)
    assert exact.arrays["query_index2"].shape == (1, 5) and padded.arrays["query_index2"].shape == (1, 8)
    decodes_only = dict(lengths=[1] * 3, starts=[9, 40, 3], block_tables=tables[:3], token_ids=[0, 1, 2],
                        sample_rows=[0, 1, 2], buckets=buckets, **kwargs)
    assert not layout_step(**decodes_only, exact_shapes=True).static  # no row padded to the batch bucket
    assert layout_step(**decodes_only).static and layout_step(**decodes_only).shapes == [(4, 64)]
    assert exact.causal == [False, True, False]  # the first chunk from 0, causal; the later one starts at 20
    alone = layout_step([37, 12], [0, 0], tables[:2], list(range(49)), [], buckets, exact_shapes=True, **kwargs)
    assert alone.causal == [True]


def test_causal_only_where_a_sliding_window_covers_every_key():
    group = AttentionMetadata.packed([5, 3], [0, 0], torch.device("cpu")).single
    assert group.causal and group.runs_causal() and group.runs_causal(5) and not group.runs_causal(4)
    suffixes = AttentionMetadata.packed([5, 3], [0, 4], torch.device("cpu")).single
    assert not suffixes.causal
    pack = AttentionMetadata.shared_prefix(6, [3, 4], torch.device("cpu"))
    assert [g.causal for g in pack.groups] == [True, False]


@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_training_jobs_give_the_plain_paths_gradients(mode, monkeypatch):
    """The recorded prefill, the reuse job's reference pack and the recompute job's forward
    run causal groups; the gradients are the mask's."""
    jobs = {}
    for path in ("causal", "plain"):
        torch.manual_seed(0)
        trainer = make_trainer("llama", mode)
        if path == "plain":
            plain_path(monkeypatch, trainer.context.runner)
        serve(trainer, "r", max_tokens=8)
        entry = trainer.cache.get("r")
        if mode == "dpo":
            label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
        jobs[path] = {name: gradients_of(trainer, getattr(trainer.method, f"{name}_job")(entry, trainer.context))
                      for name in ("reuse", "recompute", "baseline")}
        monkeypatch.undo()
    for name in ("reuse", "recompute", "baseline"):
        assert relative_difference(jobs["causal"][name], jobs["plain"][name]) <= 1e-5, name
