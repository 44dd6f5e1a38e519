"""The server's recomputation against the separate trainer's, on the embedded model.

An entry without a usable recording (a label for a request that was not recorded, a
recording given up under memory pressure or grown too stale) trains by `recompute_job`:
the prompt once, its responses packed after it (AttentionMetadata.shared_prefix). The
benchmarks' baseline is `baseline_job`, TRL's layout: the prompt once per response.
Each round builds one tokens-only entry and times both jobs on it, alternating which
goes first; reported are the median seconds of each, their ratio, and the largest
relative difference between their LoRA gradients. DPO: N trained tokens (an N/2-token
prompt, both N/4-token responses given); GRPO: G samples of R tokens on a P-token prompt,
the whole group in one forward on both paths (the server bounds both by
`train.max_record_tokens`: the baseline's rows, or the pack's prompt and samples).
Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/packed_recompute.py [--rounds 3]
"""

import argparse
import json
import statistics
import time

from bench.traces import synthetic_tokens
from bench.training import Bench
from bench.training_grpo import serve_group, tokens_only
from server.config import load_config
from tests.test_training import relative_difference
from trainer.entries import EntryState


def _rounds(bench: Bench, make_entry, rounds: int) -> dict:
    seconds = {"recompute": [], "baseline": []}
    difference = 0.0
    for r in range(rounds):
        entry = make_entry(r)
        jobs = {"recompute": bench.method.recompute_job, "baseline": bench.method.baseline_job}
        grads = {}
        for path in (jobs if r % 2 == 0 else list(jobs)[::-1]):
            if hasattr(entry, "reference_logps"):
                entry.reference_logps = None  # each job computes the DPO reference itself, as the trainer's do
            started = time.perf_counter()
            _, grads[path], _ = bench.run_job(jobs[path](entry, bench.context), None)
            seconds[path].append(time.perf_counter() - started)
        difference = max(difference, relative_difference(grads["recompute"], grads["baseline"]))
    median = {path: statistics.median(s) for path, s in seconds.items()}
    return {"recompute_s": round(median["recompute"], 3), "baseline_s": round(median["baseline"], 3),
            "baseline_over_recompute": round(median["baseline"] / median["recompute"], 3),
            "rounds": {path: [round(x, 3) for x in s] for path, s in seconds.items()},
            "max_grad_rel_diff": difference}


def dpo(tokens: int, rounds: int) -> dict:
    bench = Bench(load_config(), "dpo", tokens)
    bench.given_responses = True

    def make_entry(r: int):
        chosen = synthetic_tokens(bench.tokenizer, tokens // 4 - 1, 99) + [bench.tokenizer.eos_token_id]
        entry, _ = bench.entry(synthetic_tokens(bench.tokenizer, tokens // 2, r), r, chosen, tokens // 4, None)
        copy = bench.tokens_only(entry)
        bench.trainer.cache.end(entry, EntryState.DROPPED)
        return copy

    return {"mode": "dpo", "tokens": tokens, **_rounds(bench, make_entry, rounds)}


def grpo(group: int, prompt_tokens: int, response_tokens: int, rounds: int) -> dict:
    bench = Bench(load_config(), "grpo", prompt_tokens + response_tokens)
    bench.method.recompute_tokens = None  # the whole group in one forward on both paths (the server bounds both)

    def make_entry(r: int):
        entry = serve_group(bench, synthetic_tokens(bench.tokenizer, prompt_tokens, r), group, response_tokens,
                            f"packed-{r}", None, seed=r)
        copy = tokens_only(bench, entry)
        bench.trainer.cache.end(entry, EntryState.DROPPED)
        return copy

    return {"mode": "grpo", "group": group, "prompt_tokens": prompt_tokens, "response_tokens": response_tokens,
            **_rounds(bench, make_entry, rounds)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json")
    args = parser.parse_args()
    results = [dpo(512, args.rounds), grpo(8, 128, 32, args.rounds), grpo(8, 512, 64, args.rounds)]
    for result in results:
        print(json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
