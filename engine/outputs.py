"""What the engine hands back after each step: per-request deltas, timings, errors.

Outputs are incremental: each `CompletionOutput` carries only what is new since the
previous step (text, token ids, logprobs); consumers accumulate them. Errors are typed
(`EngineError`): the server maps their kind to an HTTP status, never their text.
"""

from __future__ import annotations

import enum
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
    # the raw log-prob of each token in `token_ids` (sequences that track them: trainable ones)
    token_logprob_values: list[float] | None = None


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
    # prompt tokens whose K/V its prefill took from the prefix cache (engine/block_pool.py)
    num_cached_tokens: int = 0


class ErrorKind(enum.Enum):
    # the engine stopped (shutdown) before the request finished: retry elsewhere
    ENGINE_STOPPED = "engine_stopped"
    # an engine step raised while the request was in it
    STEP_FAILED = "step_failed"


@dataclass(frozen=True)
class EngineError:
    kind: ErrorKind
    # what happened, for the client and the log
    message: str


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
    # what the step ran (SchedulerOutput.kind); "" for a state update without a step
    kind: str = ""
    # minor page faults the process took during the step (engine/malloc_tuning.py)
    page_faults: int = 0
    # prompt tokens of the sequences it admitted looked up in the prefix cache, and found there
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    # every choice has finished
    finished: bool
    metrics: RequestMetrics
    # prompt logprobs (position 0 is None), sent once when the prompt has been computed
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # set when the engine failed while serving this request (the output is then final)
    error: EngineError | None = None


def _joined(first: list | None, second: list | None) -> list | None:
    return None if first is None and second is None else (first or []) + (second or [])


def merged(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output carrying two consecutive outputs' deltas of a request, in order: what a
    consumer that fell behind the engine takes at once (`AsyncEngine.generate`)."""
    before = {c.index: c for c in earlier.outputs}
    choices = []
    for c in later.outputs:
        e = before.pop(c.index, None)
        choices.append(c if e is None else CompletionOutput(
            c.index, e.text + c.text, e.token_ids + c.token_ids, _joined(e.logprobs, c.logprobs),
            c.finish_reason, c.stop_reason, _joined(e.token_logprob_values, c.token_logprob_values)))
    choices = sorted([*before.values(), *choices], key=lambda c: c.index)
    prompt_logprobs = earlier.prompt_logprobs if earlier.prompt_logprobs is not None else later.prompt_logprobs
    return RequestOutput(later.request_id, choices, later.finished, later.metrics, prompt_logprobs, later.error)
