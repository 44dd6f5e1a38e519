"""`train.dpo_reference = "served"`: the reference is the adapter version the gradient is
computed under. No reference forward runs; the loss starts at ln 2; both paths give the
same gradients; with a zero adapter (policy = base model) it is DPO against the base
model exactly; a stale recording trains as a fresh pass under its served version."""

import math

import pytest
import torch

from tests.conftest import make_training
from tests.test_stash import stale_and_fresh_gradients
from tests.test_training import gradients_of, label, relative_difference, serve
from trainer.config import TrainConfig


def dpo_trainer(reference: str, zero_adapter: bool = False, **train_kwargs):
    torch.manual_seed(0)
    config = TrainConfig(mode="dpo", lora_rank=4, dpo_reference=reference, **train_kwargs)
    # a zero adapter (B = 0, PEFT's default) makes the policy equal the base model
    return make_training(config, init_lora_weights=zero_adapter)


def labelled_entry(trainer, both_given: bool):
    serve(trainer, "r", max_tokens=8)
    if both_given:
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.", rejected="Rome.")
    else:  # the served response is the rejected one; its log-prob comes from decoding
        label(trainer, "r", chosen="Paris, of course. It is a lovely city.")
    return trainer.cache.get("r")


@pytest.mark.parametrize("both_given", [False, True], ids=["served-rejected", "both-given"])
def test_served_reference_runs_no_reference_forward_and_paths_agree(both_given):
    trainer = dpo_trainer("served")
    entry = labelled_entry(trainer, both_given)
    results = []

    def job_and_result(job):
        result = yield from job
        results.append(result)
        return result

    reuse = gradients_of(trainer, job_and_result(trainer.method.reuse_job(entry, trainer.context)))
    recompute = gradients_of(trainer, job_and_result(trainer.method.recompute_job(entry, trainer.context)))
    assert entry.reference_logps is None  # never computed
    assert all(math.isclose(r.loss, math.log(2), rel_tol=1e-6) for r in results)
    assert all(g.norm() > 0 for g in recompute.values())
    assert relative_difference(reuse, recompute) <= 1e-4


@pytest.mark.parametrize("zero_adapter", [True, False])
def test_served_reference_is_the_base_reference_while_the_adapter_is_zero(zero_adapter):
    grads = {}
    for reference in ("base", "served"):
        trainer = dpo_trainer(reference, zero_adapter)
        entry = labelled_entry(trainer, both_given=False)
        grads[reference] = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    # over all LoRA tensors at once: with B = 0, A's gradients are zero
    served, base = (torch.cat([g.flatten() for _, g in sorted(grads[r].items())]) for r in ("served", "base"))
    assert base.norm() > 0
    difference = ((served - base).norm() / base.norm()).item()
    if zero_adapter:
        assert difference <= 1e-5
    else:  # the adapter moved the policy away from the base model: the references differ
        assert difference > 1e-3


def test_stale_recording_with_served_reference_trains_as_under_its_version():
    torch.manual_seed(0)
    config = TrainConfig(mode="dpo", lora_rank=4, learning_rate=1e-2, max_staleness=4, dpo_reference="served")
    trainer = make_training(config, init_lora_weights=False)
    stale, fresh, current = stale_and_fresh_gradients(trainer, "dpo", 2)
    assert relative_difference(stale, fresh) <= 1e-5
    assert relative_difference(current, fresh) > 1e-3


def test_unknown_reference_is_refused():
    with pytest.raises(ValueError, match="dpo_reference"):
        TrainConfig(mode="dpo", dpo_reference="sft")
