"""`alchemist bench soak`: mixed traffic with feedback for a given time, then a drain.

Starts a server (DPO training on, adapters saved, an API key, a short label timeout) and
drives a seeded Poisson mix over real HTTP: chat with and without feedback, streams,
batched completions with n=2, clients that disconnect mid-stream, malformed bodies, wrong
keys, feedback for unknown ids, adapter status reads. Every response is checked against
what that kind of request must get (a malformed body must get 400, not 200 or 500); a
mismatch, a 5xx, a broken stream or a transport error is an error. 429 (over capacity)
is counted apart. Meanwhile the server's RSS and activation-cache bytes are sampled.
After the traffic the bench waits for the cache to drain (trained or expired), stops the
server with SIGTERM and checks that the final adapter version was saved.

Reports errors, RSS growth (median over a window after warm-up against the last window
of traffic; raw, and net of the live activation-cache bytes, which move with the traffic
by up to the cache budget), RSS before the traffic and after the drain, whether the
activation cache returned to zero bytes, and plots the timeline.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import shutil
import statistics
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from bench.report import pyplot, read_metric, reuse_share, trained_by_path, write_json
from bench.traces import WORDS, make_trace
from bench.launch import server_process
from trainer.adapter_store import AdapterStore

_KEY = "sk-soak"
# kind -> weight in the mix
MIX = {"chat_feedback": 5, "chat_no_feedback": 2, "stream": 3, "completions_batch": 2, "disconnect": 1,
       "bad_body": 1, "bad_key": 1, "unknown_feedback": 1, "adapters": 1}


@dataclass(frozen=True)
class SoakConfig:
    seconds: float = 600.0
    rate: float = 0.5
    seed: int = 0
    max_tokens: int = 48
    # entries whose feedback never comes expire after this, so the cache can drain
    label_timeout_s: float = 20.0
    drain_timeout_s: float = 240.0
    sample_every_s: float = 5.0
    # after the drain, how long the server is left without traffic before memory is read again
    quiet_s: float = 20.0


@dataclass
class Sample:
    t: float
    rss_bytes: int
    cache_bytes: float
    adapter_version: float


@dataclass
class SoakLog:
    outcomes: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    rejected: int = 0
    feedback: Counter = field(default_factory=Counter)
    timeline: list[Sample] = field(default_factory=list)

    def fail(self, kind: str, message: str) -> None:
        self.outcomes[(kind, "error")] += 1
        self.errors.append(f"{kind}: {message}")

    def ok(self, kind: str) -> None:
        self.outcomes[(kind, "ok")] += 1


def memory_by_mapping(pid: int) -> dict[str, float]:
    """The process's resident MiB by kind of mapping (/proc/PID/smaps): glibc's main heap,
    anonymous mappings (other malloc arenas, blocks above the mmap threshold, torch's
    large buffers, thread stacks) and files (libraries, the mapped model)."""
    kinds: Counter = Counter()
    kind = "other"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            first = line.split(maxsplit=6)
            if len(first) >= 5 and "-" in first[0] and not first[0].endswith(":"):
                path = first[5].strip() if len(first) > 5 else ""
                kind = "heap" if path == "[heap]" else "anonymous" if not path else (
                    "other" if path.startswith("[") else "files")
            elif first and first[0] == "Rss:":
                kinds[kind] += int(first[1]) * 1024
    return {k: round(v / 2**20, 1) for k, v in sorted(kinds.items())}


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


class Traffic:
    def __init__(self, client: httpx.AsyncClient, model: str, config: SoakConfig, log: SoakLog):
        self.client, self.model, self.config, self.log = client, model, config, log
        self.rng = random.Random(config.seed + 7)

    def expect(self, kind: str, response: httpx.Response, status: int) -> bool:
        if response.status_code == 429:
            self.log.rejected += 1
            return False
        if response.status_code != status:
            self.log.fail(kind, f"expected {status}, got {response.status_code}: {response.text[:200]}")
            return False
        if status >= 400 and set(response.json().get("error", {})) != {"message", "type", "param", "code"}:
            self.log.fail(kind, f"error body not in OpenAI's shape: {response.text[:200]}")
            return False
        return True

    def chat_body(self, prompt: str, tokens: int, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": prompt}],
                "max_tokens": min(tokens, self.config.max_tokens), **extra}

    async def run(self, kind: str, prompt: str, tokens: int) -> None:
        try:
            await getattr(self, kind)(kind, prompt, tokens)
        except (httpx.HTTPError, json.JSONDecodeError, KeyError, IndexError) as exc:
            self.log.fail(kind, f"{type(exc).__name__}: {exc}")

    async def chat_feedback(self, kind, prompt, tokens):
        r = await self.client.post("/v1/chat/completions", json=self.chat_body(prompt, tokens))
        if not self.expect(kind, r, 200):
            return
        completion_id = r.json()["id"]
        side = self.rng.choice(["chosen", "rejected", "both"])
        text = " ".join(self.rng.choice(WORDS) for _ in range(8))
        body = {"id": completion_id, **({"chosen": text} if side in ("chosen", "both") else {}),
                **({"rejected": text + " no"} if side in ("rejected", "both") else {})}
        fb = await self.client.post("/v1/feedback", json=body)
        self.log.feedback[fb.status_code] += 1
        # no label of a served, trainable request is refused (whether or not its prefill was
        # recorded); the one refusal the server explains: a label that would use an empty
        # served response (400)
        explained = fb.status_code == 400 and "served response is empty" in fb.json()["error"]["message"]
        if fb.status_code != 200 and not explained:
            self.log.fail(kind, f"feedback got {fb.status_code}: {fb.text[:200]}")
            return
        self.log.ok(kind)

    async def chat_no_feedback(self, kind, prompt, tokens):
        r = await self.client.post("/v1/chat/completions", json=self.chat_body(prompt, tokens, temperature=0.8))
        if self.expect(kind, r, 200) and r.json()["choices"][0]["message"]["content"] is not None:
            self.log.ok(kind)

    async def _stream(self, kind, prompt, tokens, stop_after: int | None):
        body = self.chat_body(prompt, tokens, stream=True, stream_options={"include_usage": True})
        chunks, done, usage = 0, False, None
        async with self.client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self.expect(kind, response, 200)
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    self.log.fail(kind, f"error in stream: {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                chunks += 1
                if stop_after is not None and chunks >= stop_after:
                    self.log.ok(kind)  # the client goes away mid-stream
                    return
        if not done or usage is None:
            self.log.fail(kind, f"stream ended without [DONE] or usage after {chunks} chunks")
            return
        self.log.ok(kind)

    async def stream(self, kind, prompt, tokens):
        await self._stream(kind, prompt, tokens, None)

    async def disconnect(self, kind, prompt, tokens):
        await self._stream(kind, prompt, max(tokens, 16), stop_after=3)

    async def completions_batch(self, kind, prompt, tokens):
        body = {"model": self.model, "prompt": [prompt, prompt[::-1]], "n": 2,
                "max_tokens": min(tokens, self.config.max_tokens) // 2 or 1, "temperature": 0.7}
        r = await self.client.post("/v1/completions", json=body)
        if self.expect(kind, r, 200):
            if len(r.json()["choices"]) != 4:
                self.log.fail(kind, f"expected 4 choices, got {len(r.json()['choices'])}")
                return
            self.log.ok(kind)

    async def bad_body(self, kind, prompt, tokens):
        bodies = [b'{"model": "x", "messages": ', json.dumps({"model": self.model, "messages": "hi"}).encode(),
                  json.dumps({**self.chat_body(prompt, tokens), "max_tokens": -3}).encode(),
                  json.dumps({**self.chat_body(prompt, tokens), "temperature": "hot"}).encode()]
        r = await self.client.post("/v1/chat/completions", content=self.rng.choice(bodies),
                                   headers={"content-type": "application/json"})
        if self.expect(kind, r, 400):
            self.log.ok(kind)

    async def bad_key(self, kind, prompt, tokens):
        r = await self.client.post("/v1/chat/completions", json=self.chat_body(prompt, tokens),
                                   headers={"Authorization": "Bearer sk-wrong"})
        if self.expect(kind, r, 401):
            self.log.ok(kind)

    async def unknown_feedback(self, kind, prompt, tokens):
        r = await self.client.post("/v1/feedback", json={"id": f"chatcmpl-{self.rng.getrandbits(64):x}",
                                                         "chosen": "x"})
        if self.expect(kind, r, 404):
            self.log.ok(kind)

    async def adapters(self, kind, prompt, tokens):
        r = await self.client.get("/v1/adapters")
        if self.expect(kind, r, 200) and isinstance(r.json()["version"], int):
            self.log.ok(kind)


async def _sample(client: httpx.AsyncClient, pid: int, started: float, log: SoakLog) -> Sample:
    text = (await client.get("/metrics")).text
    sample = Sample(round(time.perf_counter() - started, 1), rss_bytes(pid),
                    read_metric(text, "alchemist:activation_cache_bytes"), read_metric(text, "alchemist:adapter_version"))
    log.timeline.append(sample)
    return sample


async def _drive(url: str, pid: int, config: SoakConfig, log: SoakLog) -> dict:
    trace = make_trace(config.rate, config.seconds, config.seed)
    rng = random.Random(config.seed)
    kinds = rng.choices(list(MIX), weights=list(MIX.values()), k=len(trace))
    headers = {"Authorization": f"Bearer {_KEY}"}
    async with httpx.AsyncClient(base_url=url, timeout=300, headers=headers) as client:
        model = (await client.get("/v1/models")).json()["data"][0]["id"]
        traffic = Traffic(client, model, config, log)
        started = time.perf_counter()
        mapping_before = memory_by_mapping(pid)
        stop_sampling = asyncio.Event()

        async def sampler():
            next_report = started
            while not stop_sampling.is_set():
                sample = await _sample(client, pid, started, log)
                if time.perf_counter() >= next_report:
                    done = sum(log.outcomes.values()) + log.rejected
                    print(f"  [{sample.t:6.0f} s] {done}/{len(trace)} requests, {len(log.errors)} errors, "
                          f"RSS {sample.rss_bytes / 2**20:.0f} MiB, cache {sample.cache_bytes / 2**20:.1f} MiB, "
                          f"adapter v{sample.adapter_version:.0f}", flush=True)
                    next_report += 15
                with_timeout = asyncio.wait_for(stop_sampling.wait(), config.sample_every_s)
                try:
                    await with_timeout
                except asyncio.TimeoutError:
                    pass

        async def launch(request, kind):
            await asyncio.sleep(max(0.0, started + request.arrival_s - time.perf_counter()))
            await traffic.run(kind, request.prompt, request.output_tokens)

        sampling = asyncio.ensure_future(sampler())
        await asyncio.gather(*[launch(r, k) for r, k in zip(trace, kinds)])
        traffic_end = time.perf_counter() - started
        print(f"  traffic ended at {traffic_end:.0f} s; waiting for the activation cache to drain", flush=True)
        # drain: entries are trained, or expire after the label timeout
        drain_started, drained = time.perf_counter(), False
        while time.perf_counter() - drain_started < config.label_timeout_s + config.drain_timeout_s:
            text = (await client.get("/metrics")).text
            if read_metric(text, "alchemist:activation_cache_bytes") == 0 and all(
                    read_metric(text, f'alchemist:activation_cache_entries{{state="{s}"}}') == 0
                    for s in ("waiting_label", "ready", "training")):
                drained = True
                break
            await asyncio.sleep(1.0)
        drain_seconds = time.perf_counter() - drain_started
        print(f"  {'drained' if drained else 'NOT drained'} in {drain_seconds:.0f} s", flush=True)
        stop_sampling.set()
        await sampling
        await asyncio.sleep(3.0)  # idle slices return the freed activation memory
        after_drain = await _sample(client, pid, started, log)
        mapping_after = memory_by_mapping(pid)
        warm_heap = read_metric((await client.get("/metrics")).text, "alchemist:warm_heap_bytes")
        await asyncio.sleep(config.quiet_s)  # what a server without traffic keeps
        after_quiet = await _sample(client, pid, started, log)
        mapping_quiet = memory_by_mapping(pid)
        final = (await client.get("/metrics")).text
        status = (await client.get("/v1/adapters")).json()
    return {"requests": len(trace), "traffic_seconds": round(traffic_end, 1), "cache_drained": drained,
            "rss_before_traffic_mib": round(log.timeline[0].rss_bytes / 2**20, 1),
            "rss_after_drain_mib": round(after_drain.rss_bytes / 2**20, 1),
            f"rss_after_{config.quiet_s:.0f}s_quiet_mib": round(after_quiet.rss_bytes / 2**20, 1),
            "rss_by_mapping_mib": {"before_traffic": mapping_before, "after_drain": mapping_after,
                                   f"after_{config.quiet_s:.0f}s_quiet": mapping_quiet},
            "warm_heap_after_drain_mib": round(warm_heap / 2**20, 1),
            f"warm_heap_after_{config.quiet_s:.0f}s_quiet_mib": round(
                read_metric(final, "alchemist:warm_heap_bytes") / 2**20, 1),
            "drain_seconds": round(drain_seconds, 1), "adapter_version_end": status["version"],
            "server_failed_train_jobs": read_metric(final, "alchemist:failed_train_jobs_total"),
            "server_5xx": sum(float(line.split()[-1]) for line in final.splitlines()
                              if line.startswith("alchemist:http_requests_total") and 'status="5' in line),
            "trained_entries": sum(float(line.split()[-1]) for line in final.splitlines()
                                   if line.startswith("alchemist:trained_entries_total")),
            "trained_by_path": (paths := trained_by_path(final, "dpo")),
            "reuse_share": round(reuse_share(paths), 3)}


def rss_growth(timeline: list[Sample], traffic_seconds: float, net_of_cache: bool = False) -> tuple[float, float, float]:
    """(baseline, final, growth): median RSS over a window after warm-up against the
    median over the last window of traffic. Warm-up is the first third of the run (the
    activation cache takes minutes to reach its equilibrium occupancy); windows are a sixth
    of the run, at most 60 s.
    `net_of_cache` subtracts the live activation-cache bytes from each sample first: the
    cache legitimately moves by up to its budget with the traffic, and what remains is
    what a leak would grow."""
    window = min(60.0, traffic_seconds / 6)
    warm = traffic_seconds / 3

    def value(s: Sample) -> float:
        return s.rss_bytes - (s.cache_bytes if net_of_cache else 0)

    base = [value(s) for s in timeline if warm <= s.t < warm + window]
    last = [value(s) for s in timeline if traffic_seconds - window <= s.t <= traffic_seconds]
    if not base or not last:
        return float("nan"), float("nan"), float("nan")
    baseline, final = statistics.median(base), statistics.median(last)
    return baseline, final, final / baseline - 1


def plot(log: SoakLog, traffic_seconds: float, path: str) -> str:
    plt = pyplot()

    t = [s.t for s in log.timeline]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t, [s.rss_bytes / 2**20 for s in log.timeline], color="tab:blue", label="server RSS")
    ax.plot(t, [(s.rss_bytes - s.cache_bytes) / 2**20 for s in log.timeline], color="tab:blue", linestyle=":",
            label="RSS minus activation cache")
    ax.legend(loc="lower right")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("RSS (MiB)", color="tab:blue")
    ax.set_ylim(bottom=0)
    other = ax.twinx()
    other.plot(t, [s.cache_bytes / 2**20 for s in log.timeline], color="tab:orange", label="activation cache (MiB)")
    other.set_ylabel("activation cache (MiB)", color="tab:orange")
    other.set_ylim(bottom=0)
    ax.axvline(traffic_seconds, color="gray", linestyle="--")
    ax.text(traffic_seconds, 0, " traffic ends", color="gray", va="bottom")
    ax.set_title("Soak: memory under mixed traffic with online DPO")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_soak_bench(config: SoakConfig, json_path: str | None = None, plot_path: str | None = None) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request would drown the progress
    log = SoakLog()
    adapter_dir = tempfile.mkdtemp(prefix="alchemist-soak-adapters-")
    env = {"ALCHEMIST_SERVER_API_KEY": _KEY, "ALCHEMIST_TRAIN_LABEL_TIMEOUT_S": str(config.label_timeout_s),
           "ALCHEMIST_ADAPTER_DIR": adapter_dir, "ALCHEMIST_ADAPTER_SAVE_EVERY": "5"}
    print(f"soak: {config.seconds:.0f} s of mixed traffic at {config.rate}/s against a DPO server", flush=True)
    with server_process("--train-mode", "dpo", env=env) as (url, proc):
        result = asyncio.run(_drive(url, proc.pid, config, log))
        proc.terminate()  # SIGTERM: the final adapter version must be saved
        exit_code = proc.wait(120)
    saved = AdapterStore(adapter_dir).versions()
    shutil.rmtree(adapter_dir, ignore_errors=True)
    baseline, final, growth = rss_growth(log.timeline, result["traffic_seconds"])
    net_baseline, net_final, net_growth = rss_growth(log.timeline, result["traffic_seconds"], net_of_cache=True)
    by_kind: dict[str, dict[str, int]] = {}
    for (kind, outcome), count in log.outcomes.items():
        by_kind.setdefault(kind, {"ok": 0, "error": 0})[outcome] = count
    report = {
        "config": asdict(config), **result,
        "errors": len(log.errors), "error_samples": log.errors[:10], "rejected_429": log.rejected,
        "by_kind": by_kind, "feedback_status": {str(k): v for k, v in log.feedback.items()},
        "rss_baseline_mib": round(baseline / 2**20, 1), "rss_final_mib": round(final / 2**20, 1),
        "rss_peak_mib": round(max(s.rss_bytes for s in log.timeline) / 2**20, 1),
        "rss_growth": round(growth, 4),
        "rss_net_of_cache_baseline_mib": round(net_baseline / 2**20, 1),
        "rss_net_of_cache_final_mib": round(net_final / 2**20, 1),
        "rss_net_of_cache_growth": round(net_growth, 4),
        "shutdown_exit_code": exit_code,
        "final_version_saved": bool(saved) and saved[-1].version == result["adapter_version_end"],
        "timeline": [asdict(s) for s in log.timeline],
    }
    report["plot"] = plot(log, result["traffic_seconds"], plot_path or "bench-soak.png")
    print(json.dumps({k: v for k, v in report.items() if k != "timeline"}, indent=2))
    write_json(report, json_path)
    return report
