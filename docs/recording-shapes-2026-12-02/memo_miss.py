"""What a recorded prefill of a shape never recorded before costs, against one whose shape
the saved-bytes memo knows (engine/saved_bytes_memo.py: a known shape records without the
saved-tensor hooks; a new one is measured with them). On the CPU every prompt length is
its own shape, so under real traffic most recorded prefills are new shapes.

The embedded model, DPO (the server's defaults); each round r a length n_r = `--tokens` + r
that no recording had: a recorded prefill of n_r (a new shape: hooks), one of n_{r-1}
(recorded in the round before: known, no hooks), and plain prefills of both lengths, in
alternating order, the prefix cache off (the bench's prompts share text); each recording
dropped before the next request. Medians over the rounds after two warm-up rounds. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/recording-shapes-2026-12-02/memo_miss.py --rounds 12 \
        --json docs/recording-shapes-2026-12-02/memo_miss.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics

from bench.recording import embedded_training_engine, first_token_seconds
from bench.report import write_json
from bench.traces import synthetic_tokens
from server.config import AlchemistConfig
from trainer.entries import EntryState


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = AlchemistConfig()
    config = dataclasses.replace(config, cache=dataclasses.replace(config.cache, enable_prefix_caching=False))
    engine, trainer, tokenizer = embedded_training_engine(config)
    memo = engine.runner.saved_bytes_memo
    assert memo is not None, "the server's recordings use the memo on this path"
    lookups, lookup = [], memo.lookup

    def observed_lookup(shape):  # the memo's answers, in order
        known = lookup(shape)
        lookups.append(known is not None)
        return known

    memo.lookup = observed_lookup

    def prefill(kind: str, length: int, r: int) -> float:
        request_id = f"{kind}-{r}-{length}"
        seconds, _ = first_token_seconds(engine, request_id, synthetic_tokens(tokenizer, length, r),
                                         kind != "plain")
        if kind != "plain":
            assert lookups.pop() == (kind == "known"), f"the memo's answer for a {kind} shape"
            trainer.cache.end(trainer.cache.get(request_id), EntryState.DROPPED)
        return seconds

    rows = []
    for r in range(args.rounds + 3):
        new, known = args.tokens + r, args.tokens + r - 1
        if r == 0:
            prefill("new", new, r)
            continue
        steps = [("new", new), ("known", known), ("plain", new), ("plain", known)]
        row = {}
        for kind, length in (steps if r % 2 else steps[::-1]):
            row[f"{kind}_{'n' if length == new else 'n_minus_1'}_s"] = prefill(kind, length, r)
        row["new_over_plain"] = row["new_n_s"] / row["plain_n_s"]
        row["known_over_plain"] = row["known_n_minus_1_s"] / row["plain_n_minus_1_s"]
        row["new_over_known"] = row["new_n_s"] / row["known_n_minus_1_s"]
        print(f"round {r}: " + ", ".join(f"{k} {v:.3f}" for k, v in row.items()), flush=True)
        if r > 2:
            rows.append(row)
    summary = {"tokens": args.tokens, "rounds": len(rows),
               "medians": {key: round(statistics.median(row[key] for row in rows), 4) for key in rows[0]}}
    print(json.dumps(summary, indent=2))
    write_json({"summary": summary, "rounds": rows}, args.json)


if __name__ == "__main__":
    main()
