"""Prometheus metrics under the `alchemist:` prefix with vLLM's names after it.

One registry per server instance (so tests can build several apps in one process). The
engine feeds it on the device thread through the `EngineObserver` interface
(engine/hooks.py): per step (queue sizes, KV usage) and per request output (token
counts, latencies). The trainer's and the arbiter's figures are read at scrape time from
`Trainer.status()` and `Arbiter.stats`.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

from engine.outputs import RequestOutput, StepStats
from trainer.arbiter import ArbiterStats

PREFIX = "alchemist:"
disable_created_metrics()  # no `*_created` series, as vLLM
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                    10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0)
_E2E_BUCKETS_SHORT = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1) + _E2E_BUCKETS
_TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)
CONSTRAINTS = ("json_object", "json_schema", "regex", "choice", "grammar", "tool_call")


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
        self.tpot = child(Histogram(f"{PREFIX}time_per_output_token_seconds",
                                    "Mean time per generated token after the first, per finished request: "
                                    "(last token - first token) / (tokens - 1) of its longest choice, in seconds.",
                                    labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.itl = child(Histogram(f"{PREFIX}inter_token_latency_seconds",
                                   "Time between consecutive outputs carrying new tokens of a request, in seconds.",
                                   labels, registry=r, buckets=_LATENCY_BUCKETS))
        self.e2e = child(Histogram(f"{PREFIX}e2e_request_latency_seconds",
                                   "Time from request arrival to its last token, in seconds.",
                                   labels, registry=r, buckets=_E2E_BUCKETS))
        self.queue_time = child(Histogram(f"{PREFIX}request_queue_time_seconds", "Time a request waited in the "
                                          "queue before its prefill was first scheduled, in seconds.", labels,
                                          registry=r, buckets=_E2E_BUCKETS_SHORT))
        self.prefill_time = child(Histogram(f"{PREFIX}request_prefill_time_seconds", "Time from a request's first "
                                            "scheduled step to its first token, in seconds.", labels, registry=r,
                                            buckets=_E2E_BUCKETS_SHORT))
        self.decode_time = child(Histogram(f"{PREFIX}request_decode_time_seconds", "Time from a request's first "
                                           "token to its last, in seconds.", labels, registry=r,
                                           buckets=_E2E_BUCKETS))
        self.prompt_len = child(Histogram(f"{PREFIX}request_prompt_tokens", "Prompt length of finished requests, "
                                          "in tokens.", labels, registry=r, buckets=_TOKEN_BUCKETS))
        self.gen_len = child(Histogram(f"{PREFIX}request_generation_tokens", "Tokens generated per finished "
                                       "request (all choices), in tokens.", labels, registry=r,
                                       buckets=_TOKEN_BUCKETS))
        self.running = child(Gauge(f"{PREFIX}num_requests_running", "Sequences in the running batch.",
                                   labels, registry=r))
        self.waiting = child(Gauge(f"{PREFIX}num_requests_waiting", "Sequences waiting to be scheduled.",
                                   labels, registry=r))
        self.kv_usage = child(Gauge(f"{PREFIX}kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).",
                                    labels, registry=r))
        self.prompt_tokens = child(Counter(f"{PREFIX}prompt_tokens", "Prompt tokens of requests that began "
                                           "generating.", labels, registry=r))
        self.generation_tokens = child(Counter(f"{PREFIX}generation_tokens", "Generated tokens.", labels,
                                               registry=r))
        self.preemptions = child(Counter(f"{PREFIX}num_preemptions", "Sequences preempted for KV cache space.",
                                         labels, registry=r))
        self.http_responses = Counter(f"{PREFIX}http_requests", "HTTP responses, by route and status code "
                                      "(401 unauthenticated, 413 body too large, 429 over capacity, 499 "
                                      "client gone).", ["handler", "status"], registry=r)
        self.success = Counter(f"{PREFIX}request_success", "Finished requests, by finish reason.",
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
        self.kv_usage.set(stats.kv_usage)
        if stats.num_preempted:
            self.preemptions.inc(stats.num_preempted)

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
            if meta.finish_time is not None:
                self.e2e.observe(meta.finish_time - meta.arrival_time)
                if meta.first_token_time is not None:
                    self.decode_time.observe(meta.finish_time - meta.first_token_time)
                    if longest > 1:
                        self.tpot.observe((meta.finish_time - meta.first_token_time) / (longest - 1))
            self.prompt_len.observe(meta.num_prompt_tokens)
            self.gen_len.observe(meta.num_generation_tokens)
            reasons = {c.finish_reason for c in output.outputs if c.finish_reason}
            for reason in reasons or {"abort"}:
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

    def add_trainer(self, trainer) -> None:
        self.registry.register(TrainingCollector(trainer))

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
                                  "(spent training or waiting); train_busy_seconds over this is the harvested "
                                  "share.", value=self.async_engine.idle_seconds)
        slices = CounterMetricFamily(f"{PREFIX}arbiter_slices", "Training slices the arbiter ran, by policy and gap "
                                     "(idle: nothing runnable; between_steps: between decode steps, slo policy; "
                                     "merge_between_steps: merged serving weights rebuilt after a step, any policy).",
                                     labels=["policy", "gap"])
        slices.add_metric([policy, "idle"], stats.idle_slices)
        slices.add_metric([policy, "between_steps"], stats.between_step_slices)
        slices.add_metric([policy, "merge_between_steps"], stats.maintenance_slices)
        yield slices
        yield CounterMetricFamily(f"{PREFIX}arbiter_slo_backoffs", "Times the slo policy stopped interleaving "
                                  "training because the measured time per output token exceeded the SLO.",
                                  value=stats.slo_backoffs)
        yield GaugeMetricFamily(f"{PREFIX}arbiter_tpot_ema_seconds", "Smoothed time per output token the "
                                "arbiter measures between decode steps, in seconds.", value=stats.tpot_ema)


class TrainingCollector:
    """Exports the trainer's status at scrape time (no state of its own)."""

    def __init__(self, trainer):
        self.trainer = trainer

    def collect(self):
        status = self.trainer.status()
        stats, cache, mode = status.training, status.cache, status.mode
        trained = CounterMetricFamily(f"{PREFIX}trained_entries", "Cache entries trained on, by mode and by path "
                                      "(reuse: the recorded prefill; stashed: the recorded prefill of an older "
                                      "adapter version, with its weights stashed; recompute: a full forward).",
                                      labels=["mode", "path"])
        for path in ("reuse", "stashed", "recompute"):
            trained.add_metric([mode, path], stats.trained_entries.get((mode, path), 0))
        yield trained
        yield CounterMetricFamily(f"{PREFIX}train_tokens", "Tokens trained on (prompt, plus responses for DPO).",
                                  value=stats.train_tokens)
        yield GaugeMetricFamily(f"{PREFIX}train_loss", "Mean loss of the latest optimizer step.",
                                value=stats.last_loss)
        yield GaugeMetricFamily(f"{PREFIX}adapter_version", "Adapter version serving (optimizer steps applied; with "
                                "an eval gate, the last promoted).", value=status.adapter_version)
        yield GaugeMetricFamily(f"{PREFIX}weight_stash_bytes", "Bytes of past adapter versions' LoRA weights kept "
                                "for recordings made under them.", value=status.stash_bytes)
        yield GaugeMetricFamily(f"{PREFIX}warm_heap_bytes", "Bytes of heap held pre-faulted for the next recorded "
                                "prefill.", value=status.warm_heap_bytes)
        yield GaugeMetricFamily(f"{PREFIX}activation_cache_bytes", "Bytes of recorded activations in the "
                                "activation cache.", value=cache.bytes)
        entries = GaugeMetricFamily(f"{PREFIX}activation_cache_entries", "Entries in the activation cache, by "
                                    "state.", labels=["state"])
        for state, count in cache.entries.items():
            entries.add_metric([state], count)
        yield entries
        yield GaugeMetricFamily(f"{PREFIX}label_entries", "Entries without activations (a label that trains by "
                                "recomputation: the prefill was not recorded, or its activations were given up).",
                                value=cache.label_entries)
        yield CounterMetricFamily(f"{PREFIX}refused_label_entries", "Entries refused because train.max_label_entries "
                                  "entries without activations were waiting (their feedback gets 404).",
                                  value=cache.refused_label_entries)
        ended = CounterMetricFamily(f"{PREFIX}activation_cache_ended_entries", "Entries that left the cache, by "
                                    "final state.", labels=["state"])
        for state, count in cache.ended.items():
            ended.add_metric([state], count)
        yield ended
        feedback = CounterMetricFamily(f"{PREFIX}feedback", "Feedback requests, by outcome.", labels=["status"])
        for outcome in ("accepted", "invalid", "unknown", "conflict"):
            feedback.add_metric([outcome], stats.feedback.get(outcome, 0))
        yield feedback
        yield CounterMetricFamily(f"{PREFIX}stale_entries", "Entries recorded under an older adapter version "
                                  "(recomputed, or dropped by stale_policy).", value=stats.stale_entries)
        yield CounterMetricFamily(f"{PREFIX}skipped_steps", "Optimizer steps skipped for a non-finite loss or "
                                  "gradient.", value=status.skipped_steps)
        yield CounterMetricFamily(f"{PREFIX}failed_train_jobs", "Training jobs that raised (entries dropped).",
                                  value=stats.failed_jobs)
        yield CounterMetricFamily(f"{PREFIX}recorded_prefills", "Prefills recorded into the activation cache.",
                                  value=stats.recorded)
        yield _staleness_histogram(stats.staleness)
        cumulative, buckets = 0, []
        for bound, count in stats.slice_buckets.items():
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else str(bound), cumulative))
        yield HistogramMetricFamily(f"{PREFIX}train_slice_seconds", "Duration of one training slice (a layer's "
                                    "forward or backward, a loss, an optimizer step), in seconds.", buckets=buckets,
                                    sum_value=stats.busy_seconds)
        yield CounterMetricFamily(f"{PREFIX}train_busy_seconds", "Seconds spent in training slices.",
                                  value=stats.busy_seconds)
        yield GaugeMetricFamily(f"{PREFIX}train_slice_max_seconds", "Longest training slice so far, in seconds "
                                "(what a request arriving during training may wait).", value=stats.max_slice_seconds)
        yield CounterMetricFamily(f"{PREFIX}train_preemptions", "Times a training job was interrupted by serving "
                                  "and resumed where it stopped.", value=stats.preemptions)
        yield from _save_metrics(status.saves)
        yield CounterMetricFamily(f"{PREFIX}memory_trims", "Idle slices that returned freed activation memory "
                                  "to the OS (glibc malloc_trim).", value=stats.memory_trims)
        yield CounterMetricFamily(f"{PREFIX}unrecorded_prefills", "Requests selected for training but not "
                                  "recorded (cache full, prompt too long, or no room in the offload device budget).",
                                  value=stats.not_recorded)
        yield from _offload_metrics(status.offload)
        yield from _group_metrics(stats)
        if status.ledger is not None:
            yield from _ledger_metrics(status.ledger)
        yield from _gate_metrics(stats, status.gate)


def _save_metrics(saves):
    """Adapter versions saved to the adapter directory (none without one)."""
    family = CounterMetricFamily(f"{PREFIX}adapter_saves", "Adapter versions written to the adapter directory, "
                                 "by outcome.", labels=["status"])
    family.add_metric(["ok"], saves.saved if saves else 0)
    family.add_metric(["failed"], saves.failed if saves else 0)
    yield family
    last = saves.last_saved_version if saves else None
    yield GaugeMetricFamily(f"{PREFIX}adapter_saved_version", "Latest adapter version saved to disk (-1: none).",
                            value=-1 if last is None else last)


def _gate_metrics(stats, gate):
    """Rollbacks and quarantined labels, and the eval gate (trainer/eval_gate.py, when there
    is one): its verdicts and the scores of the promoted and the last rejected version."""
    rollbacks = CounterMetricFamily(f"{PREFIX}adapter_rollbacks", "Adapter rollbacks, by reason (manual: the "
                                    "rollback route; eval_gate: a candidate version the eval gate rejected).",
                                    labels=["reason"])
    for reason, count in sorted(stats.rollbacks.items()):
        rollbacks.add_metric([reason], count)
    yield rollbacks
    yield CounterMetricFamily(f"{PREFIX}quarantined_labels", "Labels of versions the eval gate rejected, kept "
                              "out of training.", value=stats.quarantined_labels)
    if gate is None:
        return
    yield CounterMetricFamily(f"{PREFIX}eval_runs", "Versions the eval gate scored (baselines included).",
                              value=gate.evaluations)
    yield CounterMetricFamily(f"{PREFIX}eval_seconds", "Seconds the eval gate spent scoring versions.",
                              value=gate.eval_seconds)
    verdicts = CounterMetricFamily(f"{PREFIX}eval_verdicts", "Candidate versions the eval gate judged, by verdict.",
                                   labels=["verdict"])
    verdicts.add_metric(["promoted"], gate.promoted)
    verdicts.add_metric(["rejected"], gate.rejected)
    yield verdicts
    scores = GaugeMetricFamily(f"{PREFIX}eval_score", "A version's score on the eval set, in nats, by kind "
                               "(preference_margin, completion_logprob, kl to the base model) and version (promoted, "
                               "last_rejected).", labels=["kind", "version"])
    for which, values in (("promoted", gate.last_promoted), ("last_rejected", gate.last_rejected)):
        for kind in ("preference_margin", "completion_logprob", "kl"):
            if values is not None and values.get(kind) is not None:
                scores.add_metric([kind, which], values[kind])
    yield scores
    yield GaugeMetricFamily(f"{PREFIX}eval_candidate_version", "The adapter version the eval gate is scoring (-1: "
                            "none).", value=-1 if gate.candidate_version is None else gate.candidate_version)


def _ledger_metrics(ledger):
    """The feedback ledger (trainer/ledger.py), with an adapter directory."""
    for name, text, value in (
            ("ledger_commits", "Transactions the feedback ledger committed (each holds every write queued "
                               "meanwhile).", ledger.commits),
            ("ledger_rows_written", "Rows written to the feedback ledger (requests, labels, fates).",
             ledger.rows_written),
            ("ledger_write_errors", "Writes the feedback ledger could not make (full, locked, read-only).",
             ledger.write_errors),
            ("ledger_refused_writes", "Labels and deletions refused with 503 because the feedback ledger could not "
                                      "be written.", ledger.refused_writes),
            ("ledger_pruned_requests", "Requests pruned from the feedback ledger by retention (age, size).",
             ledger.pruned_requests),
            ("ledger_commit_seconds", "Seconds the feedback ledger's writer spent committing.",
             ledger.commit_seconds)):
        yield CounterMetricFamily(f"{PREFIX}{name}", text, value=value)
    yield GaugeMetricFamily(f"{PREFIX}ledger_retry_backlog", "Queued feedback ledger writes waiting to be retried.",
                            value=ledger.retry_backlog)


def _group_metrics(stats):
    """GRPO: groups and their rewards (a summary: rate(_sum) / rate(_count) is the mean reward over time)."""
    yield CounterMetricFamily(f"{PREFIX}rewarded_groups", "Groups (requests with n >= 2) whose rewards arrived, "
                              "posted or computed by the reward function.", value=stats.rewarded_groups)
    yield SummaryMetricFamily(f"{PREFIX}reward", "Rewards received, one per sampled response.",
                              count_value=stats.rewards_received, sum_value=stats.reward_sum)
    yield GaugeMetricFamily(f"{PREFIX}group_mean_reward", "Mean reward of the latest rewarded group.",
                            value=stats.last_group_mean_reward)
    yield CounterMetricFamily(f"{PREFIX}zero_advantage_groups", "Groups whose rewards were all equal: no advantage, "
                              "no gradient, not trained.", value=stats.zero_advantage_groups)
    yield CounterMetricFamily(f"{PREFIX}reward_errors", "Reward function calls that raised, timed out or returned "
                              "a bad value (their groups dropped).", value=stats.reward_errors)


_STALENESS_BUCKETS = (0, 1, 2, 4, 8, 16)


def _staleness_histogram(staleness: dict[int, int]) -> HistogramMetricFamily:
    buckets = [(str(bound), sum(n for lag, n in staleness.items() if lag <= bound)) for bound in _STALENESS_BUCKETS]
    buckets.append(("+Inf", sum(staleness.values())))
    return HistogramMetricFamily(f"{PREFIX}trained_entry_staleness", "Adapter versions between serving an entry "
                                 "and training on it (0: trained under the version that served it).",
                                 buckets=buckets, sum_value=sum(lag * n for lag, n in staleness.items()))


def _offload_metrics(offload):
    """The activation offloader (offload/); without one every recorded byte is on the device."""
    yield GaugeMetricFamily(f"{PREFIX}activation_device_bytes", "Bytes of recorded activations on the device, "
                            "by the offloader's accounting.", value=offload.device_bytes)
    yield GaugeMetricFamily(f"{PREFIX}activation_host_bytes", "Bytes of recorded activations copied to the host "
                            "pool.", value=offload.host_bytes)
    for name, text in (
            ("offloaded_layers", "Recorded layers freed from the device to their host copy."),
            ("dropped_layers", "Recorded layers freed without a host copy (recomputed later)."),
            ("reloaded_layers", "Freed layers loaded back to the device for backward."),
            ("recomputed_layers", "Freed layers recomputed from their kept input for backward."),
            ("over_budget_steps", "Serving steps before which the device budget could not be met (only "
                                  "never-freed tensors were left).")):
        yield CounterMetricFamily(f"{PREFIX}{name}", text, value=getattr(offload, name))
    yield CounterMetricFamily(f"{PREFIX}reload_wait_seconds", "Seconds backward waited for reloads (not hidden "
                              "behind compute), in seconds.", value=offload.reload_wait_seconds)
