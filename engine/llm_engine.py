"""The serving engine: continuous batching as schedule -> execute -> update.

`make_request` validates a request (once) and `add` queues it (n sequences); each
`step()` lets the scheduler pick the sequences and token counts, the runner compute them,
and the output processor append sampled tokens, detokenize, apply stop conditions and
release finished sequences. New requests join at step boundaries; finished ones leave.
Single-threaded by design: everything here runs on the device thread. What the engine
produces goes to its observers (engine/hooks.py), on that thread too.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable

import torch

from engine.config import EngineConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.hooks import EngineHooks
from engine.kv_cache import KVCacheSpec, blocks_needed
from engine.malloc_tuning import minor_page_faults
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestMetrics, RequestOutput, StepStats
from engine.recording import RecordSpec
from engine.request import EngineRequest
from engine.sampler import Sampler
from engine.sampling_params import InvalidParameter, SamplingParams
from engine.scheduler import Scheduler
from engine.structured import GrammarCompiler, mask_vocab
from engine.sequence import Sequence

logger = logging.getLogger(__name__)


def build_runner(model, tokenizer, config: EngineConfig) -> ModelRunner:
    """The model's runner and its KV cache, sized by `config`: built before the engine,
    since the parts plugged into the engine (the trainer, the offloader) run the model
    through it first."""
    max_model_len = config.model.max_model_len
    dtype = next(model.parameters()).dtype
    spec = KVCacheSpec.from_model_config(model.config, dtype, config.cache.block_size)
    num_blocks = spec.num_blocks_for(config.cache.kv_cache_bytes)
    min_blocks = blocks_needed(max_model_len, spec.block_size)
    if num_blocks < min_blocks:
        raise ValueError(
            f"cache.kv_cache_bytes={config.cache.kv_cache_bytes} holds {num_blocks * spec.block_size} tokens "
            f"({spec.bytes_per_token} bytes per token); max_model_len={max_model_len} needs at least "
            f"{min_blocks * spec.block_size * spec.bytes_per_token} bytes")
    sampler = Sampler(_eos_token_ids(model, tokenizer), mask_vocab(tokenizer, model.config.vocab_size))
    runner = ModelRunner(model, spec, num_blocks, sampler,
                         packed_linear=config.model.packed_linear, max_num_seqs=config.scheduler.max_num_seqs,
                         max_model_len=max_model_len, enforce_eager=config.model.enforce_eager,
                         decode_attention=config.model.decode_attention)
    logger.info("KV cache: %d blocks x %d tokens, %d bytes per token, %.1f MiB", num_blocks,
                spec.block_size, spec.bytes_per_token, runner.kv_cache.memory_bytes / 2**20)
    return runner


class LLMEngine:
    def __init__(self, runner: ModelRunner, tokenizer, config: EngineConfig, hooks: EngineHooks | None = None):
        """`runner`: the model's (`build_runner`); `hooks`: the parts plugged in by the
        composition root (server/build.py), when training is on (engine/hooks.py)."""
        self.runner = runner
        self.model = runner.model
        self.tokenizer = tokenizer
        self.config = config
        self.hooks = hooks or EngineHooks()
        self.max_model_len = config.model.max_model_len
        self.kv_spec = runner.kv_cache.spec
        self.eos_token_ids = runner.sampler.eos_token_ids
        self.vocab_size = self.model.config.vocab_size
        prefix_caching = config.cache.enable_prefix_caching and not _rotary_follows_length(self.model.config)
        self.scheduler = Scheduler(config.scheduler, runner.kv_cache.num_blocks, self.kv_spec.block_size,
                                   self._admit_recording, self._confirm_recording,
                                   prefix_caching, self.hooks.weights_generation)
        self.outputs = OutputProcessor(self.scheduler, self.eos_token_ids)
        self._seq_ids = itertools.count()
        self._grammars: GrammarCompiler | None = None
        # the model is final now (adapters attached): the decode step's CUDA graphs, on a GPU
        self.graph_capture = runner.capture_decode_graphs()

    @classmethod
    def for_model(cls, model, tokenizer, config: EngineConfig, hooks: EngineHooks | None = None) -> LLMEngine:
        """An engine on `model` with a runner of its own (serving without training)."""
        return cls(build_runner(model, tokenizer, config), tokenizer, config, hooks)

    # -- requests ---------------------------------------------------------------------

    @property
    def grammars(self) -> GrammarCompiler:
        """Structured outputs' compiler, made at the first request that needs it."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size)
        return self._grammars

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams, matcher=None):
        """Raises InvalidParameter for a request this engine can never serve; returns its
        grammar's matcher (`matcher`, one `grammars.check` gave already; None: it has none)."""
        if not prompt_token_ids:
            raise InvalidParameter("prompt", "the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            past = next(t for t in prompt_token_ids if not 0 <= t < self.vocab_size)
            named = f" (token {self.tokenizer.convert_ids_to_tokens(past)!r}, id {past})" \
                if self.vocab_size <= past < len(self.tokenizer) else ""
            raise InvalidParameter("prompt", f"prompt token ids must be in [0, {self.vocab_size}){named}: the "
                                             "model has no embedding for it")
        if any(t >= self.vocab_size for t in params.stop_token_ids):
            raise InvalidParameter("stop_token_ids", f"stop_token_ids must be in [0, {self.vocab_size})")
        if any(t >= self.vocab_size for t in params.logit_bias):
            raise InvalidParameter("logit_bias", f"logit_bias token ids must be in [0, {self.vocab_size})")
        if params.grammar is not None and matcher is None:
            matcher = self.grammars.check(params.grammar)
        requested = len(prompt_token_ids) + (params.max_tokens or 0)
        # a prompt only scored (max_tokens 0) may fill the context; one answered leaves a position for its token
        longest_prompt = self.max_model_len if params.max_tokens == 0 else self.max_model_len - 1
        if len(prompt_token_ids) > longest_prompt or requested > self.max_model_len:
            prompt_alone = len(prompt_token_ids) > longest_prompt  # then no max_tokens would fit it
            raise InvalidParameter(
                "prompt" if prompt_alone or not params.max_tokens else params.max_tokens_param,
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{requested} tokens ({len(prompt_token_ids)} in the prompt, {params.max_tokens or 0} in the "
                f"completion). Please reduce the length of the prompt or completion." + (
                    " A prompt must leave the context one position for the token it is answered with, so it "
                    f"may have at most {longest_prompt} tokens (a completion's prompt only scored, with "
                    f"max_tokens 0, all {self.max_model_len})." if prompt_alone and params.max_tokens != 0 else ""),
                "context_length_exceeded")
        return matcher

    def make_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                     arrival_time: float | None = None, train: bool = False,
                     client_prompt: object = None, matcher=None, cache_salt: str | None = None) -> EngineRequest:
        """Validates a request (the only place it is validated); raises InvalidParameter
        for one this engine can never serve. `train`: the client allows training on it;
        `client_prompt`: its prompt as the client wrote it, for the recorder (a reward
        function is shown it); `matcher`: its grammar's, from `grammars.check` (which compiles
        it: a server does so off its event loop); `cache_salt`: the client's for the prefix
        cache. Scoring requests (prompt logprobs, max_tokens 0) are never trained on."""
        matcher = self._validate(prompt_token_ids, params, matcher)
        scoring = params.prompt_logprobs is not None or params.max_tokens == 0
        request = EngineRequest(request_id, tuple(prompt_token_ids), params,
                                time.monotonic() if arrival_time is None else arrival_time, train and not scoring,
                                client_prompt, matcher, cache_salt)
        self.expect(request)  # its id may reach the client (a stream's first chunk) before it is queued
        return request

    def add(self, request: EngineRequest) -> None:
        """Queues a request made by `make_request`; it joins at the next step."""
        if request.request_id in self.outputs.requests:
            raise ValueError(f"request id {request.request_id!r} is already running")
        params, prompt = request.params, list(request.prompt_token_ids)
        max_tokens = self.max_model_len - len(prompt) if params.max_tokens is None else params.max_tokens
        # the choices fork choice 0's prompt (one prefill for all); not when prompt
        # logprobs or nothing but the prompt are asked for (each choice reports its own)
        fork = (self.config.scheduler.fork_choices and params.n > 1 and params.prompt_logprobs is None
                and max_tokens > 0)
        recorder = self.hooks.recorder if request.train else None
        logprob_temperature = 1.0 if recorder is None else recorder.logprob_temperature(params.temperature, params.n)
        seqs = []
        for index in range(params.n):
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.runner.device)
                generator.manual_seed((params.seed + index * 1_000_003) % 2**63)
            seq = Sequence(
                seq_id=next(self._seq_ids), request_id=request.request_id, index=index,
                prompt_token_ids=list(prompt), params=params, max_tokens=max_tokens,
                arrival_time=request.arrival_time, generator=generator,
                detokenizer=IncrementalDetokenizer(self.tokenizer, prompt, params.stop,
                                                   params.include_stop_str_in_output, params.skip_special_tokens),
                awaits_admission=request.train and index == 0,  # choice 0's prefill may be recorded
                client_prompt=request.client_prompt if request.train and index == 0 else None,
                # (a choice that does not fork choice 0 may start before choice 0's admission)
                track_logprob=recorder is not None and recorder.wants_served_logprobs,
                logprob_temperature=logprob_temperature, cache_salt=request.cache_salt,
            )
            if params.prompt_logprobs is not None:
                seq.prompt_logprobs = [None]
            if params.grammar is not None:  # compiled once per request, copied for the other choices
                seq.matcher = (request.matcher or self.grammars.matcher(params.grammar)) if index == 0 \
                    else seqs[0].matcher.deep_copy()
            seqs.append(seq)
            if fork and index > 0:
                seq.fork_parent = seqs[0]
                seqs[0].fork_children.append(seq)
            else:
                self.scheduler.add(seq)
        self.outputs.add(request.request_id, seqs, RequestMetrics(request.arrival_time, None, None, len(prompt), 0))
        self._publish([], self._state())

    def expect(self, request: EngineRequest, expected: bool = True) -> None:
        """Tells the recorder of a trainable request made (or, not `expected`, one that never ran)."""
        if request.train and self.hooks.recorder is not None:
            self.hooks.recorder.expect(request.request_id, expected)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, train: bool = False) -> None:
        """`make_request` and `add` in one (offline use)."""
        self.add(self.make_request(request_id, prompt_token_ids, params, arrival_time, train))

    def _admit_recording(self, seq: Sequence, num_cached_tokens: int) -> RecordSpec | None:
        """Asks the recorder about a trainable request (its choice 0, before its prefill, with
        the prompt tokens the prefix cache holds for it); its choices then track their served
        log-probs if the recording or label needs them."""
        recorder = self.hooks.recorder
        if recorder is None:
            return None
        spec = recorder.admit(seq.request_id, seq.prompt_token_ids, seq.params.n, seq.client_prompt,
                              seq.logprob_temperature, num_cached_tokens)
        for member in self.outputs.requests.get(seq.request_id, [seq]):  # forked or not (scheduler.fork_choices)
            if member is seq or not member.output_token_ids:  # (one that started before tracks as it started)
                member.track_logprob = spec is not None or recorder.wants_served_logprobs
        return spec

    def _confirm_recording(self, seq: Sequence, num_cached_tokens: int) -> RecordSpec | None:
        """Asks the recorder whether an admitted recording still holds, just before its
        prefill, with the prompt tokens the prefix cache holds for it now."""
        return self.hooks.recorder.confirm(seq.request_id, seq.prompt_token_ids, seq.record, num_cached_tokens)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request at this step boundary; returns its final output (None if unknown)."""
        seqs = self.outputs.requests.get(request_id)
        if seqs is None:
            return None
        for seq in seqs:
            self.scheduler.finish(seq, "abort")
        output = self.outputs.collect(request_id)
        self._publish([output], self._state())  # the gauges drop now, not at the next step
        return output

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def num_requests(self) -> int:
        return len(self.outputs.requests)

    def request_ids(self) -> list[str]:
        return list(self.outputs.requests)

    def before_next_read_back(self, callback: Callable[[], None] | None) -> Callable[[], None] | None:
        """Sets what runs once in the next step: just before its first blocking read of
        sampled ids (its device work queued by then) if it only decodes, as it begins
        otherwise. Returns the callback set before, if it never ran."""
        previous, self.runner.sampler.before_read_back = self.runner.sampler.before_read_back, callback
        return previous

    def _before_read_back_now(self) -> None:
        callback = self.before_next_read_back(None)
        if callback is not None:
            callback()

    # -- the step ---------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        started, faults = time.perf_counter(), minor_page_faults()
        try:  # from the moment blocks are named for what the step computes until it has computed them
            scheduled = self.scheduler.schedule()
            kind = scheduled.kind  # before the step: it advances the sequences' computed tokens
            if kind != "decode":  # a prefill's forward is longer and host-bound: what waits for it goes now
                self._before_read_back_now()
                if not scheduled.is_empty:  # the gauges count the prompts it admitted as running during it
                    self._publish([], self._state())
            step_started = time.monotonic()
            model_output = self._execute(scheduled) if not scheduled.is_empty else None
        except BaseException:
            self.scheduler.forget_unwritten()
            raise
        touched: set[str] = {s.request_id for s in scheduled.preempted}
        if model_output is not None:
            if scheduled.recorded:  # the recorded sequence is the step's first; decodes may follow it
                recorded_seq = scheduled.scheduled[0].seq
                recorded_seq.record = None
                if model_output.recording is not None and self.hooks.recorder is not None:
                    self.hooks.recorder.on_recorded(recorded_seq.request_id, model_output.recording)
            touched |= self.outputs.update(scheduled, model_output, step_started)
        outputs = [out for rid in touched if (out := self.outputs.collect(rid)) is not None]
        stats = self._state(time.perf_counter() - started, scheduled.num_tokens, len(scheduled.preempted), kind)
        stats.page_faults = minor_page_faults() - faults
        stats.prefix_cache_queries, stats.prefix_cache_hits = self.scheduler.take_cache_counts()
        self._publish(outputs, stats)
        return outputs, stats

    def _execute(self, scheduled):
        """The step's forward, with room made on the device before it (the memory guard)."""
        hooks = self.hooks
        if hooks.memory_guard is not None:
            recorded = scheduled.num_tokens if scheduled.recorded else 0  # riding decodes' rows too
            hooks.memory_guard.before_step(scheduled.num_tokens, len(scheduled.scheduled), recorded)
        try:
            return self.runner.execute(scheduled, hooks.segment_sink, hooks.stale_resolver, hooks.recording_weights)
        finally:
            if hooks.memory_guard is not None:
                hooks.memory_guard.after_step()

    def _state(self, seconds: float = 0.0, num_tokens: int = 0, num_preempted: int = 0, kind: str = "") -> StepStats:
        """The scheduler's state as StepStats: after each step, and after a request is
        added or aborted, or admitted to a prefill that is about to run (a step of nothing,
        so that the gauges follow at once: a long prompt's prefill is one step)."""
        scheduler = self.scheduler
        # choices waiting to fork their prompt wait too
        waiting = len(scheduler.waiting) + sum(len(s.fork_children) for s in (*scheduler.waiting, *scheduler.running))
        return StepStats(seconds, num_tokens, len(scheduler.running), waiting, scheduler.kv_usage, num_preempted, kind)

    def _publish(self, outputs: list[RequestOutput], stats: StepStats | None) -> None:
        """Tells the observers (metrics, training's recorder) a step's results. One that
        raises is logged and serving goes on: raised here, the step's finished outputs were
        lost with it, and their clients waited for ever."""
        for observer in self.hooks.observers:
            if stats is not None:
                try:
                    observer.on_step(stats)
                except Exception:  # noqa: BLE001 - an observer's fault is not the requests'
                    logger.exception("%s failed on a step; serving goes on", type(observer).__name__)
            for output in outputs:
                try:
                    observer.on_output(output)
                except Exception:  # noqa: BLE001 - (try costs nothing until it catches)
                    logger.exception("%s failed on %s's output; serving goes on", type(observer).__name__,
                                     output.request_id)

    # -- offline use ------------------------------------------------------------------

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[list[list[int]]]:
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


def _rotary_follows_length(config) -> bool:
    """Whether the model's RoPE frequencies depend on the longest position a forward holds
    (transformers' longrope, Phi-3's 128k models, and dynamic NTK scaling): a key cached by one
    step was then rotated as another step may not rotate it, so the prefix cache is off."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kinds = [p for p in params.values() if isinstance(p, dict)] or [params]  # (Gemma 3: one per kind of layer)
    names = [str(kind.get("rope_type") or kind.get("type") or "") for kind in kinds]
    follows = any(name == "longrope" or "dynamic" in name for name in names)
    if follows:
        logger.warning("prefix caching is off: this model's RoPE (%s) changes with the length of a step", names)
    return follows


def _eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            ids |= set(value) if isinstance(value, (list, tuple)) else {value}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
