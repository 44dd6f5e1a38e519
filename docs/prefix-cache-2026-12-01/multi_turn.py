"""Multi-turn chats over HTTP, served with the prefix cache and without it, turn by turn in
alternation: each turn resends the whole conversation (a system prompt, the turns so far,
the answers as the server gave them), as an OpenAI SDK client does.

Two servers on the embedded model (`--train-mode off`), the same conversations on both;
per turn: the prompt's tokens, those the cache held (`usage.prompt_tokens_details`), and
the time to the first streamed token. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/prefix-cache-2026-12-01/multi_turn.py \
        --json docs/prefix-cache-2026-12-01/multi_turn.json --plot docs/bench-prefix-cache-multi-turn.png
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import openai

from bench.launch import running_server
from bench.report import pyplot, save_figure
from bench.traces import PASSAGE

SYSTEM = ("You are a patient tutor. Read the passage the student studies, then answer each of their questions in "
          "two or three sentences, quoting the passage where it helps.\n\nPassage:\n" + PASSAGE * 2)
QUESTIONS = ["What is the passage about?", "Who is it written for?", "Give one detail it mentions.",
             "Summarise it in one sentence.", "What would you ask its author?", "Is anything in it surprising?"]


def turn(client: openai.OpenAI, messages: list[dict], max_tokens: int) -> tuple[str, float, dict]:
    started, first, text, usage = time.perf_counter(), None, "", None
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, stream=True,
                                            max_tokens=max_tokens, temperature=0,
                                            stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            text += chunk.choices[0].delta.content
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
    return text, (first or time.perf_counter()) - started, usage


def plot(turns: list[dict], path: str, series=(("cached", "prefix cache on"), ("plain", "prefix cache off")),
         title: str = "Multi-turn chat over HTTP, embedded model, CPU") -> None:
    """Median time to first token per turn, of each (key, label) in `series`."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    numbers = sorted({r["turn"] for r in turns})
    for key, label in series:
        ax.plot([n + 1 for n in numbers], [statistics.median(r[key]["ttft_ms"] for r in turns if r["turn"] == n)
                                           for n in numbers], marker="o", label=label)
    ax.set_ylim(bottom=0)
    save_figure(fig, ax, "turn of the conversation", "time to first token, ms (median)", title, path)


def arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--json")
    parser.add_argument("--plot", help="a PNG of the time to first token per turn")
    return parser.parse_args()


def report(summary: dict, turns: list[dict], args: argparse.Namespace, **plot_options) -> None:
    """Prints the summary; writes it with every turn to `--json`, and the plot to `--plot`."""
    print(json.dumps(summary, indent=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"summary": summary, "turns": turns}, f, indent=1)
    if args.plot:
        plot(turns, args.plot, **plot_options)


def main() -> None:
    args = arguments()
    flags = ("--train-mode", "off", "--log-level", "WARNING")
    with running_server(*flags) as cached_url, running_server(*flags, "--no-enable-prefix-caching") as plain_url:
        clients = {"cached": openai.OpenAI(base_url=f"{cached_url}/v1", api_key="-"),
                   "plain": openai.OpenAI(base_url=f"{plain_url}/v1", api_key="-")}
        for client in clients.values():  # warm-up
            turn(client, [{"role": "user", "content": "Hello"}], 4)
        turns = []
        for c in range(args.conversations):
            conversations = {key: [{"role": "system", "content": SYSTEM + f"\n(session {c})"}] for key in clients}
            for t, question in enumerate(QUESTIONS):
                row = {"conversation": c, "turn": t}
                for key in (("cached", "plain") if t % 2 == 0 else ("plain", "cached")):
                    messages = conversations[key] + [{"role": "user", "content": question}]
                    text, ttft, usage = turn(clients[key], messages, args.max_tokens)
                    conversations[key] = messages + [{"role": "assistant", "content": text}]
                    row[key] = {"ttft_ms": round(ttft * 1e3, 1), "prompt_tokens": usage["prompt_tokens"],
                                "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"], "text": text}
                row["same_answer"] = row["cached"]["text"] == row["plain"]["text"]
                turns.append(row)
                print(f"conversation {c} turn {t}: {row['cached']['prompt_tokens']} prompt tokens, "
                      f"{row['cached']['cached_tokens']} cached; first token {row['cached']['ttft_ms']} ms cached, "
                      f"{row['plain']['ttft_ms']} ms plain; same answer: {row['same_answer']}", flush=True)
    later = [r for r in turns if r["turn"] > 0]
    summary = {
        "turns": len(turns),
        "cached_share_of_prompt_tokens_after_the_first_turn": round(
            sum(r["cached"]["cached_tokens"] for r in later) / sum(r["cached"]["prompt_tokens"] for r in later), 3),
        "median_ttft_ms_after_the_first_turn": {
            key: statistics.median(r[key]["ttft_ms"] for r in later) for key in ("cached", "plain")},
        "median_ttft_ms_first_turn": {
            key: statistics.median(r[key]["ttft_ms"] for r in turns if r["turn"] == 0) for key in ("cached", "plain")},
        "same_answers": all(r["same_answer"] for r in turns),
    }
    summary["ttft_plain_over_cached_after_the_first_turn"] = round(
        summary["median_ttft_ms_after_the_first_turn"]["plain"]
        / summary["median_ttft_ms_after_the_first_turn"]["cached"], 2)
    report(summary, turns, args)


if __name__ == "__main__":
    main()
