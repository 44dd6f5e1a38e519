"""Multi-turn chats over HTTP on training servers: recordings that read the prompt's cached
beginning (the default now) against recordings of the whole prompt (the tree before,
`ALCHEMIST_TRAIN_RECORD_AFTER_CACHED_PREFIX=false`), beside a server with training off.

Three servers on the embedded model: two `--train-mode dpo` (`make serve`'s mode: every
answer recorded, waiting for a label), one `--train-mode off`; the same conversations on
each, turn by turn in rotating order, each turn resending the whole conversation as an
OpenAI SDK client does (docs/prefix-cache-2026-12-01/multi_turn.py's turns). No labels
are sent: no training runs to share the cores with the turns. Per turn: prompt tokens,
those the prefix cache held (`usage.prompt_tokens_details`), the time to the first
streamed token; at the end, each training server's recorded prefills and the bytes their
recordings hold (`/metrics`). Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/recorded-prefix-2026-12-01/multi_turn_training.py \
        --json docs/recorded-prefix-2026-12-01/multi_turn_training.json \
        --plot docs/bench-recorded-after-cached-prefix.png
"""

from __future__ import annotations

import os
import statistics
import sys

import httpx
import openai

from bench.launch import running_server
from bench.report import read_metric

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "prefix-cache-2026-12-01"))
from multi_turn import QUESTIONS, SYSTEM, arguments, report, turn  # noqa: E402

SERVERS = {"reads_cache": "training on, recordings after the cached beginning",
           "whole_prompt": "training on, recordings of the whole prompt (before)",
           "off": "training off"}


def recordings(url: str) -> dict:
    """What a training server recorded: its prefills, their tokens by source, the bytes held."""
    text, tokens = httpx.get(f"{url}/metrics", timeout=10).text, "alchemist:recorded_prefill_tokens_total"
    return {"recorded_prefills": read_metric(text, "alchemist:recorded_prefills_total"),
            "recorded_tokens": read_metric(text, tokens + '{source="recorded"}'),
            "cached_tokens": read_metric(text, tokens + '{source="prefix_cache"}'),
            "activation_cache_bytes": read_metric(text, "alchemist:activation_cache_bytes")}


def main() -> None:
    args = arguments()
    quiet = ("--log-level", "WARNING")
    whole = {"ALCHEMIST_TRAIN_RECORD_AFTER_CACHED_PREFIX": "false"}
    with running_server("--train-mode", "dpo", *quiet) as reads_url, \
            running_server("--train-mode", "dpo", *quiet, env=whole) as whole_url, \
            running_server("--train-mode", "off", *quiet) as off_url:
        urls = {"reads_cache": reads_url, "whole_prompt": whole_url, "off": off_url}
        clients = {key: openai.OpenAI(base_url=f"{url}/v1", api_key="-") for key, url in urls.items()}
        for client in clients.values():  # warm-up
            turn(client, [{"role": "user", "content": "Hello"}], 4)
        keys, turns = list(SERVERS), []
        for c in range(args.conversations):
            conversations = {key: [{"role": "system", "content": SYSTEM + f"\n(session {c})"}] for key in keys}
            for t, question in enumerate(QUESTIONS):
                row = {"conversation": c, "turn": t}
                shift = (c * len(QUESTIONS) + t) % len(keys)
                for key in keys[shift:] + keys[:shift]:
                    messages = conversations[key] + [{"role": "user", "content": question}]
                    text, ttft, usage = turn(clients[key], messages, args.max_tokens)
                    conversations[key] = messages + [{"role": "assistant", "content": text}]
                    row[key] = {"ttft_ms": round(ttft * 1e3, 1), "prompt_tokens": usage["prompt_tokens"],
                                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text}
                row["same_answers"] = len({row[key]["text"] for key in keys}) == 1
                turns.append(row)
                firsts = [f"{key} {row[key]['ttft_ms']} ms ({row[key]['cached_tokens']} cached)" for key in keys]
                print(f"conversation {c} turn {t}: {row['off']['prompt_tokens']} prompt tokens; first token "
                      f"{', '.join(firsts)}; same answers: {row['same_answers']}", flush=True)
        recorded = {key: recordings(urls[key]) for key in ("reads_cache", "whole_prompt")}
    later = [r for r in turns if r["turn"] > 0]
    median_ttft = {key: statistics.median(r[key]["ttft_ms"] for r in later) for key in keys}
    summary = {
        "turns": len(turns),
        "median_ttft_ms_after_the_first_turn": median_ttft,
        "ttft_whole_prompt_over_reads_cache": round(median_ttft["whole_prompt"] / median_ttft["reads_cache"], 2),
        "ttft_reads_cache_over_off": round(median_ttft["reads_cache"] / median_ttft["off"], 3),
        "cached_share_of_prompt_tokens_after_the_first_turn": {
            key: round(sum(r[key]["cached_tokens"] for r in later) / sum(r[key]["prompt_tokens"] for r in later), 3)
            for key in keys},
        "same_answers": all(r["same_answers"] for r in turns),
        "recordings": recorded,
    }
    report(summary, turns, args, series=SERVERS.items(),
           title="Multi-turn chat on a training server (DPO), embedded model, CPU")

if __name__ == "__main__":
    main()
