"""Page faults of each recorded serving step under `bench colocate`'s trace (Poisson, 0.25
requests per second, DPO feedback on every answer), beside the server's trims, warm heap,
activation cache (`/metrics`) and resident memory (`/proc/PID/statm`), read five times a
second: which recorded prefills land on fresh pages, and what happened before them. Against
a running training server on this machine; run from the repository root:

    .venv/bin/alchemist serve --train-mode dpo --port 8031 &
    PYTHONPATH=. .venv/bin/python docs/training-issue24/trace_page_faults.py --url http://127.0.0.1:8031 \
        --pid $(pgrep -f "port 8031") [--seconds 120]
"""

import argparse
import asyncio
import time

import httpx

from bench.colocate import run_trace
from bench.report import read_metric
from bench.traces import make_trace

RECORDED_KINDS = ("recorded_prefill", "recorded_mixed")


def resident_mib(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as statm:
        return int(statm.read().split()[1]) * 4096 / 2**20


def snapshot(text: str, pid: int) -> dict[str, float]:
    faults = {kind: read_metric(text, f'alchemist:serving_step_page_faults_total{{kind="{kind}"}}') for kind in
              RECORDED_KINDS}
    return {**faults, "trims": read_metric(text, "alchemist:memory_trims_total"),
            "warm_mib": read_metric(text, "alchemist:warm_heap_bytes") / 2**20,
            "cache_mib": read_metric(text, "alchemist:activation_cache_bytes") / 2**20,
            "rss_mib": resident_mib(pid)}


async def watch(url: str, pid: int, stop: asyncio.Event, started: float) -> None:
    before = None
    async with httpx.AsyncClient(base_url=url) as client:
        while not stop.is_set():
            now = snapshot((await client.get("/metrics")).text, pid)
            if before is not None:
                stepped = {kind: now[kind] - before[kind] for kind in RECORDED_KINDS if now[kind] != before[kind]}
                if stepped or now["trims"] != before["trims"]:
                    print(f"{time.perf_counter() - started:6.1f} s  faults {stepped}  trims {now['trims']:.0f}  "
                          f"warm heap {now['warm_mib']:.0f} MiB  cache {now['cache_mib']:.0f} MiB  "
                          f"RSS {now['rss_mib']:.0f} MiB", flush=True)
            before = now
            await asyncio.sleep(0.2)


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--pid", type=int, required=True, help="the server's process")
    parser.add_argument("--seconds", type=float, default=120.0)
    args = parser.parse_args()
    await run_trace(args.url, make_trace(0.25, 15.0, 99), True, 99)  # a warm-up trace first, as the bench's
    stop, started = asyncio.Event(), time.perf_counter()
    watching = asyncio.create_task(watch(args.url, args.pid, stop, started))
    await run_trace(args.url, make_trace(0.25, args.seconds, 0), True, 0)
    await asyncio.sleep(15.0)  # the jobs after the trace
    stop.set()
    await watching


if __name__ == "__main__":
    asyncio.run(main())
