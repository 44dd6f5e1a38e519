"""The online trainer: records what the engine serves, takes feedback, trains in slices.

It is the engine's `PrefillRecorder` (recorded prefills become cache entries) and an
`EngineObserver` (finished responses complete their entries). `run_slice()` is called
on the engine's worker thread whenever the engine has nothing runnable; each call does
one bounded slice of the current job (a layer's forward or backward, a loss, or the
optimizer step), so a newly arrived request waits for at most one slice.

Adapter versions: every optimizer step bumps the version. An entry recorded under an
older version is never back-propagated: it goes to the recompute path, or is dropped
(`stale_policy`), and `stale_entries` counts it.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from engine.malloc_tuning import return_freed_memory
from trainer.config import TrainConfig
from engine.llm_engine import LLMEngine, StepStats
from engine.outputs import RequestOutput
from engine.recording import RecordedPrefill, RecordSpec
from offload.build import build_offloader
from trainer.adapter import attach_lora, lora_parameters, merge_stale
from trainer.adapter_store import AdapterCheckpointer, AdapterSnapshot
from trainer.cache import ActivationCache, CacheEntry, EntryState, PreferenceLabel
from trainer.forward import recompute_segment
from trainer.methods import CPTMethod, DPOMethod, JobResult, TrainContext, TrainingMethod
from trainer.optimizer import AdapterOptimizer

logger = logging.getLogger(__name__)

# released activation bytes after which an idle slice returns freed memory to the OS
_TRIM_AFTER_BYTES = 64 << 20
# how often serving steps check label timeouts
_EXPIRY_EVERY_S = 0.5
SLICE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, math.inf)


class AdapterMismatchError(ValueError):
    """A saved adapter does not fit the configured one (rank, alpha, target modules)."""


class FeedbackError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


@dataclass
class TrainingStats:
    # (mode, path) -> entries trained
    trained_entries: dict[tuple[str, str], int] = field(default_factory=dict)
    train_tokens: int = 0
    last_loss: float = math.nan
    stale_entries: int = 0
    # stale entries dropped instead of recomputed (stale_policy = drop)
    stale_dropped: int = 0
    # feedback status -> count
    feedback: dict[str, int] = field(default_factory=dict)
    failed_jobs: int = 0
    # slices run, their total seconds, and a histogram of their durations (bucket upper bounds)
    slices: int = 0
    busy_seconds: float = 0.0
    max_slice_seconds: float = 0.0
    slice_buckets: dict[float, int] = field(default_factory=lambda: {b: 0 for b in SLICE_BUCKETS})
    # times a job was interrupted by serving and resumed where it stopped
    preemptions: int = 0
    recorded: int = 0
    # requests selected but not recorded: cache full or prompt too long
    not_recorded: int = 0
    # idle slices that returned freed host memory to the OS
    memory_trims: int = 0


@dataclass
class _Job:
    entries: list[CacheEntry]
    # the generator of the entry being worked on, and which path it takes
    current: object = None
    path: str = ""
    index: int = 0
    results: list[JobResult] = field(default_factory=list)
    # the path each finished entry took
    paths: list[str] = field(default_factory=list)


class Trainer:
    def __init__(self, engine: LLMEngine, config: TrainConfig, method: TrainingMethod | None = None,
                 init_lora_weights: bool | str = True):
        if config.mode == "off" and method is None:
            raise ValueError("the trainer needs train.mode cpt or dpo (or a custom method)")
        self.engine = engine
        self.config = config
        self.tokenizer = engine.tokenizer
        self.method = method or (CPTMethod() if config.mode == "cpt" else DPOMethod(config.dpo_beta))
        self.mode = self.method.name
        self.peft_model = attach_lora(engine.model, config, init_lora_weights)
        self.context = TrainContext(engine.runner, self.peft_model)
        self.optimizer = AdapterOptimizer(lora_parameters(self.peft_model), config.learning_rate,
                                          config.max_grad_norm)
        self.cache = ActivationCache(config.cache_bytes, config.cache_full_policy, config.label_timeout_s)
        self.stats = TrainingStats()
        self._rng = random.Random(config.seed)
        self._rng_lock = threading.Lock()
        self._job: _Job | None = None
        self._engine_steps_at_last_slice = 0
        self._last_expiry = 0.0
        self._released_at_last_trim = 0
        # merged serving weights are built now (nobody is waiting yet) and rebuilt in idle
        # slices after every optimizer step
        self._merge_pending = False
        self._merge_all()
        # with merged serving, decode never touches the base layers' packed weights; pack
        # them now rather than in the first recorded prefill
        for module in engine.model.modules():
            if hasattr(module, "ensure_packed"):
                module.ensure_packed()
        self.offloader = None
        if engine.config.offload.device_budget_bytes > 0:
            self.offloader = build_offloader(engine.model, engine.config.offload, engine.max_model_len,
                                             functools.partial(recompute_segment, engine.runner))
            self.optimizer.zero_grad()  # calibration ran a backward
            engine.runner.segment_sink = engine.memory_guard = self.context.offloader = self.offloader
        # completion id -> choice index -> served token ids, for recorded requests in flight
        self._responses: dict[str, dict[int, list[int]]] = {}
        # completion id -> choice index -> cumulative log-prob of the served tokens
        self._served_logps: dict[str, dict[int, float]] = {}
        # measured bytes per recorded prompt token (to predict whether a recording fits)
        self._bytes_per_token: float | None = None
        self.checkpointer: AdapterCheckpointer | None = None
        # the saved version the adapter was last restored from (resume or rollback)
        self.restored_from: int | None = None
        engine.recorder = self

    def _merge_all(self) -> None:
        if self.config.merged_serving:
            while merge_stale(self.peft_model, budget_s=1.0):
                pass

    # -- selection (HTTP thread) ---------------------------------------------------------

    def record_spec(self, num_prompt_tokens: int, train: bool) -> RecordSpec | None:
        """Whether to record a new request's prefill, and how."""
        if not train:
            return None
        with self._rng_lock:
            if self._rng.random() >= self.config.record_fraction:
                return None
        expected = (self._bytes_per_token or 0.0) * num_prompt_tokens
        if num_prompt_tokens > self.config.max_record_tokens or not self.cache.has_room_for(int(expected)):
            self.stats.not_recorded += 1
            return None
        return self.method.record_spec()

    # -- engine callbacks (worker thread) ------------------------------------------------

    def adapter_version(self) -> int:
        return self.optimizer.version

    def on_recorded(self, request_id: str, recording: RecordedPrefill) -> None:
        self._bytes_per_token = recording.saved_bytes / max(len(recording.prompt_token_ids), 1)
        entry = self.method.make_entry(request_id, recording)
        if self.cache.add(entry):
            self.stats.recorded += 1
            self._responses[request_id] = {}
        else:
            self.stats.not_recorded += 1

    def on_record_refused(self, request_id: str) -> None:
        """The offloader had no room for the recording's never-freed tensors."""
        self.stats.not_recorded += 1

    def on_step(self, stats: StepStats) -> None:
        # label timeouts come due under steady load too, when no idle slice runs to expire them
        now = time.monotonic()
        if now - self._last_expiry >= _EXPIRY_EVERY_S:
            self._last_expiry = now
            self.cache.expire()

    def on_output(self, output: RequestOutput) -> None:
        responses = self._responses.get(output.request_id)
        if responses is None:
            return
        logps = self._served_logps.setdefault(output.request_id, {})
        for completion in output.outputs:
            responses.setdefault(completion.index, []).extend(completion.token_ids)
            if completion.cumulative_logprob is not None:
                logps[completion.index] = completion.cumulative_logprob
        if output.finished:
            del self._responses[output.request_id]
            del self._served_logps[output.request_id]
            aborted = all(c.finish_reason == "abort" for c in output.outputs)
            self.cache.response_finished(output.request_id, responses, aborted, logps)

    # -- feedback (HTTP thread) ----------------------------------------------------------

    def _count_feedback(self, status: str) -> None:
        self.stats.feedback[status] = self.stats.feedback.get(status, 0) + 1

    def submit_feedback(self, completion_id: str, chosen: str | None, rejected: str | None,
                        choice_index: int) -> None:
        """Attaches a preference label; raises FeedbackError (status 400/404/409)."""
        try:
            self._submit_feedback(completion_id, chosen, rejected, choice_index)
        except FeedbackError as err:
            self._count_feedback({404: "unknown", 409: "conflict"}.get(err.status, "invalid"))
            raise
        self._count_feedback("accepted")

    def _submit_feedback(self, completion_id, chosen, rejected, choice_index) -> None:
        if not self.method.uses_feedback:
            raise FeedbackError(400, f"feedback is used by preference training; this server trains in "
                                     f"{self.mode!r} mode (start it with --train-mode dpo)", None, "feedback_not_used")
        if chosen is None and rejected is None:
            raise FeedbackError(400, "give at least one of 'chosen' and 'rejected'; the other defaults to the "
                                     "served response", "chosen", "missing_required_parameter")
        with self.cache.lock:
            entry = self.cache.get(completion_id)
            if entry is None:
                ended = self.cache.ended_state(completion_id)
                if ended is EntryState.TRAINED:
                    raise FeedbackError(409, f"completion {completion_id!r} already has its label and was "
                                             "trained on", "id", "label_exists")
                reason = "it expired (no feedback within the label timeout)" if ended is EntryState.EXPIRED \
                    else "it is unknown, was not recorded for training, or was evicted"
                raise FeedbackError(404, f"no training entry for completion {completion_id!r}: {reason}", "id",
                                    "entry_not_found")
            if getattr(entry, "label", None) is not None:
                raise FeedbackError(409, f"completion {completion_id!r} already has its label", "id",
                                    "label_exists")
            served = None
            if chosen is None or rejected is None:
                if not entry.response_finished:
                    raise FeedbackError(409, f"completion {completion_id!r} is still being generated; send both "
                                             "'chosen' and 'rejected', or wait for it to finish", "id",
                                        "response_pending")
                if choice_index not in entry.responses:
                    raise FeedbackError(400, f"choice_index {choice_index} does not exist; the completion has "
                                             f"choices {sorted(entry.responses)}", "choice_index", "invalid_value")
                served = list(entry.responses[choice_index])
                if not served:
                    raise FeedbackError(400, "the served response is empty; give both 'chosen' and 'rejected'",
                                        "id", "invalid_value")
            chosen_ids = self._response_ids(chosen) if chosen is not None else served
            rejected_ids = self._response_ids(rejected) if rejected is not None else served
            if chosen_ids == rejected_ids:
                raise FeedbackError(400, "'chosen' and 'rejected' are the same response", "chosen",
                                    "invalid_value")
            limit = self.engine.max_model_len - len(entry.prompt_token_ids)
            for name, ids in (("chosen", chosen_ids), ("rejected", rejected_ids)):
                if len(ids) > limit:
                    raise FeedbackError(400, f"'{name}' is {len(ids)} tokens; at most {limit} fit after the "
                                             "prompt", name, "context_length_exceeded")
            entry.label = PreferenceLabel(chosen_ids, rejected_ids)
            if served is not None and choice_index in entry.served_logps:
                side = "rejected" if rejected is None else "chosen"
                entry.label.served_logps[side] = entry.served_logps[choice_index]
            if entry.state is EntryState.WAITING_LABEL:
                entry.state = EntryState.READY

    def _response_ids(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        return ids + ([eos] if eos is not None else [])

    # -- training (worker thread) --------------------------------------------------------

    def has_work(self) -> bool:
        return self._job is not None or self._merge_pending or self.cache.count(EntryState.READY) > 0

    def serving_maintenance_pending(self) -> bool:
        return self._merge_pending

    def run_serving_maintenance(self, budget_s: float) -> bool:
        """Rebuilds stale merged serving weights for about `budget_s` (between serving
        steps); False when they are all current."""
        if self._merge_pending and merge_stale(self.peft_model, budget_s):
            return True
        self._merge_pending = False
        return False

    def run_slice(self) -> bool:
        """One bounded slice of training; False if there was nothing to do."""
        started = time.perf_counter()
        in_progress = self._job is not None or self._merge_pending
        if in_progress and self.engine.num_steps != self._engine_steps_at_last_slice:
            self.stats.preemptions += 1  # serving ran in between; the job resumes here
        worked = self._run_slice()
        self._engine_steps_at_last_slice = self.engine.num_steps
        if worked:
            seconds = time.perf_counter() - started
            self.stats.slices += 1
            self.stats.busy_seconds += seconds
            self.stats.max_slice_seconds = max(self.stats.max_slice_seconds, seconds)
            bucket = next(b for b in SLICE_BUCKETS if seconds <= b)
            self.stats.slice_buckets[bucket] += 1
        return worked

    def _run_slice(self) -> bool:
        self.cache.expire()
        if self._job is None and self._merge_pending:
            if merge_stale(self.peft_model):
                return True  # serving speed first: merged weights are rebuilt before the next job
            self._merge_pending = False
        if self._job is None:
            if self._return_freed_memory():  # between jobs: RSS follows the live activations
                return True
            entries = self.cache.take_ready(self.config.entries_per_step)
            if not entries:
                return False
            self._job = _Job(entries)
        job = self._job
        try:
            if job.current is None:
                if job.index == len(job.entries):
                    self._finish_job(job)
                    return True
                entry = job.entries[job.index]
                job.current, job.path = self._start(entry)
                if job.current is None:  # stale and dropped
                    job.index += 1
                    return True
            try:
                next(job.current)
            except StopIteration as stop:
                job.results.append(stop.value)
                job.paths.append(job.path)
                job.current = None
                job.index += 1
        except Exception:  # noqa: BLE001 - a failed job must not stop serving
            logger.exception("training job failed; dropping its entries")
            self.stats.failed_jobs += 1
            self.optimizer.zero_grad()
            for entry in job.entries:
                self.cache.end(entry, EntryState.DROPPED)
            self._job = None
        return True

    def _return_freed_memory(self) -> bool:
        """An idle slice that gives freed activation memory back to the OS, once enough
        was released since the last one (engine/malloc_tuning.py)."""
        if self.cache.released_bytes - self._released_at_last_trim < _TRIM_AFTER_BYTES:
            return False
        self._released_at_last_trim = self.cache.released_bytes
        if return_freed_memory():
            self.stats.memory_trims += 1
        return True

    def _start(self, entry: CacheEntry):
        """(job generator, path) for an entry; stale entries go to recompute or are dropped."""
        if entry.adapter_version != self.optimizer.version:
            self.stats.stale_entries += 1
            entry.release()  # never back-propagate a graph recorded under other weights
            if self.config.stale_policy == "drop":
                self.stats.stale_dropped += 1
                self.cache.end(entry, EntryState.DROPPED)
                return None, ""
            return self.method.recompute_job(entry, self.context), "recompute"
        return self.method.reuse_job(entry, self.context), "reuse"

    def _finish_job(self, job: _Job) -> None:
        losses = [r.loss for r in job.results]
        finite = all(math.isfinite(v) for v in losses)
        if job.results:
            if self.optimizer.step(loss_is_finite=finite):
                self.cache.release_stale(self.optimizer.version)
                if self.checkpointer is not None and self.checkpointer.due(self.optimizer.version):
                    self.checkpointer.save_async(self.snapshot())
            self._merge_pending = self.config.merged_serving
            self.stats.last_loss = sum(losses) / len(losses)
            self.stats.train_tokens += sum(r.tokens for r in job.results)
            for path in job.paths:
                key = (self.mode, path)
                self.stats.trained_entries[key] = self.stats.trained_entries.get(key, 0) + 1
        for entry in job.entries:
            if entry.state is EntryState.TRAINING:
                self.cache.end(entry, EntryState.TRAINED)
        self._job = None

    # -- adapter versions on disk (device thread) -------------------------------------

    def enable_checkpoints(self, checkpointer: AdapterCheckpointer) -> None:
        """Resumes from the latest good saved version, if any (else saves version 0, so
        there is always a version to roll back to); from then on saves every
        `save_every` versions. Call before serving starts."""
        snapshot = checkpointer.store.latest()
        if snapshot is not None:
            self.restore(snapshot, snapshot.version)
            self._merge_all()
            self._merge_pending = False
            logger.info("resumed adapter version %d from %s", snapshot.version, checkpointer.store.root)
        else:
            checkpointer.save_async(self.snapshot()).result()
        self.checkpointer = checkpointer

    def snapshot(self) -> AdapterSnapshot:
        from peft import get_peft_model_state_dict

        weights = {k: v.detach().to("cpu", copy=True) for k, v in get_peft_model_state_dict(self.peft_model).items()}
        trained = sum(self.stats.trained_entries.values())
        return AdapterSnapshot(self.optimizer.version, weights, self.peft_model.peft_config["default"],
                               self.optimizer.state_dict(),
                               {"mode": self.mode, "restored_from": self.restored_from,
                                "trained_entries": trained, "train_tokens": self.stats.train_tokens})

    def restore(self, snapshot: AdapterSnapshot, version: int) -> None:
        """Loads `snapshot` into the live adapter as adapter `version`. A job in progress is
        abandoned: its gradients are discarded and its entries go back in line (recorded
        under other weights, they take the recompute path)."""
        from peft import get_peft_model_state_dict

        live = get_peft_model_state_dict(self.peft_model)
        self._check_compatible(snapshot, live)
        self._abandon_job()
        with torch.no_grad():
            for name, tensor in live.items():
                tensor.copy_(snapshot.weights[name])
        self.optimizer.load_state_dict(snapshot.optimizer_state, version)
        self.cache.release_stale(version)
        self.restored_from = snapshot.version
        self._merge_pending = self.config.merged_serving

    def rollback(self, snapshot: AdapterSnapshot) -> int:
        """Makes the saved `snapshot` the live adapter. Versions only go forward: the
        rolled-back adapter is a new version (saved at once), so nothing recorded under
        the weights being replaced is mistaken for current."""
        version = self.optimizer.version + 1
        self.restore(snapshot, version)
        if self.checkpointer is not None:
            self.checkpointer.save_async(self.snapshot())
        logger.info("rolled the adapter back to saved version %d (now version %d)", snapshot.version, version)
        return version

    def close(self) -> None:
        """At shutdown (after the engine stopped): saves the final version."""
        if self.offloader is not None:
            self.offloader.close()
        if self.checkpointer is not None:
            final = self.snapshot() if self.checkpointer.last_saved_version != self.optimizer.version else None
            self.checkpointer.close(final)

    def _check_compatible(self, snapshot: AdapterSnapshot, live: dict) -> None:
        ours = self.peft_model.peft_config["default"]
        theirs = snapshot.peft_config
        problems = [f"{name} {getattr(theirs, name)} (configured: {getattr(ours, name)})"
                    for name in ("r", "lora_alpha") if getattr(theirs, name) != getattr(ours, name)]
        if set(theirs.target_modules or ()) != set(ours.target_modules or ()):
            problems.append(f"target modules {sorted(theirs.target_modules)} (configured: "
                            f"{sorted(ours.target_modules)})")
        if not problems:
            if set(snapshot.weights) != set(live):
                problems.append("its weights name other layers")
            else:
                problems += [f"{k} has shape {tuple(snapshot.weights[k].shape)}, expected {tuple(v.shape)}"
                             for k, v in live.items() if snapshot.weights[k].shape != v.shape]
        if problems:
            raise AdapterMismatchError(f"saved adapter version {snapshot.version} does not fit this model and "
                                       f"configuration: {'; '.join(problems[:3])}. Use another adapter directory "
                                       "or match the configuration.")

    def _abandon_job(self) -> None:
        job, self._job = self._job, None
        if job is None:
            return
        if job.current is not None:
            job.current.close()
        self.optimizer.zero_grad()
        for entry in job.entries:
            self.cache.requeue(entry)

    def train_until_idle(self, timeout_s: float = 600.0) -> None:
        """Runs slices until nothing is ready (tests, benchmarks, offline use)."""
        deadline = time.monotonic() + timeout_s
        while self.run_slice():
            if time.monotonic() > deadline:
                raise TimeoutError("training did not finish in time")
