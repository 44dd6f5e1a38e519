"""What a recording after a cached beginning holds, by storage, and what its turn and its
job take: a conversation's next turn on a DPO training server (the embedded model,
prefix cache on): a beginning of `--cached` tokens the prefix cache holds, `--new` tokens
of the new turn, a `--response`-token answer and a given chosen response.

Each round, a fresh beginning: the recorded turn (its first token's step, every storage
it holds counted: what autograd saved, the layers' K/V and inputs beside, and every
autograd leaf the graph keeps that is not a parameter), then the label's reuse job (its
seconds, its gradients against the recompute job's in the first round). Medians over the
rounds after a warm-up round. Run from the repository root in this tree, and in a
worktree of an older one (this script and tests/test_recorded_after_cached_prefix.py,
whose `graph_leaves` it uses, copied into it), alternately:

    PYTHONPATH=.:docs/recorded-prefix-2026-12-01 .venv/bin/python docs/recorded-prefix-kv-once-2026-12-02/held_bytes.py --rounds 3 \
        --json docs/recorded-prefix-kv-once-2026-12-02/held_bytes-1.json
"""

from __future__ import annotations

import json
import time

from bench.report import rel_diff, rounds_after_warm_up, write_json
from bench.traces import synthetic_tokens
from engine.recording import SavedTensorTracker
from trainer.entries import EntryState

from job_costs import make_bench, turn_arguments  # docs/recorded-prefix-2026-12-01
from tests.test_recorded_after_cached_prefix import graph_leaves


def held_storages(recording, tracker: SavedTensorTracker, parameters: set[int]) -> dict[int, int]:
    """storage address -> bytes, of everything the recording holds on the device."""
    held = {key: entry[1] for key, entry in tracker._storages.items()}  # white-box: what autograd saved
    segment_tensors = [t for s in recording.segments for t in (s.leaf, s.out, s.key, s.value)]
    kept = segment_tensors + [recording.head_leaf, recording.logits]
    kept += [leaf for leaf in graph_leaves(segment_tensors) if leaf.untyped_storage().data_ptr() not in parameters]
    for tensor in kept:
        storage = tensor.untyped_storage()
        held.setdefault(storage.data_ptr(), storage.nbytes())
    return held


def one_round(bench, r: int, args, checks: dict) -> dict:
    tokenizer = bench.tokenizer
    beginning = synthetic_tokens(tokenizer, args.cached, r)
    turn = synthetic_tokens(tokenizer, args.new, r + 300)
    chosen = synthetic_tokens(tokenizer, args.response - 1, r + 50) + [tokenizer.eos_token_id]
    bench.serve(beginning, False, f"beginning-{r}-{time.monotonic_ns()}")
    tracker = SavedTensorTracker()
    entry, recorded_s = bench.entry(beginning + turn, r, chosen, args.response, tracker)
    recording = entry.recording
    assert recording.prefix_len == len(beginning) // bench.engine.config.cache.block_size \
        * bench.engine.config.cache.block_size
    parameters = {p.untyped_storage().data_ptr() for p in bench.trainer.peft_model.parameters()}
    held = sum(held_storages(recording, tracker, parameters).values())
    per_token_kv = sum(t[:, :, :1].nbytes for s in recording.segments for t in (s.key, s.value))
    row = {"cached_tokens": recording.prefix_len, "recorded_tokens": recording.head_leaf.shape[1],
           "recorded_prefill_s": recorded_s, "held_mib": held / 2 ** 20,
           "counted_mib": recording.saved_bytes / 2 ** 20,
           "beginning_kv_once_mib": per_token_kv * recording.prefix_len / 2 ** 20}
    tokens_only = bench.tokens_only(entry) if r == 1 else None
    row["reuse_job_s"], reuse_grads, _ = bench.run_job(bench.method.reuse_job(entry, bench.context), None)
    bench.trainer.cache.end(entry, EntryState.TRAINED)
    if tokens_only is not None:
        _, recompute_grads, _ = bench.run_job(bench.method.recompute_job(tokens_only, bench.context), None)
        checks["grad_rel_diff_to_recompute"] = rel_diff(reuse_grads, recompute_grads)
    return row


def main() -> None:
    args = turn_arguments().parse_args()
    bench = make_bench(True, args.cached + args.new + args.response + 64)
    checks = {}
    rows, median = rounds_after_warm_up(lambda r: one_round(bench, r, args, checks), args.rounds)
    summary = {"shape": {"cached": args.cached, "new": args.new, "response": args.response},
               "rounds": args.rounds, "medians": median,
               "held_over_beginning_kv_once": round(median["held_mib"] / median["beginning_kv_once_mib"], 3),
               **checks}
    print(json.dumps(summary, indent=2))
    write_json({"summary": summary, "rounds": rows}, args.json)


if __name__ == "__main__":
    main()
