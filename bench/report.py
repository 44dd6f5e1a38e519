"""What the benchmarks report with: percentiles, gradient differences, Prometheus
scrapes, JSON files and plots (matplotlib is the `bench` extra, imported only here)."""

from __future__ import annotations

import contextlib
import json
import math
import platform
import statistics
import time
from typing import Callable

import torch

from engine.scheduler import STEP_KINDS


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return math.nan
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def synchronized_clock() -> float:
    """time.perf_counter() once the GPU (if any) has finished what was queued: CUDA kernels
    run asynchronously, so an unsynchronized clock times only their launch."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter()


def write_profile(path: str, runs: dict) -> None:
    """Runs each of `runs` (title -> callable) once under torch.profiler and writes its
    operators by host time and by device time, as text: where the time goes (kernels,
    launches, host syncs)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with open(path, "w") as f:
        for title, run in runs.items():
            with profile(activities=activities) as prof:
                run()
                synchronized_clock()
            table = prof.key_averages()
            f.write(f"== {title}: by host time (self)\n{table.table(sort_by='self_cpu_time_total', row_limit=30)}\n")
            if torch.cuda.is_available():
                f.write(f"== {title}: by device time (self)\n"
                        f"{table.table(sort_by='self_device_time_total', row_limit=30)}\n")
    print(f"profile written to {path}", flush=True)


def rel_diff(a: dict, b: dict) -> float:
    """The largest relative difference between two dicts of gradient tensors."""
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp_min(1e-30)).item() for k in b)


def read_metric(text: str, name: str) -> float:
    """A sample's value from a Prometheus text scrape (0 when absent): `name` may name
    labels (`x_total{state="dropped"}`), and the samples that have them are summed over
    the labels it leaves out — over every replica's `engine`, among others."""
    from prometheus_client.parser import text_string_to_metric_families

    sample_name, _, wanted = name.partition("{")
    labels = dict(part.split("=", 1) for part in wanted.rstrip("}").split(",") if part) if wanted else {}
    labels = {k: v.strip('"') for k, v in labels.items()}
    return sum(sample.value for family in text_string_to_metric_families(text) for sample in family.samples
               if sample.name == sample_name and labels.items() <= sample.labels.items())


TRAINING_PATHS = ("reuse", "stashed", "recompute")


def steps_by_kind(before: str, after: str) -> dict[str, dict[str, float]]:
    """The server's engine steps between two scrapes, by kind (server/metrics.py,
    `serving_step_seconds`): how many, their seconds in all and on average, and seconds per token."""
    steps = {}
    for kind in STEP_KINDS:
        def delta(name: str) -> float:
            return read_metric(after, f'{name}{{kind="{kind}"}}') - read_metric(before, f'{name}{{kind="{kind}"}}')

        count, seconds = delta("alchemist:serving_step_seconds_count"), delta("alchemist:serving_step_seconds_sum")
        tokens = delta("alchemist:serving_step_tokens_total")
        steps[kind] = {"steps": count, "seconds": seconds, "tokens": tokens,
                       "mean_s": seconds / count if count else math.nan,
                       "s_per_token": seconds / tokens if tokens else math.nan,
                       "page_faults_per_step": delta("alchemist:serving_step_page_faults_total") / count
                       if count else math.nan}
    return steps


def trained_by_path(text: str, mode: str, before: str = "") -> dict[str, float]:
    """Entries trained on each path (reuse, stashed reuse, recompute) from a scrape, less
    those of an earlier scrape `before`."""
    names = {path: f'alchemist:trained_entries_total{{mode="{mode}",path="{path}"}}' for path in TRAINING_PATHS}
    return {path: read_metric(text, name) - read_metric(before, name) for path, name in names.items()}


def reuse_share(paths: dict[str, float]) -> float:
    """The share of trained entries that trained on their served activations (NaN: none)."""
    total = sum(paths.values())
    return (paths["reuse"] + paths["stashed"]) / total if total else float("nan")


def rounds_after_warm_up(run_round: Callable[[int], dict], rounds: int) -> tuple[list[dict], dict]:
    """Runs `run_round(r)` for r = 0 .. rounds (round 0 warms up and is not kept), printing
    each round's figures; returns the kept rounds and each figure's median over them."""
    rows = []
    for r in range(rounds + 1):
        row = run_round(r)
        print(f"round {r}: " + ", ".join(f"{k} {v:.3g}" for k, v in row.items()), flush=True)
        if r:
            rows.append(row)
    return rows, {key: statistics.median(row[key] for row in rows) for key in rows[0]}


def write_json(report: dict, path: str | None) -> None:
    """`report` as JSON, a figure that is not a number (NaN: nothing measured) as null:
    strict JSON (JavaScript's JSON.parse, `json.loads` with strict constants) has no NaN."""
    if path:
        with open(path, "w") as f:
            json.dump(_without_nan({**report, "machine": report.get("machine") or machine_name()}), f, indent=2,
                      allow_nan=False)


def machine_name() -> str:
    """The accelerator the figures were measured on, else the CPU's model: what a figure names."""
    import subprocess

    try:
        gpus = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, timeout=10).stdout.split("\n")[0].strip()
    except (OSError, subprocess.SubprocessError):  # no NVIDIA driver here: the CPU it ran on
        gpus = ""
    if gpus:
        return gpus
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpus:
        for line in cpus:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _without_nan(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _without_nan(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_without_nan(item) for item in value]
    return value


def pyplot():
    """matplotlib's pyplot on the file-only backend."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("plots need matplotlib: pip install 'alchemist[bench]' (make installs it)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, ax, x_label: str, y_label: str, title: str, path: str) -> str:
    """Labels `ax`, writes `fig` to `path` (PNG) and closes it; returns the path."""
    ax.set_xlabel(x_label)
    ax.set_ylabel(y_label)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path
