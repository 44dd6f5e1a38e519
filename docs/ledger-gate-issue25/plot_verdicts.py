"""Plots the eval gate's verdicts of a run of examples/gate_a_poisoned_batch.py from the
server's log lines (`eval gate: version N promoted, {...}` / `eval gate rejected version N: ...`):
each version's probe scores and KL, promoted or rejected.

    .venv/bin/python docs/ledger-gate-issue25/plot_verdicts.py SERVER.log OUT.png
"""

from __future__ import annotations

import ast
import re
import sys

from bench.report import pyplot

PROMOTED = re.compile(r"eval gate: version (\d+) (?:promoted, |scores )(\{.*\})")
REJECTED = re.compile(r"eval gate rejected version (\d+): (.*?); serving stays")
FELL = re.compile(r"(preference probes' mean margin|completion probes' mean log-prob) fell from ([-0-9.]+) to "
                  r"([-0-9.]+)")


def parse(lines: list[str]) -> tuple[dict[int, dict], dict[int, dict]]:
    promoted, rejected = {}, {}
    for line in lines:
        if (match := PROMOTED.search(line)) is not None:
            promoted[int(match.group(1))] = ast.literal_eval(match.group(2))
        elif (match := REJECTED.search(line)) is not None:
            scores = {}
            for kind, _, new in FELL.findall(match.group(2)):
                scores["preference_margin" if kind.startswith("preference") else "completion_logprob"] = float(new)
            rejected[int(match.group(1))] = scores
    return promoted, rejected


def main(log_path: str, out: str) -> None:
    promoted, rejected = parse(open(log_path).read().splitlines())
    plt = pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, label in zip(axes, ("preference_margin", "completion_logprob", "kl"),
                              ("preference probes: mean margin (nats)", "completion probes: mean log-prob (nats)",
                               "KL to the base model (nats / token)")):
        versions = sorted(v for v in promoted if promoted[v].get(key) is not None)
        ax.plot(versions, [promoted[v][key] for v in versions], "o-", color="tab:blue", label="promoted")
        failed = sorted(v for v in rejected if key in rejected[v])
        ax.plot(failed, [rejected[v][key] for v in failed], "x", color="tab:red", markersize=9,
                label="rejected (a failing score)")
        for v in sorted(rejected):
            ax.axvline(v, color="tab:red", alpha=0.15)
        ax.set_xlabel("adapter version")
        ax.set_ylabel(label)
        ax.legend(loc="best")
    axes[0].set_title("Eval gate: poisoned labels, then benign ones")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


if __name__ == "__main__":
    main(*sys.argv[1:3])
