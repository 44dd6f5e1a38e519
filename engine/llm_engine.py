"""The serving engine: continuous batching as schedule -> execute -> update.

`add_request` queues a request (n sequences); each `step()` lets the scheduler pick the
sequences and token counts, the runner compute them, and `_update` append sampled tokens,
detokenize, apply stop conditions and release finished sequences. New requests join at
step boundaries; finished ones leave. Single-threaded by design: the async front end
and, later, the trainer submit work to the one thread that calls `step()`.
"""

from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.kv_cache import KVCacheSpec, blocks_needed
from engine.model_runner import ModelOutput, ModelRunner
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.recording import RecordedPrefill, RecordSpec
from engine.sampler import Sampler
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


class StepMemoryGuard(Protocol):
    """Makes room on the device before each serving step (the activation offloader)."""

    def before_step(self, num_tokens: int, batch_size: int, recorded_tokens: int = 0,
                    max_context: int = 0) -> None: ...

    def after_step(self) -> None: ...

    def admits(self, num_tokens: int) -> bool: ...


class PrefillRecorder(Protocol):
    """Receives recorded prefills (the trainer)."""

    def adapter_version(self) -> int: ...

    def on_recorded(self, request_id: str, recording: RecordedPrefill) -> None: ...

    def on_record_refused(self, request_id: str) -> None: ...


@dataclass
class StepStats:
    # wall time of the whole step
    seconds: float
    num_scheduled_tokens: int
    num_running: int
    num_waiting: int
    kv_usage: float
    # preemptions that happened in this step
    num_preempted: int


class LLMEngine:
    def __init__(self, model, tokenizer, config: EngineConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.max_model_len = config.model.max_model_len
        dtype = next(model.parameters()).dtype
        spec = KVCacheSpec.from_model_config(model.config, dtype, config.cache.block_size)
        num_blocks = spec.num_blocks_for(config.cache.kv_cache_bytes)
        min_blocks = blocks_needed(self.max_model_len, spec.block_size)
        if num_blocks < min_blocks:
            raise ValueError(
                f"cache.kv_cache_bytes={config.cache.kv_cache_bytes} holds {num_blocks * spec.block_size} tokens "
                f"({spec.bytes_per_token} bytes per token); max_model_len={self.max_model_len} needs at least "
                f"{min_blocks * spec.block_size * spec.bytes_per_token} bytes")
        self.kv_spec = spec
        self.eos_token_ids = _eos_token_ids(model, tokenizer)
        self.vocab_size = model.config.vocab_size
        self.runner = ModelRunner(model, spec, num_blocks, Sampler(self.eos_token_ids),
                                  packed_linear=config.model.packed_linear)
        self.scheduler = Scheduler(config.scheduler, num_blocks, spec.block_size)
        self._requests: dict[str, list[Sequence]] = {}
        self._request_meta: dict[str, RequestMetrics] = {}
        self._seq_ids = itertools.count()
        # set by the trainer when training is on
        self.recorder: PrefillRecorder | None = None
        # set by the trainer when an activation device budget is configured
        self.memory_guard: StepMemoryGuard | None = None
        # steps executed so far (the trainer tells from it that serving ran between its slices)
        self.num_steps = 0
        logger.info("KV cache: %d blocks x %d tokens, %d bytes per token, %.1f MiB", num_blocks,
                    spec.block_size, spec.bytes_per_token, self.runner.kv_cache.memory_bytes / 2**20)

    # -- requests ---------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises InvalidParameter for a request this engine can never serve."""
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidParameter("stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise InvalidParameter("logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size})")
        requested = len(prompt_token_ids) + (params.max_tokens or 0)
        if len(prompt_token_ids) >= self.max_model_len or requested > self.max_model_len:
            raise InvalidParameter(
                "max_tokens" if params.max_tokens else "messages",
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{requested} tokens ({len(prompt_token_ids)} in the messages, {params.max_tokens or 0} in the "
                f"completion). Please reduce the length of the messages or completion.")

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, record: RecordSpec | None = None) -> None:
        """`record`: record the prefill of choice 0 for training (see engine/recording.py)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already running")
        self.validate(prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        max_tokens = self.max_model_len - len(prompt_token_ids) if params.max_tokens is None else params.max_tokens
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed((params.seed + index * 1_000_003) % 2**63)
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request_id, index=index,
                prompt_token_ids=list(prompt_token_ids), params=params, max_tokens=max_tokens,
                arrival_time=arrival, generator=generator,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                                   params.include_stop_str_in_output, params.skip_special_tokens),
            )
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            if index == 0:
                seq.record = record
                seq.track_logprob = record is not None
            seqs.append(seq)
            self.scheduler.add(seq)
        self._requests[request_id] = seqs
        self._request_meta[request_id] = RequestMetrics(arrival, None, None, len(prompt_token_ids), 0)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request at this step boundary; returns its final output (None if unknown)."""
        seqs = self._requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        return self._collect(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def cache_info(self) -> dict[str, str]:
        return {"block_size": str(self.kv_spec.block_size), "num_blocks": str(self.runner.kv_cache.num_blocks),
                "bytes_per_token": str(self.kv_spec.bytes_per_token), "dtype": str(self.kv_spec.dtype)}

    def request_ids(self) -> list[str]:
        return list(self._requests)

    # -- the step ---------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        started = time.perf_counter()
        scheduled = self.scheduler.schedule()
        touched: set[str] = {s.request_id for s in scheduled.preempted}
        if not scheduled.is_empty:
            self.num_steps += 1
            if self.memory_guard is not None:
                if scheduled.recorded and not self.memory_guard.admits(scheduled.scheduled[0].num_new_tokens):
                    # its never-freed tensors would not fit the device budget: serve it unrecorded
                    refused = scheduled.scheduled[0].seq
                    refused.record, refused.track_logprob, scheduled.recorded = None, False, False
                    if self.recorder is not None:
                        self.recorder.on_record_refused(refused.request_id)
                recorded = scheduled.scheduled[0].num_new_tokens if scheduled.recorded else 0
                context = max(s.seq.num_computed_tokens + s.num_new_tokens for s in scheduled.scheduled)
                self.memory_guard.before_step(scheduled.num_tokens, len(scheduled.scheduled), recorded, context)
            try:
                model_output = self.runner.execute(scheduled)
            finally:
                if self.memory_guard is not None:
                    self.memory_guard.after_step()
            touched |= self._update(scheduled, model_output)
        outputs = [out for rid in touched if (out := self._collect(rid)) is not None]
        stats = StepStats(time.perf_counter() - started, scheduled.num_tokens, len(self.scheduler.running),
                          len(self.scheduler.waiting), self.scheduler.kv_usage, len(scheduled.preempted))
        return outputs, stats

    def _update(self, scheduled: SchedulerOutput, model_output: ModelOutput) -> set[str]:
        now = time.monotonic()
        touched = set()
        if scheduled.recorded:  # the recorded sequence is the step's first; decodes may follow it
            recorded_seq = scheduled.scheduled[0].seq
            recorded_seq.record = None
            if model_output.recording is not None and self.recorder is not None:
                model_output.recording.adapter_version = self.recorder.adapter_version()
                self.recorder.on_recorded(recorded_seq.request_id, model_output.recording)
        for entry in scheduled.scheduled:
            seq = entry.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = now
            completes_pending = entry.completes_pending
            seq.num_computed_tokens += entry.num_new_tokens
            if seq.seq_id in model_output.prompt_logprobs:
                seq.prompt_logprobs.extend(model_output.prompt_logprobs[seq.seq_id])
                touched.add(seq.request_id)
            if not completes_pending:
                continue
            touched.add(seq.request_id)
            sampled = model_output.sampled.get(seq.seq_id)
            if sampled is None:  # max_tokens == 0: the prompt was only scored
                self.scheduler.finish(seq, "length")
                continue
            if sampled.logprob_value is not None:
                seq.cumulative_logprob += sampled.logprob_value
            self._append_token(seq, sampled.token_id, sampled.logprob, now)
        return touched

    def _append_token(self, seq: Sequence, token_id: int, logprob, now: float) -> None:
        seq.output_token_ids.append(token_id)
        seq.new_token_ids.append(token_id)
        if logprob is not None:
            seq.new_logprobs.append(logprob)
        if seq.first_token_time is None:
            seq.first_token_time = now
        seq.last_token_time = now
        params = seq.params
        num_out = len(seq.output_token_ids)
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.scheduler.finish(seq, "stop")
                return
            if token_id in params.stop_token_ids:
                self.scheduler.finish(seq, "stop", token_id)
                return
        stop = seq.detokenizer.append(token_id)
        if stop is not None and num_out >= params.min_tokens:
            self.scheduler.finish(seq, "stop", stop)
        elif num_out >= seq.max_tokens:
            self.scheduler.finish(seq, "length")

    def _collect(self, request_id: str) -> RequestOutput | None:
        seqs = self._requests.get(request_id)
        if seqs is None:
            return None
        meta = self._request_meta[request_id]
        completions = []
        for seq in seqs:
            completions.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.take_new_text(seq.is_finished),
                token_ids=seq.new_token_ids, logprobs=seq.new_logprobs if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                cumulative_logprob=seq.cumulative_logprob if seq.track_logprob else None))
            seq.new_token_ids, seq.new_logprobs = [], []
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        meta.first_token_time = min(firsts) if firsts else None
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        meta.first_scheduled_time = min(scheduled) if scheduled else None
        meta.num_generation_tokens = sum(len(s.output_token_ids) for s in seqs)
        prompt_logprobs = None
        lead = seqs[0]
        if lead.params.prompt_logprobs is not None and not lead.prompt_logprobs_sent \
                and len(lead.prompt_logprobs) == lead.num_prompt_tokens:
            prompt_logprobs, lead.prompt_logprobs_sent = lead.prompt_logprobs, True
        finished = all(s.is_finished for s in seqs)
        if finished:
            meta.finish_time = time.monotonic()
            del self._requests[request_id], self._request_meta[request_id]
        return RequestOutput(request_id, completions, finished, meta, prompt_logprobs)

    # -- offline use ------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[list[int]]]:
        """Runs prompts to completion; returns each prompt's choices' generated token ids."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [f"offline-{next(self._seq_ids)}" for _ in prompts]
        results: dict[str, list[list[int]]] = {rid: [[] for _ in range(p.n)] for rid, p in zip(ids, params_list)}
        for rid, prompt, p in zip(ids, prompts, params_list):
            self.add_request(rid, prompt, p)
        while self.has_unfinished():
            outputs, _ = self.step()
            for out in outputs:
                for completion in out.outputs:
                    results[out.request_id][completion.index].extend(completion.token_ids)
        return [results[rid] for rid in ids]


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids |= set(value) if isinstance(value, (list, tuple)) else {value}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
