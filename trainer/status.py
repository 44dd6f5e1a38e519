"""The trainer's counters, and the snapshot of its state that `/metrics` and
`/v1/adapters` read: nothing outside the trainer reads its parts.

`TrainingStats` is written on the device thread (jobs, recordings), on feedback worker
threads and on reward threads: every writer holds its `lock`, and `copy()` takes it, so a
copy is consistent."""

from __future__ import annotations

import dataclasses
import math
import threading
from dataclasses import dataclass, field

SLICE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)


@dataclass
class TrainingStats:
    # (mode, path) -> entries trained
    trained_entries: dict[tuple[str, str], int] = field(default_factory=dict)
    train_tokens: int = 0
    last_loss: float = math.nan
    stale_entries: int = 0
    # stale entries dropped instead of recomputed (stale_policy = drop)
    stale_dropped: int = 0
    # feedback outcome ("accepted", "invalid", "unknown", "conflict") -> count
    feedback: dict[str, int] = field(default_factory=dict)
    failed_jobs: int = 0
    # slices run, their total seconds, and a histogram of their durations (bucket upper bounds)
    slices: int = 0
    busy_seconds: float = 0.0
    max_slice_seconds: float = 0.0
    # what the longest slice was ("dpo reuse job", "optimizer step", "housekeeping", ...)
    max_slice_item: str = ""
    slice_buckets: dict[float, int] = field(default_factory=lambda: {b: 0 for b in SLICE_BUCKETS})
    # times a job was interrupted by serving and resumed where it stopped
    preemptions: int = 0
    recorded: int = 0
    # their prompts' tokens: recorded (a graph kept), and read from the prefix cache (the
    # tokens before those, which their jobs recompute)
    recorded_prompt_tokens: int = 0
    recorded_cached_tokens: int = 0
    # requests selected but not recorded: cache full, prompt too long, no room on the device
    not_recorded: int = 0
    # idle slices that returned freed host memory to the OS
    memory_trims: int = 0
    # versions between serving and training (current - served) -> entries trained
    staleness: dict[int, int] = field(default_factory=dict)
    # GRPO: groups whose rewards arrived (posted or computed), the rewards in them and their
    # sum, the latest group's mean, groups whose rewards were all equal (not trained), and
    # reward function calls that failed (their groups dropped)
    rewarded_groups: int = 0
    rewards_received: int = 0
    reward_sum: float = 0.0
    last_group_mean_reward: float = math.nan
    zero_advantage_groups: int = 0
    reward_errors: int = 0
    # the jobs' own figures besides the loss (`JobResult.metrics`; DPO's, TRL's implicit rewards,
    # their margin and accuracy), summed over the entries of applied steps, and those entries
    job_metric_sums: dict[str, float] = field(default_factory=dict)
    job_metric_counts: dict[str, int] = field(default_factory=dict)
    # adapter rollbacks by reason ("manual": the rollback route; "eval_gate": a rejected
    # candidate), and labels quarantined by the gate
    rollbacks: dict[str, int] = field(default_factory=lambda: {"manual": 0, "eval_gate": 0})
    quarantined_labels: int = 0
    # held by every writer (and by `copy`)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def copy(self) -> "TrainingStats":
        """A consistent copy: no writer is half-way through an update."""
        with self.lock:
            values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "lock"}
            return TrainingStats(**{k: dict(v) if isinstance(v, dict) else v for k, v in values.items()})


@dataclass(frozen=True)
class CacheStatus:
    # bytes of recorded activations the activation cache holds
    bytes: int
    # live entries by state ("waiting_label", "ready", "training")
    entries: dict[str, int]
    # entries that left the cache, by final state
    ended: dict[str, int]
    # live entries without activations (labels that train by recomputation), and those
    # refused at train.max_label_entries
    label_entries: int = 0
    refused_label_entries: int = 0
    # bytes of recorded activations it may hold (train.cache_bytes, or sized at start)
    budget_bytes: int = 0


@dataclass(frozen=True)
class SaveStatus:
    adapter_dir: str
    save_every: int
    # saves that succeeded and failed, and the latest version on disk (None: none yet)
    saved: int
    failed: int
    last_saved_version: int | None


@dataclass(frozen=True)
class OffloadStatus:
    # recorded activation bytes on the device (by the offloader's accounting, or the
    # cache's bytes without an offloader) and in the host pool
    device_bytes: int
    host_bytes: int
    offloaded_layers: int = 0
    dropped_layers: int = 0
    reloaded_layers: int = 0
    recomputed_layers: int = 0
    over_budget_steps: int = 0
    reload_wait_seconds: float = 0.0
    # layers of training forwards run again in backward (their graphs not fitting)
    rerun_training_layers: int = 0


@dataclass(frozen=True)
class GateStatus:
    # the version being scored (None: none)
    candidate_version: int | None
    # the last promoted version's scores, and the last rejected one's with why
    last_promoted: dict | None
    last_rejected: dict | None
    evaluations: int
    eval_seconds: float
    promoted: int
    rejected: int


@dataclass(frozen=True)
class TrainerStatus:
    # cpt | dpo | grpo | a custom method's name
    mode: str
    # the adapter version serving (optimizer steps applied, rollbacks included; with an
    # eval gate, the last promoted)
    adapter_version: int
    # the saved version the adapter was last restored from (resume or rollback)
    restored_from: int | None
    # optimizer steps skipped for a non-finite loss or gradient
    skipped_steps: int
    # a copy of the counters
    training: TrainingStats
    cache: CacheStatus
    offload: OffloadStatus
    # None when adapters are not saved (no adapter directory)
    saves: SaveStatus | None
    # adapter versions whose weights are stashed for stale recordings, and their bytes
    stashed_versions: list[int] = dataclasses.field(default_factory=list)
    stash_bytes: int = 0
    # a copy of the feedback ledger's counters (trainer/ledger.py); None without a ledger
    ledger: object | None = None
    # None without an eval gate
    gate: GateStatus | None = None
    # heap held pre-faulted for the next recording (engine.malloc_tuning.HeapWarmer)
    warm_heap_bytes: int = 0


@dataclass(frozen=True)
class Forgotten:
    """What deleting a completion's data deleted (`OnlineTraining.forget`)."""

    # whether the server kept anything of the completion (ledger rows or a cache entry)
    found: bool
    # its entries being trained, which `OnlineTraining.withdraw_from_training` withdraws
    training: list[str]
    # the first adapter version holding a deleted label that had already trained (its effect
    # stays in the weights until a rollback to a version before); None: none had
    trained_into: int | None = None
    # nothing was found but the completion is still being generated (its request is written
    # once it finishes, where it is not recorded): deleting it now would delete nothing
    pending: bool = False
