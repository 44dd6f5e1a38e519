"""A conversation with a long system prompt on a DPO server under a tight device budget,
over HTTP: what training its turns holds, with the cached beginning's layers that do not
fit the budget run again in backward (this tree) or every layer's graph kept (the tree
before: run this script from a worktree of it).

One server on the embedded model, `--train-mode dpo --config configs/offload-tight.toml`
(a 256 MiB budget for recorded activations and a serving step). One conversation with the
OpenAI SDK: a system prompt of `--passages` copies of the bench passage, `--turns` turns,
each resending the conversation so far (its turns after the first read the beginning from
the prefix cache and record only the rest), no labels yet. Then each answer is labelled
(`POST /v1/feedback`, the served answer rejected for a marked copy) and the script waits
until every label has trained, sampling the server's resident memory (`VmRSS`) every
20 ms from the first label on. It reports the training's high water above the memory
before the labels, the seconds to train them all, and the server's own counts (entries
by path, beginning layers run again, steps over budget). From the repository root:

    PYTHONPATH=. .venv/bin/python docs/beginning-layer-by-layer-2026-12-02/over_http.py \
        --json docs/beginning-layer-by-layer-2026-12-02/over_http.json
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import httpx
import openai

from bench.launch import server_process
from bench.report import read_metric, write_json
from bench.traces import PASSAGE

QUESTIONS = ["What is the passage about?", "Who is it written for?", "Give one detail it mentions.",
             "Summarise it in one sentence.", "What would you ask its author?", "Is anything in it surprising?"]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


class HighWater(threading.Thread):
    """The most a process's resident memory reached while it ran."""

    def __init__(self, pid: int):
        super().__init__(daemon=True)
        self.pid, self.peak, self.stopped = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stopped.wait(0.02):
            self.peak = max(self.peak, rss_bytes(self.pid))


def metrics(url: str) -> dict:
    text = httpx.get(f"{url}/metrics", timeout=30).text
    paths = {path: read_metric(text, f'alchemist:trained_entries_total{{path="{path}"}}')
             for path in ("reuse", "stashed", "recompute")}
    return {"trained_entries": paths, "trained": sum(paths.values()),
            "rerun_training_layers": read_metric(text, "alchemist:rerun_training_layers_total"),
            "recorded_tokens": read_metric(text, 'alchemist:recorded_prefill_tokens_total{source="recorded"}'),
            "cached_tokens": read_metric(text, 'alchemist:recorded_prefill_tokens_total{source="prefix_cache"}'),
            "over_budget_steps": read_metric(text, "alchemist:over_budget_steps_total"),
            "not_recorded": read_metric(text, "alchemist:unrecorded_prefills_total")}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--passages", type=int, default=8, help="copies of the bench passage in the system prompt")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--json")
    args = parser.parse_args()
    system = "You are a patient tutor. Answer in two sentences.\n\nPassage:\n" + PASSAGE * args.passages
    flags = ("--train-mode", "dpo", "--config", "configs/offload-tight.toml", "--log-level", "WARNING")
    with server_process(*flags) as (url, proc):
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="-")
        messages, answers, turns = [{"role": "system", "content": system}], [], []
        for question in (QUESTIONS * args.turns)[:args.turns]:
            messages.append({"role": "user", "content": question})
            reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                                   max_tokens=args.max_tokens, temperature=0)
            text = reply.choices[0].message.content
            messages.append({"role": "assistant", "content": text})
            answers.append((reply.id, text))
            details = reply.usage.prompt_tokens_details
            turns.append({"prompt_tokens": reply.usage.prompt_tokens,
                          "cached_tokens": details.cached_tokens if details else 0})
        before = metrics(url)
        baseline = rss_bytes(proc.pid)
        watch = HighWater(proc.pid)
        watch.start()
        started = time.monotonic()
        for completion_id, text in answers:
            response = httpx.post(f"{url}/v1/feedback", json={"id": completion_id, "chosen": f"Certainly! {text}"},
                                  timeout=60)
            response.raise_for_status()
        while metrics(url)["trained"] < before["trained"] + len(answers):
            if time.monotonic() - started > 900:
                raise RuntimeError("the labels did not train within 900 s")
            time.sleep(0.5)
        seconds = time.monotonic() - started
        watch.stopped.set()
        watch.join()
        after = metrics(url)
    summary = {"turns": turns, "rss_before_labels_mib": round(baseline / 2 ** 20),
               "training_high_water_above_mib": round((watch.peak - baseline) / 2 ** 20),
               "seconds_to_train_all": round(seconds, 1), "server": after}
    print(json.dumps(summary, indent=2))
    write_json(summary, args.json)


if __name__ == "__main__":
    main()
