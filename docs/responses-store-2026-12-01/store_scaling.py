"""What one write and one conversation read cost the response store (server/response_store.py)
as a conversation grows, on disk: a chain of `--turns` responses of about 2 KB each, each
continuing the one before, beside as many unchained ones. Per decile of the chain, the
median seconds of a chained `put` (which marks every earlier turn used), of an unchained
`put`, and of `chain` (every turn's text read back), as ratios to the first decile's. Run
from the repository root:

    PYTHONPATH=. .venv/bin/python docs/responses-store-2026-12-01/store_scaling.py \
        --json docs/responses-store-2026-12-01/store_scaling.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from server.response_store import RESPONSES_FILE, ResponseStore, StoredResponse


def turn(name: str, previous: str | None) -> StoredResponse:
    text = "word " * 400  # about 2 KB
    return StoredResponse({"id": name, "output": [{"type": "message", "content": [{"text": text}]}]},
                          [{"id": f"msg_{name}", "content": [{"text": "question"}]}], previous)


def timed(work) -> float:
    started = time.perf_counter()
    work()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--turns", type=int, default=2000)
    parser.add_argument("--json")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        store = ResponseStore(Path(directory) / RESPONSES_FILE)
        rows, previous = [], None
        for i in range(args.turns):
            name = f"resp_{i}"
            chained = timed(lambda: store.put(turn(name, previous)))
            alone = timed(lambda: store.put(turn(f"resp_alone_{i}", None)))
            read = timed(lambda: store.chain(name))
            rows.append((chained, alone, read))
            previous = name
        store.close()
    decile = args.turns // 10
    medians = [[statistics.median(r[k] for r in rows[d * decile:(d + 1) * decile]) for k in range(3)]
               for d in range(10)]
    summary = {"turns": args.turns,
               "median_ms_first_decile": {"chained_put": round(medians[0][0] * 1e3, 3),
                                          "unchained_put": round(medians[0][1] * 1e3, 3),
                                          "chain_read": round(medians[0][2] * 1e3, 3)},
               "median_ms_last_decile": {"chained_put": round(medians[-1][0] * 1e3, 3),
                                         "unchained_put": round(medians[-1][1] * 1e3, 3),
                                         "chain_read": round(medians[-1][2] * 1e3, 3)}}
    summary["last_over_first_decile"] = {key: round(summary["median_ms_last_decile"][key]
                                                    / summary["median_ms_first_decile"][key], 2)
                                         for key in summary["median_ms_first_decile"]}
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
