"""Prometheus metrics under the `alchemist:` prefix with vLLM's names after it.

One registry per server instance (so tests can build several apps in one process). The
engine feeds it on the device thread through the `EngineObserver` interface
(engine/hooks.py): per step (queue sizes, KV usage) and per request output (token
counts, latencies). The arbiter's figures are read at scrape time from `Arbiter.stats`,
the trainer's (server/training_metrics.py) from `Trainer.status()`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.outputs import RequestOutput, StepStats
from engine.scheduler import STEP_KINDS
from engine.thread_cpu import thread_cpu_seconds
from server.training_metrics import PREFIX, TrainingCollector
from trainer.arbiter import ArbiterStats

disable_created_metrics()  # no `*_created` series, as vLLM
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_E2E_BUCKETS_SHORT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + _E2E_BUCKETS
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
CONSTRAINTS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


# the engine's finish reasons (engine/output_processor.py, engine/llm_engine.py)
FINISH_REASONS = ("stop", "length", "abort")


def request_finish_reason(choice_reasons: set[str]) -> str:
    """A request's finish reason from its choices': abort (or none), else length, else the
    first by name."""
    if not choice_reasons or "abort" in choice_reasons:
        return "abort"
    return "length" if "length" in choice_reasons else min(choice_reasons)


_HTTP_RESPONSES_HELP = ("HTTP responses, by route and status code (401 unauthenticated, 413 body too large, 429 "
                        "over capacity, 499 client gone before its answer began: a stream it leaves was answered "
                        "200, and counts in `request_success_total{finished_reason=\"abort\"}`).")


class StepsByKind:
    """Engine steps by what they ran (`SchedulerOutput.kind`): their seconds, the tokens
    they computed and the page faults they took."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        labels = ["model_name", "kind"]
        seconds = Histogram(f"{PREFIX}serving_step_seconds", "Wall time of an engine step, by what it ran: decode "
                            "(one token per sequence), prefill (no decode row), mixed, recorded_prefill (a prompt "
                            "recorded with autograd for training, alone), recorded_mixed (one with running "
                            "sequences riding along), in seconds.",
                            labels, registry=registry, buckets=_LATENCY_BUCKETS)
        tokens = Counter(f"{PREFIX}serving_step_tokens", "Tokens computed by engine steps, by the step's kind (as "
                         "serving_step_seconds).", labels, registry=registry)
        faults = Counter(f"{PREFIX}serving_step_page_faults", "Minor page faults the server process (any of its "
                         "threads) took during engine steps, by the step's kind (as serving_step_seconds): host "
                         "memory written for the first time, which a recorded prefill pays for when its "
                         "activations land on fresh pages.",
                         labels, registry=registry)
        self.seconds = {kind: seconds.labels(model_name=model_name, kind=kind) for kind in STEP_KINDS}
        self.tokens = {kind: tokens.labels(model_name=model_name, kind=kind) for kind in STEP_KINDS}
        self.page_faults = {kind: faults.labels(model_name=model_name, kind=kind) for kind in STEP_KINDS}

    def observe(self, stats: StepStats) -> None:
        self.seconds[stats.kind].observe(stats.seconds)
        self.tokens[stats.kind].inc(stats.num_scheduled_tokens)
        self.page_faults[stats.kind].inc(stats.page_faults)


class KVCacheMetrics:
    """The KV cache's use, its preemptions and its prefix cache's lookups."""

    def __init__(self, model_name: str, registry: CollectorRegistry):
        def child(metric):
            return metric.labels(model_name=model_name)

        labels = ["model_name"]
        self.usage = child(Gauge(f"{PREFIX}kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                 labels, registry=registry))
        self.preemptions = child(Counter(f"{PREFIX}num_preemptions", "Sequences preempted for KV cache space.",
                                         labels, registry=registry))
        self.queries = child(Counter(f"{PREFIX}prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                     "cache (each request's first prefill).", labels, registry=registry))
        self.hits = child(Counter(f"{PREFIX}prefix_cache_hits", "Prompt tokens whose K/V the prefix cache "
                                  "held (not computed again).", labels, registry=registry))

    def observe(self, stats: StepStats) -> None:
        self.usage.set(stats.kv_usage)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)
        if stats.prefix_cache_queries:
            self.queries.inc(stats.prefix_cache_queries)
            self.hits.inc(stats.prefix_cache_hits)


class ServingMetrics:
    def __init__(self, model_name: str, cache_info: dict[str, str] | None = None):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry

        def child(metric):
            return metric.labels(model_name=model_name)

        self.ttft = child(Histogram(f"{PREFIX}time_to_first_token_seconds",
                                    "Time from request arrival to its first generated token, in seconds.",
                                    labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.tpot = child(Histogram(f"{PREFIX}request_time_per_output_token_seconds",
                                    "Mean time per generated token after the first, per request that ran to its end: "
                                    "(last token - first token) / (tokens - 1) of its longest choice, in seconds.",
                                    labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.itl = child(Histogram(f"{PREFIX}inter_token_latency_seconds",
                                   "Time between consecutive outputs carrying new tokens of a request, in seconds.",
                                   labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.e2e = child(Histogram(f"{PREFIX}e2e_request_latency_seconds",
                                   "Time from request arrival to its last token, in seconds (requests that ran to "
                                   "their end; an aborted one counts in request_success_total only).",
                                   labels, registry=r, buckets=_E2E_BUCKETS))
        self.queue_time = child(Histogram(f"{PREFIX}request_queue_time_seconds", "Time a request waited in the "
                                          "queue before its prefill was first scheduled, in seconds.", labels,
                                          registry=r, buckets=_E2E_BUCKETS_SHORT))
        self.prefill_time = child(Histogram(f"{PREFIX}request_prefill_time_seconds", "Time from a request's first "
                                            "scheduled step to its first token, in seconds.", labels, registry=r,
                                            buckets=_E2E_BUCKETS_SHORT))
        self.decode_time = child(Histogram(f"{PREFIX}request_decode_time_seconds", "Time from a request's first "
                                           "token to its last, in seconds (requests that ran to their end).", labels,
                                           registry=r, buckets=_E2E_BUCKETS))
        self.prompt_len = child(Histogram(f"{PREFIX}request_prompt_tokens", "Prompt length of requests that ran to "
                                          "their end, in tokens.", labels, registry=r, buckets=_TOKEN_BUCKETS))
        self.gen_len = child(Histogram(f"{PREFIX}request_generation_tokens", "Tokens generated per request "
                                       "that ran to its end (all choices), in tokens.", labels, registry=r,
                                       buckets=_TOKEN_BUCKETS))
        self.steps = StepsByKind(model_name, r)
        self.kv_cache = KVCacheMetrics(model_name, r)
        self.running = child(Gauge(f"{PREFIX}num_requests_running", "Sequences in the running batch.",
                                   labels, registry=r))
        self.waiting = child(Gauge(f"{PREFIX}num_requests_waiting", "Sequences waiting to be scheduled.",
                                   labels, registry=r))
        self.prompt_tokens = child(Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of requests that began "
                                           "generating.", labels, registry=r))
        self.generation_tokens = child(Counter(f"{PREFIX}generation_tokens", "Generated tokens.", labels,
                                               registry=r))
        self.http_responses = Counter(f"{PREFIX}http_requests", _HTTP_RESPONSES_HELP, ["handler", "status"], registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Finished requests, each once, by finish reason (of "
                               "several choices' reasons: abort, else length, else the first by name).",
                               labels + ["finished_reason"], registry=r)
        self.constrained = Counter(f"{PREFIX}constrained_requests", "Requests whose output a grammar constrained, "
                                   "by constraint (json_object, json_schema, regex, choice, grammar, tool_call: a "
                                   "forced tool call).", ["constraint"], registry=r)
        self.tool_requests = Counter(f"{PREFIX}tool_requests", "Chat requests that offered tools, by tool_choice "
                                     "(auto, required, named).", ["tool_choice"], registry=r)
        self.tool_calls = Counter(f"{PREFIX}tool_calls", "Tool calls returned (parsed; a forced call cut by "
                                  "max_tokens is returned as far as it got), and <tool_call> blocks that did not "
                                  "parse and were left in the content (invalid).", ["outcome"],
                                  registry=r)
        for reason in FINISH_REASONS:  # every series from the first scrape: rate() sees each first increment
            self.success.labels(model_name=model_name, finished_reason=reason)
        for kind in CONSTRAINTS:
            self.constrained.labels(constraint=kind)
        for choice in ("auto", "required", "named"):
            self.tool_requests.labels(tool_choice=choice)
        for outcome in ("parsed", "invalid"):
            self.tool_calls.labels(outcome=outcome)
        if cache_info:
            info = Gauge(f"{PREFIX}cache_config_info", "KV cache configuration (block_size, num_blocks, "
                         "bytes_per_token, dtype); the value is always 1.", sorted(cache_info), registry=r)
            info.labels(**cache_info).set(1)
        self._model_name = model_name
        self._started: set[str] = set()
        self._last_token_time: dict[str, float] = {}
        # request id -> choice index -> tokens generated so far
        self._choice_tokens: dict[str, dict[int, int]] = {}

    # EngineObserver
    def on_step(self, stats: StepStats) -> None:
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_cache.observe(stats)
        if stats.kind:
            self.steps.observe(stats)

    def on_output(self, output: RequestOutput) -> None:
        rid, meta = output.request_id, output.metrics
        new_tokens = sum(len(c.token_ids) for c in output.outputs)
        now = time.monotonic()
        aborted = all(c.finish_reason == "abort" for c in output.outputs)
        if rid not in self._started and (new_tokens or (output.finished and not aborted)):
            self._started.add(rid)  # prefill done (prompt-only requests finish without a token)
            self.prompt_tokens.inc(meta.num_prompt_tokens)
            if meta.first_token_time is not None:
                self.ttft.observe(meta.first_token_time - meta.arrival_time)
            if meta.first_scheduled_time is not None:
                self.queue_time.observe(meta.first_scheduled_time - meta.arrival_time)
                if meta.first_token_time is not None:
                    self.prefill_time.observe(meta.first_token_time - meta.first_scheduled_time)
        elif new_tokens and rid in self._last_token_time:
            self.itl.observe(now - self._last_token_time[rid])
        if new_tokens:
            self._last_token_time[rid] = now
            self.generation_tokens.inc(new_tokens)
            counts = self._choice_tokens.setdefault(rid, {})
            for c in output.outputs:
                counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
        if output.finished:
            longest = max(self._choice_tokens.pop(rid, {}).values(), default=0)
            # the histograms describe requests that ran to their end; one aborted (its client
            # gone, perhaps still queued) is counted by its reason only
            if not aborted:
                if meta.finish_time is not None:
                    self.e2e.observe(meta.finish_time - meta.arrival_time)
                    if meta.first_token_time is not None:
                        self.decode_time.observe(meta.finish_time - meta.first_token_time)
                        if longest > 1:
                            self.tpot.observe((meta.finish_time - meta.first_token_time) / (longest - 1))
                self.prompt_len.observe(meta.num_prompt_tokens)
                self.gen_len.observe(meta.num_generation_tokens)
            reason = request_finish_reason({c.finish_reason for c in output.outputs if c.finish_reason})
            self.success.labels(model_name=self._model_name, finished_reason=reason).inc()
            self._started.discard(rid)
            self._last_token_time.pop(rid, None)

    def count_constraints(self, grammar, tool_use) -> None:
        """A request accepted: what constrains its output (engine/structured.Grammar) and
        the tools it offers (server/tool_calls.ToolUse), either None."""
        if grammar is not None:
            self.constrained.labels(constraint=grammar.kind).inc()
        if tool_use is not None:
            self.tool_requests.labels(tool_choice=tool_use.choice).inc()

    def count_tool_calls(self, parser) -> None:
        """A choice's output, parsed (server/tool_calls.ToolCallParser)."""
        self.tool_calls.labels(outcome="parsed").inc(len(parser.calls))
        self.tool_calls.labels(outcome="invalid").inc(parser.invalid_blocks)

    def count_response(self, handler: str, status: int) -> None:
        self.http_responses.labels(handler=handler, status=str(status)).inc()

    def expect_responses(self, statuses: dict[str, tuple[int, ...]]) -> None:
        """Exports these routes' status codes at 0 from the start: the first of each counts
        in `rate()` and `increase()`, which cannot see a series born at 1."""
        for handler, codes in statuses.items():
            for status in codes:
                self.http_responses.labels(handler=handler, status=str(status))

    def add_trainer(self, trainer) -> None:
        self.registry.register(TrainingCollector(trainer))

    def add_response_store(self, store) -> None:
        """The Responses API's stored responses (server/response_store.py)."""
        self.registry.register(_ResponseStoreCollector(store))

    def add_engine(self, async_engine, arbiter, policy: str) -> None:
        """`arbiter`: the idle hook, or None when training is off (its counters stay 0)."""
        self.registry.register(_EngineCollector(async_engine, arbiter, policy))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def requests_served(self) -> int:
        """Requests finished, whatever their finish reason."""
        return int(sum(s.value for m in self.success.collect() for s in m.samples if s.name.endswith("_total")))


class _EngineCollector:
    def __init__(self, async_engine, arbiter, policy: str):
        self.async_engine = async_engine
        self.arbiter = arbiter
        self.policy = policy

    def collect(self):
        stats, policy = self.arbiter.stats if self.arbiter is not None else ArbiterStats(), self.policy
        yield CounterMetricFamily(f"{PREFIX}engine_idle_seconds", "Seconds the engine had no request to run "
                                  "(spent training or waiting); arbiter_slice_seconds{gap=\"idle\"} over this is "
                                  "the harvested share.", value=self.async_engine.idle_seconds)
        yield CounterMetricFamily(f"{PREFIX}engine_serving_steps", "Serving steps the engine ran.",
                                  value=self.async_engine.serving_steps)
        yield CounterMetricFamily(f"{PREFIX}engine_step_gap_seconds", "Seconds the device spent between consecutive "
                                  "serving steps while requests were running: the round trip through the event loop "
                                  "and what the arbiter ran between steps.", value=self.async_engine.step_gap_seconds)
        threads = CounterMetricFamily(f"{PREFIX}thread_cpu_seconds", "CPU seconds spent by the event loop's "
                                      "thread (HTTP, streaming) and by the device thread (steps, training slices).",
                                      labels=["thread"])
        for thread, native_id in sorted(self.async_engine.thread_ids.items()):
            seconds = thread_cpu_seconds(native_id)
            if seconds is not None:
                threads.add_metric([thread], seconds)
        yield threads
        slices = CounterMetricFamily(f"{PREFIX}arbiter_slices", "Training slices the arbiter ran, by policy and gap "
                                     "(idle: nothing runnable; between_steps: between decode steps, slo policy; "
                                     "merge_between_steps: merged serving weights rebuilt after a step, any policy; "
                                     "warm_between_steps: heap pre-faulted for the next recording after a step).",
                                     labels=["policy", "gap"])
        slices.add_metric([policy, "idle"], stats.idle_slices)
        slices.add_metric([policy, "between_steps"], stats.between_step_slices)
        slices.add_metric([policy, "merge_between_steps"], stats.maintenance_slices)
        slices.add_metric([policy, "warm_between_steps"], stats.warming_slices)
        yield slices
        slices = CounterMetricFamily(f"{PREFIX}arbiter_slice_seconds", "Seconds of the training slices the arbiter "
                                     "ran, by policy and gap (idle: within the engine's idle time; between_steps: "
                                     "between decode steps, slo policy).", labels=["policy", "gap"])
        slices.add_metric([policy, "idle"], stats.idle_slice_seconds)
        slices.add_metric([policy, "between_steps"], stats.between_step_slice_seconds)
        yield slices
        yield CounterMetricFamily(f"{PREFIX}arbiter_slo_backoffs", "Times the slo policy stopped interleaving "
                                  "training because the measured time per output token exceeded the SLO.",
                                  value=stats.slo_backoffs)
        yield GaugeMetricFamily(f"{PREFIX}arbiter_tpot_ema_seconds", "Smoothed time per output token the "
                                "arbiter measures between decode steps, in seconds.", value=stats.tpot_ema)


class _ResponseStoreCollector:
    def __init__(self, store):
        self.store = store

    def collect(self):
        yield GaugeMetricFamily(f"{PREFIX}stored_responses", "Responses kept for retrieval and previous_response_id "
                                "(as of this process's last write).", value=self.store.count)
        yield GaugeMetricFamily(f"{PREFIX}stored_response_bytes", "Bytes of the stored responses' JSON (as of this "
                                "process's last write).", value=self.store.bytes)
