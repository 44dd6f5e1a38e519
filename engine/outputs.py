"""What the engine hands back after each step: per-request deltas and timings.

Outputs are incremental: each `CompletionOutput` carries only what is new since the
previous step (text, token ids, logprobs); consumers accumulate them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprob:
    token_id: int
    # log-probability under the model's raw distribution (before temperature/top-p)
    logprob: float
    # the most likely alternatives, best first: (token_id, logprob)
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class CompletionOutput:
    # which of the request's n choices
    index: int
    # text and tokens produced since the previous output of this choice
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    # None while running; "stop" | "length" | "abort" when finished
    finish_reason: str | None = None
    # the stop string or stop token id that ended the choice, if any
    stop_reason: str | int | None = None
    # sum of the raw log-probs of all tokens generated so far (recorded sequences only)
    cumulative_logprob: float | None = None


@dataclass
class RequestMetrics:
    # time.monotonic() stamps
    arrival_time: float
    first_token_time: float | None
    finish_time: float | None
    num_prompt_tokens: int
    # tokens generated over all choices so far
    num_generation_tokens: int
    # when the request's first chunk of prefill was scheduled (leaving the queue)
    first_scheduled_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    # every choice has finished
    finished: bool
    metrics: RequestMetrics
    # prompt logprobs (position 0 is None), sent once when the prompt has been computed
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # set when the engine failed while serving this request
    error: str | None = None
