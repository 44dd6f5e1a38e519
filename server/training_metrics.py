"""The trainer's Prometheus metrics under the `alchemist:` prefix, read at scrape time
from `Trainer.status()` (trained entries, the activation cache, the offloader, groups,
the feedback ledger, the eval gate). server/metrics.py registers it beside serving's."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, SummaryMetricFamily

from trainer.feedback import FeedbackOutcome

PREFIX = "alchemist:"


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
        yield GaugeMetricFamily(f"{PREFIX}train_loss", "Mean loss of the latest optimizer step (with replicas: of this "
                                "replica's own jobs in it).",
                                value=stats.last_loss)
        yield GaugeMetricFamily(f"{PREFIX}adapter_version", "Adapter version serving (optimizer steps applied; with "
                                "an eval gate, the last promoted).", value=status.adapter_version)
        yield GaugeMetricFamily(f"{PREFIX}weight_stash_bytes", "Bytes of past adapter versions' LoRA weights kept "
                                "for recordings made under them.", value=status.stash_bytes)
        yield GaugeMetricFamily(f"{PREFIX}warm_heap_bytes", "Bytes of heap held pre-faulted for the next recorded "
                                "prefill.", value=status.warm_heap_bytes)
        yield from _cache_metrics(cache)
        feedback = CounterMetricFamily(f"{PREFIX}feedback", "Feedback requests, by outcome.", labels=["status"])
        for outcome in FeedbackOutcome:
            feedback.add_metric([outcome.value], stats.feedback.get(outcome.value, 0))
        yield feedback
        yield CounterMetricFamily(f"{PREFIX}stale_entries", "Entries recorded under an older adapter version "
                                  "(recomputed, or dropped by stale_policy).", value=stats.stale_entries)
        yield CounterMetricFamily(f"{PREFIX}skipped_steps", "Optimizer steps skipped for a non-finite loss or "
                                  "gradient.", value=status.skipped_steps)
        yield CounterMetricFamily(f"{PREFIX}failed_train_jobs", "Training jobs that raised (entries dropped).",
                                  value=stats.failed_jobs)
        yield CounterMetricFamily(f"{PREFIX}recorded_prefills", "Prefills recorded into the activation cache.",
                                  value=stats.recorded)
        tokens = CounterMetricFamily(f"{PREFIX}recorded_prefill_tokens", "Prompt tokens of the prefills recorded, "
                                     "by where their K/V came from: recorded (a graph kept for training), or the "
                                     "prefix cache (training recomputes them).", labels=["source"])
        tokens.add_metric(["recorded"], stats.recorded_prompt_tokens)
        tokens.add_metric(["prefix_cache"], stats.recorded_cached_tokens)
        yield tokens
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
        longest = GaugeMetricFamily(f"{PREFIX}train_slice_max_seconds", "Longest training slice so far, in seconds "
                                    "(what a request arriving during training may wait), labelled with what it ran.",
                                    labels=["item"])
        longest.add_metric([stats.max_slice_item], stats.max_slice_seconds)
        yield longest
        yield CounterMetricFamily(f"{PREFIX}train_preemptions", "Times a training job was interrupted by serving "
                                  "and resumed where it stopped.", value=stats.preemptions)
        yield from _save_metrics(status.saves)
        yield CounterMetricFamily(f"{PREFIX}memory_trims", "Idle slices that returned freed activation memory "
                                  "to the OS (glibc malloc_trim).", value=stats.memory_trims)
        yield CounterMetricFamily(f"{PREFIX}unrecorded_prefills", "Requests selected for training but not "
                                  "recorded (cache full, prompt too long, no room in the offload device budget, "
                                  "or so many recordings ahead that it would be trained stale).",
                                  value=stats.not_recorded)
        yield from _offload_metrics(status.offload)
        yield from _group_metrics(stats)
        yield from _preference_metrics(stats)
        if status.ledger is not None:
            yield from _ledger_metrics(status.ledger)
        yield from _gate_metrics(stats, status.gate, status.ledger)


def _cache_metrics(cache):
    """The activation cache: what it holds and may hold, its entries by state."""
    yield GaugeMetricFamily(f"{PREFIX}activation_cache_bytes", "Bytes of recorded activations in the "
                            "activation cache.", value=cache.bytes)
    yield GaugeMetricFamily(f"{PREFIX}activation_cache_budget_bytes", "Bytes of recorded activations the "
                            "activation cache may hold (train.cache_bytes, or sized to the device at start).",
                            value=cache.budget_bytes)
    yield _by_state(GaugeMetricFamily(f"{PREFIX}activation_cache_entries", "Entries in the activation cache, by "
                                      "state.", labels=["state"]), cache.entries)
    yield GaugeMetricFamily(f"{PREFIX}label_entries", "Entries without activations (a label that trains by "
                            "recomputation: the prefill was not recorded, or its activations were given up).",
                            value=cache.label_entries)
    yield CounterMetricFamily(f"{PREFIX}refused_label_entries", "Entries refused because train.max_label_entries "
                              "entries without activations were waiting (their feedback gets 404).",
                              value=cache.refused_label_entries)
    yield _by_state(CounterMetricFamily(f"{PREFIX}activation_cache_ended_entries", "Entries that left the cache, "
                                        "by final state.", labels=["state"]), cache.ended)


def _by_state(family, counts: dict[str, int]):
    for state, count in counts.items():
        family.add_metric([state], count)
    return family


def _save_metrics(saves):
    """Adapter versions saved to the adapter directory (none without one)."""
    family = CounterMetricFamily(f"{PREFIX}adapter_saves", "Adapter versions written to the adapter directory, "
                                 "by outcome.", labels=["status"])
    family.add_metric(["ok"], saves.saved if saves else 0)
    family.add_metric(["failed"], saves.failed if saves else 0)
    yield family
    last = saves.last_saved_version if saves else None
    yield GaugeMetricFamily(f"{PREFIX}adapter_saved_version", "Latest adapter version saved to disk (-1: none; with "
                            "replicas, only rank 0 saves and reports it).",
                            value=-1 if last is None else last)


def _gate_metrics(stats, gate, ledger):
    """Rollbacks and quarantined labels, and the eval gate (trainer/eval_gate.py, when there
    is one): its verdicts and the scores of the promoted and the last rejected version."""
    rollbacks = CounterMetricFamily(f"{PREFIX}adapter_rollbacks", "Adapter rollbacks, by reason (manual: the "
                                    "rollback route; eval_gate: a candidate version the eval gate rejected).",
                                    labels=["reason"])
    for reason, count in sorted(stats.rollbacks.items()):
        rollbacks.add_metric([reason], count)
    yield rollbacks
    quarantined = CounterMetricFamily(f"{PREFIX}quarantined_labels", "Labels kept out of training by the "
                                      "rollback that took them out of the weights (eval_gate: a rejected candidate; "
                                      "manual: the rollback route; with a feedback ledger).", labels=["reason"])
    quarantined.add_metric(["eval_gate"], stats.quarantined_labels)
    quarantined.add_metric(["manual"], ledger.rollback_quarantined if ledger is not None else 0)
    yield quarantined
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
                                      "be written, or not within 10 s.", ledger.refused_writes),
            ("ledger_pruned_requests", "Requests pruned from the feedback ledger by retention (age, size).",
             ledger.pruned_requests),
            ("ledger_commit_seconds", "Seconds the feedback ledger's writer spent committing.",
             ledger.commit_seconds)):
        yield CounterMetricFamily(f"{PREFIX}{name}", text, value=value)
    yield GaugeMetricFamily(f"{PREFIX}ledger_retry_backlog", "Queued feedback ledger writes waiting to be retried.",
                            value=ledger.retry_backlog)


def _group_metrics(stats):
    """GRPO: groups and their rewards (a summary: delta(_sum) / increase(_count) is the mean reward over
    time; not rate(_sum), which reads a fall of the sum (negative rewards) as a counter reset)."""
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
    sums = stats.job_metric_sums  # what the trained groups' losses saw, before their steps (TRL's figures)
    yield CounterMetricFamily(f"{PREFIX}grpo_completion_tokens", "Tokens of the trained groups' samples.",
                              value=sums.get("completion_tokens", 0.0))
    yield CounterMetricFamily(f"{PREFIX}grpo_clipped_tokens", "Tokens whose ratio to their served log-prob was "
                              "clipped on the side of their advantage (TRL's clip_ratio/region_mean, over "
                              "grpo_completion_tokens_total): trained off the policy that sampled them.",
                              value=sums.get("clipped_tokens", 0.0))
    yield SummaryMetricFamily(f"{PREFIX}grpo_kl", "KL to the base model per token of the trained groups' samples, "
                              "the loss's estimator (TRL's kl; only with train.grpo_beta > 0).",
                              count_value=sums.get("kl_tokens", 0.0), sum_value=sums.get("kl_sum", 0.0))


def _preference_metrics(stats):
    """DPO: TRL's `rewards/*` figures of each preference trained in an applied step, taken by
    its job before the step (summaries, for the mean over time as the rewards': delta(_sum) /
    increase(_count)), and the preferences it already ranked right (`rewards/accuracies`:
    their increase over the margin's count's)."""
    sums, counts = stats.job_metric_sums, stats.job_metric_counts
    base = "; with train.dpo_reference base)."  # (against the served policy itself they are 0: not counted)
    for name, text in (("reward_margin", "Implicit reward margin β·((policy − reference) of the chosen − of the "
                                         "rejected) of each trained preference, before its step (TRL's "
                                         "rewards/margins"),
                       ("reward_chosen", "Implicit reward β·(policy − reference log-prob) of each trained "
                                         "preference's chosen response, before its step (TRL's rewards/chosen"),
                       ("reward_rejected", "Implicit reward β·(policy − reference log-prob) of each trained "
                                           "preference's rejected response, before its step (TRL's "
                                           "rewards/rejected")):
        yield SummaryMetricFamily(f"{PREFIX}dpo_{name}", text + base, count_value=counts.get(name, 0),
                                  sum_value=sums.get(name, 0.0))
    yield CounterMetricFamily(f"{PREFIX}dpo_ranked_right", "Trained preferences whose chosen response's implicit "
                              "reward was already above the rejected one's before their step (TRL's "
                              "rewards/accuracies, over dpo_reward_margin_count" + base,
                              value=sums.get("accuracy", 0.0))


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
                                  "never-freed tensors were left)."),
            ("rerun_training_layers", "Layers of training forwards (a recomputation's, a prompt's cached "
                                      "beginning's) run again in backward from their kept input, their graphs not "
                                      "fitting the device budget.")):
        yield CounterMetricFamily(f"{PREFIX}{name}", text, value=getattr(offload, name))
    yield CounterMetricFamily(f"{PREFIX}reload_wait_seconds", "Seconds backward waited for reloads (not hidden "
                              "behind compute).", value=offload.reload_wait_seconds)
