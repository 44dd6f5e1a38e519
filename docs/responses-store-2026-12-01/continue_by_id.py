"""A multi-turn conversation over the Responses API, continued two ways on one server, turn
by turn in alternation: by `previous_response_id` (the request carries the new question
alone; the server rebuilds the conversation from its store) and by resending it (the
request carries every earlier item, as the SDK's `input += response.output` loop does).

Each way has its own `cache_salt`, so that neither reads the prefix cache the other wrote.
Per turn: the request body's bytes, the time to the first streamed token, the prompt's
tokens and those the prefix cache held, and whether both ways answered the same. The
embedded model, training off (`--train-mode dpo`: every answer recorded, as `make serve`
serves). Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/responses-store-2026-12-01/continue_by_id.py \
        --json docs/responses-store-2026-12-01/continue_by_id.json --plot docs/bench-responses-continue-by-id.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import httpx

from bench.launch import running_server
from bench.report import pyplot, save_figure
from bench.traces import PASSAGE

MODEL = "SmolLM2-135M-Instruct"
INSTRUCTIONS = "You are a patient tutor. Answer in two or three sentences, quoting the passage where it helps."
QUESTIONS = ["What is the passage about?", "Who is it written for?", "Give one detail it mentions.",
             "Summarise it in one sentence.", "What would you ask its author?", "Is anything in it surprising?"]


def respond(client: httpx.Client, body: dict) -> tuple[dict, float, int]:
    """The finished response, the seconds to its first text, and the request's bytes."""
    content = json.dumps({**body, "stream": True}).encode()
    started, first, response = time.perf_counter(), None, None
    with client.stream("POST", "/v1/responses", content=content, headers={"content-type": "application/json"},
                       timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                first = first or time.perf_counter()
            elif event["type"] in ("response.completed", "response.incomplete"):
                response = event["response"]
    return response, (first or time.perf_counter()) - started, len(content)


def plot(turns: list[dict], path: str) -> None:
    plt = pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    numbers = sorted({r["turn"] for r in turns})
    for key, label in (("by_id", "previous_response_id"), ("resent", "conversation resent")):
        left.plot([n + 1 for n in numbers], [statistics.median(r[key]["request_bytes"] for r in turns
                                                               if r["turn"] == n) for n in numbers],
                  marker="o", label=label)
        right.plot([n + 1 for n in numbers], [statistics.median(r[key]["ttft_ms"] for r in turns if r["turn"] == n)
                                              for n in numbers], marker="o", label=label)
    left.set_ylim(bottom=0)
    right.set_ylim(bottom=0)
    left.set_xlabel("turn")
    left.set_ylabel("request body, bytes (median)")
    left.set_title("What the client sends")
    fig.suptitle("Continuing a response by previous_response_id or resending it (embedded model, CPU)")
    save_figure(fig, right, "turn", "time to first token, ms (median)", "Time to first token", path)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json")
    parser.add_argument("--plot")
    parser.add_argument("--replot", metavar="JSON", help="only draw --plot from an earlier run's --json")
    parser.add_argument("--train-mode", default="off", help="the server's (dpo: every answer recorded for training)")
    args = parser.parse_args()
    if args.replot:
        with open(args.replot) as f:
            plot(json.load(f)["turns"], args.plot)
        return
    with running_server("--train-mode", args.train_mode, "--log-level", "WARNING") as url, \
            httpx.Client(base_url=url) as client:
        respond(client, {"model": MODEL, "input": "Hello", "max_output_tokens": 4})  # warm-up
        turns = []
        for c in range(args.conversations):
            passage = {"role": "user", "content": f"(session {c}) Passage:\n" + PASSAGE * 2}
            state = {"by_id": None, "resent": [passage]}
            for t, question in enumerate(QUESTIONS):
                row = {"conversation": c, "turn": t}
                for key in (("by_id", "resent") if t % 2 == 0 else ("resent", "by_id")):
                    body = {"model": MODEL, "instructions": INSTRUCTIONS, "temperature": 0,
                            "max_output_tokens": args.max_tokens, "cache_salt": key}
                    if key == "by_id":
                        asked = [passage, {"role": "user", "content": question}] if state["by_id"] is None else \
                            question
                        body.update(input=asked, previous_response_id=state["by_id"])
                    else:
                        body["input"] = state["resent"] + [{"role": "user", "content": question}]
                    response, ttft, sent = respond(client, body)
                    if key == "by_id":
                        state["by_id"] = response["id"]
                    else:
                        state["resent"] = body["input"] + response["output"]
                    usage = response["usage"]
                    row[key] = {"request_bytes": sent, "ttft_ms": round(ttft * 1e3, 1),
                                "input_tokens": usage["input_tokens"],
                                "cached_tokens": usage["input_tokens_details"]["cached_tokens"],
                                "text": "".join(part["text"] for item in response["output"]
                                                if item["type"] == "message" for part in item["content"])}
                row["same_answer"] = row["by_id"]["text"] == row["resent"]["text"]
                row["same_prompt"] = row["by_id"]["input_tokens"] == row["resent"]["input_tokens"]
                turns.append(row)
                print(f"conversation {c} turn {t}: bytes {row['by_id']['request_bytes']} by id, "
                      f"{row['resent']['request_bytes']} resent; first token {row['by_id']['ttft_ms']} / "
                      f"{row['resent']['ttft_ms']} ms; {row['by_id']['input_tokens']} prompt tokens "
                      f"({row['by_id']['cached_tokens']} / {row['resent']['cached_tokens']} cached); "
                      f"same answer {row['same_answer']}", flush=True)
    later = [r for r in turns if r["turn"] > 0]
    summary = {
        "turns": len(turns),
        "median_request_bytes_last_turn": {key: statistics.median(r[key]["request_bytes"] for r in turns
                                                                  if r["turn"] == len(QUESTIONS) - 1)
                                           for key in ("by_id", "resent")},
        "median_ttft_ms_after_the_first_turn": {key: statistics.median(r[key]["ttft_ms"] for r in later)
                                                for key in ("by_id", "resent")},
        "cached_share_after_the_first_turn": {
            key: round(sum(r[key]["cached_tokens"] for r in later) / sum(r[key]["input_tokens"] for r in later), 3)
            for key in ("by_id", "resent")},
        "same_answers": all(r["same_answer"] for r in turns),
        "same_prompts": all(r["same_prompt"] for r in turns),
    }
    summary["ttft_by_id_over_resent"] = round(summary["median_ttft_ms_after_the_first_turn"]["by_id"]
                                              / summary["median_ttft_ms_after_the_first_turn"]["resent"], 3)
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "turns": turns}, f, indent=1)
    if args.plot:
        plot(turns, args.plot)


if __name__ == "__main__":
    main()
