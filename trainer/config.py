"""The trainer's configuration: training (`[train]`), the arbiter (`[arbiter]`), the
adapter's directory (`[adapter]`) and the feedback ledger (`[ledger]`), one frozen
dataclass each (assembled in server/config.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from engine.config import check_positive
from trainer.cache import FULL_POLICIES


TRAIN_MODES = ("off", "cpt", "dpo", "grpo")
DPO_REFERENCES = ("base", "served")


# `max_staleness = -1`: recordings this many versions stale train on them, up to this learning rate
_STALENESS_BY_RATE = ((3e-4, 8), (float("inf"), 1))


def staleness_for(learning_rate: float) -> int:
    """The staleness a learning rate tolerates, as measured (BENCHMARKS.md, "Stale
    recordings re-aimed at today's weights"): at 1e-3 and more a burst trained on
    recordings several versions stale learnt under half what strict recomputation did."""
    return next(staleness for rate, staleness in _STALENESS_BY_RATE if learning_rate <= rate)


@dataclass(frozen=True)
class TrainConfig:
    # off | cpt (continual pre-training on prompts) | dpo (preference alignment from feedback)
    # | grpo (groups of n >= 2 samples of a prompt, from a reward per sample)
    mode: str = "off"
    learning_rate: float = 1e-4
    # LoRA rank (the paper's 8), scale alpha, and modules; empty: every linear layer of the decoder
    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = ()
    # DPO sigmoid loss temperature
    dpo_beta: float = 0.1
    # DPO's reference model: base (the model without the adapter: an extra forward per
    # entry) or served (the adapter version that served the prompt, TR-DPO style: no extra
    # forward; anchored to the current policy rather than the base model)
    dpo_reference: str = "base"
    # GRPO: weight of the KL to the base model (0, as in current practice: no reference
    # forward), and the clip range of the probability ratio to the served log-probs
    grpo_beta: float = 0.0
    grpo_clip_eps: float = 0.2
    # GRPO: rewards computed in the server, "package.module:function" called with the
    # prompt (messages or text) and the n response texts, returning n numbers
    # (trainer/rewards.py); "" waits for POST /v1/feedback {"rewards": [...]}
    reward_function: str = ""
    # a reward function call that takes longer drops its group (counted as an error)
    reward_timeout_s: float = 30.0
    # an entry waiting for feedback (dpo: a preference, grpo: rewards) whose label has not
    # arrived this many seconds after the response is evicted
    label_timeout_s: float = 300.0
    # bytes of recorded activations the activation cache may hold; 0: sized at start to
    # the device (trainer/cache_budget.py: half the GPU memory then free; 2 GiB on the CPU)
    cache_bytes: int = 0
    # when a new recording does not fit (trainer/cache.py): unlabelled_give_way (the oldest
    # recordings still waiting for a label give way; labelled ones keep theirs), drop_new
    # (the paper's: the new one is not kept), evict_oldest. Measured in BENCHMARKS.md,
    # "Training: delayed gradients and grouped steps" (`alchemist bench colocate`)
    cache_full_policy: str = "unlabelled_give_way"
    # host memory (MiB) freed by recordings and jobs that a pause in recording keeps for
    # the next one, on the CPU (trainer/maintenance.py): a pause gives memory back to the
    # OS only beyond it, an idle server all of it; 0: every pause (10 s without a
    # recording, not scaled to the traffic's gaps) gives it back
    trim_slack_mib: int = 256
    # fraction of requests whose prefill is recorded (1: every request)
    record_fraction: float = 1.0
    # prompts that would record more tokens than this (those after the beginning the prefix
    # cache holds, where the method reads one) are served but not recorded
    max_record_tokens: int = 2048
    # entries waiting for a label without activations (they train by recomputation) kept
    # at most; past it a new one is refused, logged and counted (refused_label_entries)
    max_label_entries: int = 10_000
    # an entry recorded under an adapter version at most this many versions old trains
    # on its recording, through that version's stashed weights (trainer/stash.py); 0:
    # never; -1: by the learning rate, 8 up to 3e-4 and 1 above, where stale gradients
    # learnt much less than fresh ones. Measured in BENCHMARKS.md, "Training: delayed
    # gradients and grouped steps" and "Stale recordings re-aimed at today's weights"
    # (`alchemist bench staleness`, `alchemist bench backlog`)
    max_staleness: int = -1
    # an entry recorded under an older version than that: recompute it, or drop it
    stale_policy: str = "recompute"
    # the LoRA weights a recording up to max_staleness versions old trains with: "stashed",
    # its own version's (its exact gradient, applied late); "live", the current ones (the
    # recording's activations, its LoRA products re-aimed at today's weights: a fresh
    # adapter's A, whose gradient is zero while B is, learns from stale recordings too)
    stale_weights: str = "live"
    # rows of the LM head (vocabulary-wide logits) run forward and backward per training
    # slice: bounds the longest slice a new request can wait for (measured in
    # BENCHMARKS.md, "Training: CPT" and "Training: DPO"). More on a GPU.
    head_chunk_rows: int = 64
    # DPO's responses, or a GRPO group in one batch, back-propagate layer by layer with
    # their prompt in one top-down sweep, each layer of both freed as it passes; false,
    # and always with a device budget (offload): the suffixes' sweep, then the prompt's
    # (BENCHMARKS.md, "One backward sweep for suffixes and prompt")
    one_backward_sweep: bool = True
    # a recorded prefill reads the prompt's beginning from the prefix cache and records the
    # rest; its job recomputes that beginning (the methods that can: CPT, DPO, GRPO). False:
    # every recorded prefill computes its whole prompt, whatever the cache holds
    record_after_cached_prefix: bool = True
    # gradient clipping (max global norm over LoRA parameters)
    max_grad_norm: float = 1.0
    # entries per AdamW update, and at most this many entries trained by recomputation
    # share one optimizer step (the step's learning rate scales with the entries it
    # holds). Its reuse share and learning per label are measured in BENCHMARKS.md,
    # "Training: delayed gradients and grouped steps" (`alchemist bench colocate`,
    # `alchemist bench staleness`)
    entries_per_step: int = 4
    # recordings of one adapter version (a cohort) share one optimizer step, up to this
    # many (4, entries_per_step: none do beyond a step's): the step is applied as one
    # AdamW update per `entries_per_step` of them. With stashed stale weights a cohort
    # keeps a backlog on its recordings; with live ones, steps of entries_per_step do and
    # learn more (BENCHMARKS.md, "Reuse under a backlog", "Stale recordings re-aimed at
    # today's weights")
    cohort_max_entries: int = 4
    # seed for the adapter's initialization and the record-fraction draw
    seed: int = 0
    # on CPU, serve through merged (base + adapter) weights, rebuilt in idle slices after
    # each optimizer step: training mode then serves as fast as no adapter, for one more
    # copy of the adapted weights in memory
    merged_serving: bool = True
    # the eval gate (trainer/eval_gate.py): a JSONL file of probes; each new adapter version
    # serves only once scored on them without a probe kind's mean score falling more than
    # eval_tolerance nats below the last promoted version's (and, when eval_max_kl > 0, with
    # its KL to the base model over recently trained prompts under eval_max_kl). "": no gate
    eval_set: str = ""
    eval_tolerance: float = 0.5
    eval_max_kl: float = 0.0
    # recently trained prompts (with their served responses) the KL is measured on
    eval_kl_prompts: int = 4
    # the LoRA math of recorded and training forwards: "model", in the model's dtype with
    # float32 master weights and optimizer state (mixed precision, trainer/training_copy.py;
    # the same as float32 on a float32 model), or "float32", PEFT's casts at every layer
    lora_compute_dtype: str = "model"

    def __post_init__(self) -> None:
        if self.mode not in TRAIN_MODES:
            raise ValueError(f"train.mode must be one of {TRAIN_MODES}, got {self.mode!r}")
        if self.cache_full_policy not in FULL_POLICIES:
            raise ValueError(f"train.cache_full_policy must be one of {FULL_POLICIES}, got {self.cache_full_policy!r}")
        if not isinstance(self.max_staleness, int) or self.max_staleness < -1:
            raise ValueError(f"train.max_staleness must be a non-negative integer or -1 (by the learning rate), "
                             f"got {self.max_staleness!r}")
        if self.dpo_reference not in DPO_REFERENCES:
            raise ValueError(f"train.dpo_reference must be one of {DPO_REFERENCES}, got {self.dpo_reference!r}")
        if self.lora_compute_dtype not in ("model", "float32"):
            raise ValueError(f"train.lora_compute_dtype must be model or float32, got {self.lora_compute_dtype!r}")
        if self.stale_weights not in ("stashed", "live"):
            raise ValueError(f"train.stale_weights must be stashed or live, got {self.stale_weights!r}")
        if self.stale_policy not in ("recompute", "drop"):
            raise ValueError(f"train.stale_policy must be recompute or drop, got {self.stale_policy!r}")
        if not 0.0 <= self.record_fraction <= 1.0:
            raise ValueError(f"train.record_fraction must be in [0, 1], got {self.record_fraction}")
        if not self.grpo_beta >= 0:
            raise ValueError(f"train.grpo_beta must be >= 0, got {self.grpo_beta}")
        if not 0 < self.grpo_clip_eps < 1:
            raise ValueError(f"train.grpo_clip_eps must be in (0, 1), got {self.grpo_clip_eps}")
        if self.reward_function and self.mode != "grpo":
            raise ValueError(f"train.reward_function is used by train.mode grpo, not {self.mode!r}")
        for name in ("learning_rate", "dpo_beta", "label_timeout_s", "max_grad_norm", "reward_timeout_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"train.{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 <= self.eval_tolerance < math.inf or not 0 <= self.eval_max_kl < math.inf:
            raise ValueError("train.eval_tolerance and train.eval_max_kl must be finite and >= 0")
        if self.eval_set and self.mode == "off":
            raise ValueError("train.eval_set gates the versions training makes; training is off")
        if not isinstance(self.cache_bytes, int) or self.cache_bytes < 0:
            raise ValueError(f"train.cache_bytes must be a non-negative integer (0: sized to the device), "
                             f"got {self.cache_bytes!r}")
        if not isinstance(self.trim_slack_mib, int) or self.trim_slack_mib < 0:
            raise ValueError(f"train.trim_slack_mib must be a non-negative integer, got {self.trim_slack_mib!r}")
        for name in ("lora_rank", "lora_alpha", "max_record_tokens", "entries_per_step",
                     "cohort_max_entries", "max_label_entries", "head_chunk_rows", "eval_kl_prompts"):
            check_positive(self, name)
        if self.cohort_max_entries < self.entries_per_step:
            raise ValueError(f"train.cohort_max_entries ({self.cohort_max_entries}) must be at least "
                             f"train.entries_per_step ({self.entries_per_step})")
        if isinstance(self.target_modules, str) or not all(isinstance(m, str) and m for m in self.target_modules):
            raise ValueError(f"train.target_modules must be a list of module names (e.g. [\"q_proj\", \"v_proj\"]), "
                             f"got {self.target_modules!r}")
        object.__setattr__(self, "target_modules", tuple(self.target_modules))
        if self.max_staleness == -1:  # resolved once the learning rate is known to be valid
            object.__setattr__(self, "max_staleness", staleness_for(self.learning_rate))


ARBITER_POLICIES = ("idle", "slo")


@dataclass(frozen=True)
class ArbiterConfig:
    # idle: train only when no request is runnable (the paper's); slo: also between decode
    # steps while the measured time per output token stays under tpot_slo_ms
    policy: str = "idle"
    tpot_slo_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.policy not in ARBITER_POLICIES:
            raise ValueError(f"arbiter.policy must be one of {ARBITER_POLICIES}, got {self.policy!r}")
        if not self.tpot_slo_ms > 0:
            raise ValueError(f"arbiter.tpot_slo_ms must be positive, got {self.tpot_slo_ms}")


@dataclass(frozen=True)
class AdapterConfig:
    # where the adapter is saved (PEFT format, one directory per version); "" keeps it in memory only
    dir: str = ""
    # save every this many adapter versions (and always at shutdown)
    save_every: int = 10
    # saved versions kept on disk (older ones are deleted)
    keep: int = 5
    # with training off: the saved version in `dir` to serve (merged into the weights,
    # frozen); -1 the newest that loads
    version: int = -1
    # with training off: "name=DIR", a PEFT adapter directory made elsewhere, served frozen
    # under `name` (vLLM's --lora-modules, one adapter)
    lora_module: str = ""

    def __post_init__(self) -> None:
        check_positive(self, "save_every", "keep")
        if not isinstance(self.version, int) or self.version < -1:
            raise ValueError(f"adapter.version must be a version number or -1 (the newest), got {self.version!r}")
        if self.lora_module:
            name, _, path = self.lora_module.partition("=")
            if not name or not path:
                raise ValueError(f"adapter.lora_module must be name=DIR, got {self.lora_module!r}")
            if self.dir:
                raise ValueError("adapter.lora_module and adapter.dir serve one adapter each; give one")
        if self.version != -1 and not self.dir:
            raise ValueError(f"adapter.version ({self.version}) names a saved version of adapter.dir "
                             "(--adapter-dir), which is not given")


@dataclass(frozen=True)
class LedgerConfig:
    # keep a ledger in the adapter directory (adapter.dir); without one, labels live in memory only
    enabled: bool = True
    # requests older than this are pruned (with their labels), unless still to be trained
    retention_days: float = 30.0
    # the file is pruned, oldest first, to stay under this; it never grows past it
    max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.retention_days > 0:
            raise ValueError(f"ledger.retention_days must be positive, got {self.retention_days}")
        if not isinstance(self.max_bytes, int) or self.max_bytes < 1 << 20:
            raise ValueError(f"ledger.max_bytes must be an integer of at least 1 MiB, got {self.max_bytes!r}")
