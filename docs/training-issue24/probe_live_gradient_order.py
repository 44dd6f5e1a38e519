"""How close a stale recording's gradient is to a fresh pass's, by `train.stale_weights`.

An entry recorded under version 0 trains after version 1 was stepped (one entry per
step). Its applied gradient is compared with a fresh pass at the weights it is applied to,
∇L(θ_now), as the step shrinks tenfold twice. Were `live` exact to first order in the
weights' change, its error would fall 100x per step; an O(Δ) error falls 10x.

    .venv/bin/python docs/training-issue24/probe_live_gradient_order.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.sampling_params import SamplingParams  # noqa: E402
from tests.conftest import encode, engine_of, make_training  # noqa: E402
from tests.test_training import gradients_of as gradients  # noqa: E402
from trainer.config import TrainConfig  # noqa: E402
from trainer.feedback import FeedbackLabel  # noqa: E402
from trainer.optimizer import AdapterOptimizer  # noqa: E402

PROMPTS = {"a": "Hello, how are you today? I am fine, thank you.",
           "b": "The quick brown fox jumps over the lazy dog. What is the capital of France?"}
CHOSEN = {"a": "I am fine.", "b": "Paris is the capital of France."}


def distance(a: dict, b: dict) -> float:
    return (sum(((a[k] - b[k]) ** 2).sum() for k in b) / sum((b[k] ** 2).sum() for k in b)).sqrt().item()


def applied_and_fresh(mode: str, learning_rate: float, stale_weights: str) -> tuple[float, float]:
    """(applied vs fresh, ∇L(θ_v) vs fresh), relative."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode=mode, lora_rank=4, learning_rate=learning_rate, entries_per_step=1,
                                        cohort_max_entries=1, max_staleness=8, stale_weights=stale_weights),
                            "llama", init_lora_weights=False)
    for request_id, prompt in PROMPTS.items():
        engine_of(trainer).add_request(request_id, encode(prompt), SamplingParams(temperature=1.0, seed=1,
                                                                                 max_tokens=3, ignore_eos=True),
                                       train=True)
        while engine_of(trainer).has_unfinished():
            engine_of(trainer).step()
        if mode == "dpo":
            assert trainer.feedback.submit(FeedbackLabel(request_id, chosen=CHOSEN[request_id])).accepted
    stale = trainer.cache.get("b")
    at_v = gradients(trainer, trainer.method.recompute_job(stale, trainer.context))
    while trainer.optimizer.version < 1:
        trainer.run_slice()
    fresh = gradients(trainer, trainer.method.recompute_job(stale, trainer.context))
    applied = []
    step = AdapterOptimizer.step

    def spy(optimizer, *args, **kwargs):
        applied.append({name: p.grad.detach().clone() for name, p in trainer.peft_model.named_parameters()
                        if "lora_" in name and p.grad is not None})
        return step(optimizer, *args, **kwargs)

    AdapterOptimizer.step = spy
    try:
        while trainer.optimizer.version < 2:
            trainer.run_slice()
    finally:
        AdapterOptimizer.step = step
    return distance(applied[-1], fresh), distance(at_v, fresh)


if __name__ == "__main__":
    torch.set_num_threads(1)
    print("| job | learning rate | ∇L(θ_v) to fresh | live to fresh | stashed to fresh |")
    print("| --- | --- | ---: | ---: | ---: |")
    for mode in ("cpt", "dpo"):
        for learning_rate in (1e-3, 1e-4, 1e-5):
            live, at_v = applied_and_fresh(mode, learning_rate, "live")
            stashed, _ = applied_and_fresh(mode, learning_rate, "stashed")
            print(f"| {mode} | {learning_rate:.0e} | {at_v:.3g} | {live:.3g} | {stashed:.3g} |")
