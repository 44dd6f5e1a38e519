"""Recorded prefills and training forwards attend in bucketed shapes (on a GPU, where
each new shape builds a fused kernel's graph): the query and key lengths rounded up,
padding masked. The same served tokens and the same gradients as the exact shapes, for
every method's reuse and recompute jobs, and a run of prompts of many lengths attends in
a few shapes."""

import pytest
import torch

from engine.step_inputs import exact_step_shapes, training_buckets
from tests.conftest import make_training
from tests.test_grpo import reward, serve_group
from tests.test_training import gradients_of, label, make_trainer, relative_difference, serve
from trainer.config import TrainConfig

PROMPTS = [" ".join(["word"] * n) + " What is the capital of France?" for n in (13, 16, 19, 22, 25, 28, 31, 34)]


def bucketed(trainer, on: bool) -> None:
    """The runner's shapes as on a GPU (`on`), or the CPU's exact ones."""
    runner, device = trainer.context.runner, torch.device("cuda" if on else "cpu")
    runner.training_buckets = training_buckets(device, runner.block_size, runner.decode_keys[-1])
    runner.exact_shapes = exact_step_shapes(device)


def test_buckets_on_a_gpu_only_half_octaves_and_never_past_the_longest_sequence():
    assert training_buckets(torch.device("cpu"), 16, 4096) is None
    buckets = training_buckets(torch.device("cuda"), 16, 4096)
    assert [buckets.query(n) for n in (1, 5, 17, 40, 49, 100, 700, 2100, 3500, 4000)] == \
        [1, 6, 24, 48, 64, 128, 768, 3072, 4096, 4096]
    assert [buckets.keys(n) for n in (1, 20, 40, 49, 2100, 4000, 5000)] == [16, 32, 48, 64, 3072, 4096, 5000]


def job_gradients(trainer, request_id: str, path: str) -> dict:
    entry = trainer.cache.get(request_id)
    if getattr(entry, "reference_logps", None) is not None:
        entry.reference_logps = None  # each job computes the base reference in its own shapes
    job = trainer.method.reuse_job if path == "reuse" else trainer.method.recompute_job
    return gradients_of(trainer, job(entry, trainer.context))


@pytest.mark.parametrize("mode", ["cpt", "dpo", "grpo"])
def test_bucketed_shapes_give_the_exact_shapes_gradients(mode):
    if mode == "grpo":
        torch.manual_seed(0)
        trainer = make_training(TrainConfig(mode="grpo", lora_rank=4, grpo_beta=0.05), init_lora_weights=False)
    else:
        trainer = make_trainer(mode=mode)
    served = {}
    for request_id in ("exact", "bucketed"):  # the same prompt, the same weights: the same recording, padded or not
        bucketed(trainer, request_id == "bucketed")
        if mode == "grpo":
            served[request_id] = serve_group(trainer, request_id)
            assert reward(trainer, request_id).accepted
        else:
            served[request_id] = serve(trainer, request_id, max_tokens=8)
            if mode == "dpo":
                label(trainer, request_id, chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    assert served["bucketed"] == served["exact"]
    for path in ("reuse", "recompute"):
        bucketed(trainer, False)
        exact = job_gradients(trainer, "exact", path)
        bucketed(trainer, True)
        padded = job_gradients(trainer, "bucketed", path)
        assert all(g.norm() > 0 for g in exact.values())
        assert relative_difference(padded, exact) <= 1e-5, path


def test_prompts_of_many_lengths_attend_in_a_few_shapes(monkeypatch):
    """Counted at the attention call: the recorded prefills' shapes (more than one query
    row), then the recompute jobs'; prompts that share a beginning, each recorded whole."""
    trainer = make_trainer(mode="cpt", record_after_cached_prefix=False)
    shapes = {"recorded prefill": set(), "training": set()}
    phase = "recorded prefill"
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def counted(query, key, value, *args, **kwargs):
        if query.shape[2] > 1:
            shapes[phase].add((tuple(query.shape), tuple(key.shape)))
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
    counts = {}
    for on in (False, True):
        bucketed(trainer, on)
        for values in shapes.values():
            values.clear()
        phase = "recorded prefill"
        for i, prompt in enumerate(PROMPTS):
            serve(trainer, f"p{i}-{on}", prompt=prompt, max_tokens=2)
        phase = "training"
        for i in range(len(PROMPTS)):
            job_gradients(trainer, f"p{i}-{on}", "recompute")
        counts[on] = {name: len(values) for name, values in shapes.items()}
    lengths = {len(trainer.cache.get(f"p{i}-True").prompt_token_ids) for i in range(len(PROMPTS))}
    buckets = {trainer.context.runner.training_buckets.query(n) for n in lengths}
    assert len(lengths) == len(PROMPTS) and len(buckets) == 3
    assert counts[False] == {"recorded prefill": len(PROMPTS), "training": len(PROMPTS)}
    assert counts[True] == {"recorded prefill": len(buckets), "training": len(buckets)}
