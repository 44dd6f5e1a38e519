"""What tracking a GRPO group's log-probs at its sampling temperature costs a sampler call.

A group of 8 choices at temperature 0.7 tracks each sampled token's log-prob for its trainer:
at the model's own distribution (the raw log-softmax, which the call computes anyway) as the
tree before did, or at the sampling temperature (one more pass over the vocabulary, for the
group's rows). The sampler alone, on logits of SmolLM2's vocabulary (49,152), the group
alone and beside 24 other running sequences; interleaved rounds, the ratio of the medians.
Run from the repository root:

    .venv/bin/python docs/grpo-temperature/sampler_cost.py
"""

import statistics
import time

import torch

from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.sequence import Sequence

VOCAB, GROUP, OTHERS, CALLS, ROUNDS = 49_152, 8, 24, 100, 7


def batch(logprob_temperature: float, others: int) -> list[Sequence]:
    group = SamplingParams(n=GROUP, temperature=0.7, top_p=1.0, max_tokens=16)
    alone = SamplingParams(temperature=0.7, top_p=1.0, max_tokens=16)
    return [Sequence(seq_id=i, request_id=str(i if i >= GROUP else "g"), index=min(i, GROUP), prompt_token_ids=[1],
                     params=group if i < GROUP else alone, max_tokens=16, arrival_time=0.0, detokenizer=None,
                     track_logprob=i < GROUP, logprob_temperature=logprob_temperature if i < GROUP else 1.0)
            for i in range(GROUP + others)]


def seconds_per_call(sampler: Sampler, logits: torch.Tensor, seqs: list[Sequence]) -> float:
    started = time.perf_counter()
    for _ in range(CALLS):
        sampler.sample(logits, seqs)
    return (time.perf_counter() - started) / CALLS


def main() -> None:
    torch.manual_seed(0)
    sampler = Sampler(eos_token_ids={0})
    for others in (0, OTHERS):
        logits = torch.randn(GROUP + others, VOCAB) * 3
        cases = {"model's own (before)": batch(1.0, others), "sampling temperature": batch(0.7, others)}
        times = {name: [] for name in cases}
        for seqs in cases.values():
            seconds_per_call(sampler, logits, seqs)  # warm-up
        for _ in range(ROUNDS):
            for name, seqs in cases.items():
                times[name].append(seconds_per_call(sampler, logits, seqs))
        medians = {name: statistics.median(values) for name, values in times.items()}
        print(f"a group of {GROUP} beside {others} other sequences:")
        for name, median in medians.items():
            print(f"  {name:24s} {median * 1e6:8.1f} us per call (median of {ROUNDS} rounds of {CALLS})")
        ratio = medians["sampling temperature"] / medians["model's own (before)"]
        print(f"  at the sampling temperature / the model's own: {ratio:.3f}x")


if __name__ == "__main__":
    main()
