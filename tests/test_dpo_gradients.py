"""Both DPO jobs against the textbook computation: PEFT's own forward of prompt + chosen
and prompt + rejected with autograd, the base reference with the adapter off, the sigmoid
loss, one backward. The jobs' schedules (suffixes on the recorded prompt, the head run
once per row, one backward sweep) must give its LoRA gradients."""

import pytest
import torch

from tests.test_training import gradients_of, label, make_trainer, relative_difference, serve
from trainer.adapter import adapters_disabled, lora_gradients
from trainer.losses import dpo_loss, token_logprobs


def summed_logps(peft_model, prompt: list[int], responses: list[list[int]]) -> torch.Tensor:
    """(len(responses),) log p(response | prompt), each row its own forward."""
    values = []
    for response in responses:
        ids = torch.tensor([prompt + response], device=peft_model.device)
        logits = peft_model(input_ids=ids).logits[0, len(prompt) - 1:-1]
        values.append(token_logprobs(logits, ids[0, len(prompt):]).sum())
    return torch.stack(values)


def textbook_gradients(trainer, entry) -> dict:
    peft_model, prompt = trainer.peft_model, entry.prompt_token_ids
    responses = [entry.label.chosen, entry.label.rejected]
    with torch.no_grad(), adapters_disabled(peft_model):
        reference = summed_logps(peft_model, prompt, responses)
    trainer.optimizer.zero_grad()
    with torch.enable_grad():
        policy = summed_logps(peft_model, prompt, responses)
        loss, _ = dpo_loss(policy[0], policy[1], reference[0], reference[1], trainer.method.beta)
        loss.backward()
    grads = lora_gradients(peft_model)
    trainer.optimizer.zero_grad()
    return grads


JOBS = {"reuse": "reuse_job", "recompute": "recompute_job", "baseline": "baseline_job",
        # the reuse job's schedule when a device budget has no room for both responses' graphs
        "reuse_one_at_a_time": "_reuse_one_response_at_a_time"}


@pytest.mark.parametrize("path, one_sweep, rejected", [
    ("reuse", True, None), ("reuse", False, None), ("recompute", True, None), ("recompute", True, "Rome."),
    ("baseline", True, None),
    ("reuse_one_at_a_time", True, None), ("reuse_one_at_a_time", True, "Rome.")])
def test_dpo_jobs_give_the_textbook_gradients(path, one_sweep, rejected):
    """rejected None: the served response, its log-prob taken from decoding; else given."""
    trainer = make_trainer(mode="dpo", head_chunk_rows=3, one_backward_sweep=one_sweep)
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected=rejected)
    entry = trainer.cache.get("r")
    expected = textbook_gradients(trainer, entry)
    got = gradients_of(trainer, getattr(trainer.method, JOBS[path])(entry, trainer.context))
    assert set(got) == set(expected) and all(g.norm() > 0 for g in expected.values())
    assert relative_difference(got, expected) <= 1e-4


@pytest.mark.parametrize("path", ["reuse", "recompute", "baseline"])
def test_the_jobs_regroup_rows_per_sequence_without_an_accumulating_index_put(path):
    """Attention regroups packed rows per sequence (queries, keys, values) and back: each
    gather is an `index_select`, whose backward is one `index_add`, where advanced
    indexing's is an accumulating `index_put_` (on a GPU: a sort of the indices, several
    kernels, for every layer's regrouping)."""
    from bench.step_counts import AtenOps
    from engine.model_runner import run_to_end
    trainer = make_trainer(mode="dpo")
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen="Paris, of course. It is a lovely city.")
    counter = AtenOps()
    with counter.counting():
        run_to_end(getattr(trainer.method, JOBS[path])(trainer.cache.get("r"), trainer.context))
    assert counter.ops["index_put"] == 0 and counter.ops["index"] == 0 and counter.ops["index_add"] > 0
