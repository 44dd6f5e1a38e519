"""Turns a step's sampled tokens into what the requests see: appended tokens, text
(detokenized incrementally), stop conditions, timings, and per-request outputs.

`update` runs after the model; `collect` drains each touched request's new tokens and
text into a `RequestOutput` and forgets a request once every choice has finished.
"""

from __future__ import annotations

import time

from engine.model_runner import ModelOutput
from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import Sequence


class OutputProcessor:
    def __init__(self, scheduler: Scheduler, eos_token_ids: set[int]):
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        # request id -> its n sequences, and its timings (while it has unfinished choices)
        self.requests: dict[str, list[Sequence]] = {}
        self.metrics: dict[str, RequestMetrics] = {}

    def add(self, request_id: str, seqs: list[Sequence], metrics: RequestMetrics) -> None:
        self.requests[request_id] = seqs
        self.metrics[request_id] = metrics

    def update(self, scheduled: SchedulerOutput, model_output: ModelOutput, step_started: float) -> set[str]:
        """Applies a step's results; the ids of the requests it touched. `step_started`
        (monotonic): when the step began executing, a sequence's first scheduling time."""
        now = time.monotonic()
        touched = set()
        for entry in scheduled.scheduled:
            seq = entry.seq
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = step_started
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
            self._append_sampled(seq, sampled, now)
        for fork in scheduled.forks:  # choices that took a prompt computed in this step
            for child in fork.children:
                child.first_scheduled_time = step_started
                touched.add(child.request_id)
                self._append_sampled(child, model_output.sampled[child.seq_id], now)
        return touched

    def _append_sampled(self, seq: Sequence, sampled, now: float) -> None:
        if sampled.logprob_value is not None:
            seq.token_logprobs.append(sampled.logprob_value)
        self._append_token(seq, sampled.token_id, sampled.logprob, now)

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
            eos = not params.ignore_eos and token_id in self.eos_token_ids
            if eos or token_id in params.stop_token_ids:
                if params.include_stop_str_in_output:  # the stop token's text too, as vLLM's
                    seq.detokenizer.append(token_id, check_stop=False)
                self.scheduler.finish(seq, "stop", None if eos else token_id)
                return
        # stop strings count from the token after the first `min_tokens`, as vLLM's
        stop = seq.detokenizer.append(token_id, check_stop=num_out > params.min_tokens)
        if stop is not None:
            self.scheduler.finish(seq, "stop", stop)
        elif num_out >= seq.max_tokens:
            self.scheduler.finish(seq, "length")

    def collect(self, request_id: str) -> RequestOutput | None:
        """The request's output since the last one (None if it is unknown)."""
        seqs = self.requests.get(request_id)
        if seqs is None:
            return None
        meta = self.metrics[request_id]
        completions = []
        for seq in seqs:
            values = None
            if seq.track_logprob:
                values = seq.token_logprobs[len(seq.token_logprobs) - len(seq.new_token_ids):]
            completions.append(CompletionOutput(
                index=seq.index, text=seq.detokenizer.take_new_text(seq.is_finished),
                token_ids=seq.new_token_ids, logprobs=seq.new_logprobs if seq.params.logprobs is not None else None,
                finish_reason=seq.finish_reason, stop_reason=seq.stop_reason,
                token_logprob_values=values))
            seq.new_token_ids, seq.new_logprobs = [], []
        firsts = [s.first_token_time for s in seqs if s.first_token_time is not None]
        meta.first_token_time = min(firsts) if firsts else None
        scheduled = [s.first_scheduled_time for s in seqs if s.first_scheduled_time is not None]
        meta.first_scheduled_time = min(scheduled) if scheduled else None
        meta.num_generation_tokens = sum(len(s.output_token_ids) for s in seqs)
        prompt_logprobs = None
        lead = seqs[0]
        meta.num_cached_tokens = lead.num_cached_tokens or 0
        if lead.params.prompt_logprobs is not None and not lead.prompt_logprobs_sent \
                and len(lead.prompt_logprobs) == lead.num_prompt_tokens:
            prompt_logprobs, lead.prompt_logprobs_sent = lead.prompt_logprobs, True
        finished = all(s.is_finished for s in seqs)
        if finished:
            meta.finish_time = time.monotonic()
            del self.requests[request_id], self.metrics[request_id]
        return RequestOutput(request_id, completions, finished, meta, prompt_logprobs)
