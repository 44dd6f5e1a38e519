"""What turning the adapter off and on costs the host, per training slice that computes
DPO's base reference (`trainer.adapter.adapters_disabled`, entered around each of its
slices), on a tiny Llama with as many decoder layers as Llama-3.1-8B (32) and LoRA on
every linear (224 adapted layers): the switch alone, and the whole reference (the prompt,
then both responses against its K/V, no grad) of one DPO entry. The model is tiny, so the
times are the host's, as on a GPU that waits for its host. Run from the repository root
(and in a worktree of an older tree to compare):

    PYTHONPATH=. .venv/bin/python docs/training-issue24/adapter_switch_cost.py
"""

import statistics
import time

import torch

from engine.model_runner import run_to_end
from engine.sampling_params import SamplingParams
from server.build import build_training_engine
from tests.conftest import encode, make_config
from tests.test_training import PROMPT
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.adapter import adapters_disabled
from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel


def median_us(fn, repeats: int = 7, calls: int = 200) -> float:
    rounds = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(rounds)


def main() -> None:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=32, hidden_size=16)
    engine, trainer = build_training_engine(model, tiny_tokenizer(), make_config(),
                                            TrainConfig(mode="dpo", lora_rank=8), init_lora_weights=False)
    switch = adapters_disabled(trainer.peft_model)

    def enter_and_exit() -> None:
        with switch:
            pass

    print(f"adapted layers: {len(switch.layers)}")
    print(f"adapters off and on again: {median_us(enter_and_exit):,.0f} µs")
    engine.add_request("entry", encode(PROMPT), SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True),
                       train=True)
    while engine.has_unfinished():
        engine.step()
    assert trainer.feedback.submit(FeedbackLabel("entry", "Paris, of course. It is a lovely city.", None, 0)).accepted
    entry = trainer.cache.get("entry")

    def reference() -> None:
        run_to_end(trainer.method.reference_logps(entry, trainer.context))

    print(f"DPO's base reference of one entry: {median_us(reference, repeats=5, calls=5) / 1000:,.1f} ms")


if __name__ == "__main__":
    main()
