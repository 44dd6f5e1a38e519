"""Per-request sampling parameters, named as vLLM names them, validated on creation.

Range checks live here (not only in the HTTP layer) so that every user of the engine
gets the same errors; `InvalidParameter` carries the offending parameter's name and an
OpenAI error code, so the server can fill OpenAI's `param` and `code` fields.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured import Grammar

MAX_LOGPROBS = 20
# temperatures below this are treated as greedy (dividing by them overflows), as in vLLM
_GREEDY_EPS = 1e-5


class InvalidParameter(ValueError):
    """A request parameter out of its accepted range; `code` is OpenAI's error code."""

    def __init__(self, param: str, message: str, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class SamplingParams:
    # completions returned for the prompt
    n: int = 1
    # 0 means greedy (argmax)
    temperature: float = 1.0
    # nucleus sampling: smallest set of tokens whose probability reaches top_p
    top_p: float = 1.0
    # keep the k most likely tokens; -1 (or 0) keeps all
    top_k: int = -1
    # drop tokens whose probability is below min_p times the most likely one's
    min_p: float = 0.0
    # OpenAI penalties over the tokens generated so far
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF multiplicative penalty over prompt and generated tokens; 1 disables it
    repetition_penalty: float = 1.0
    # OpenAI logit_bias: token id -> value in [-100, 100] added to that token's logit
    logit_bias: dict[int, float] = field(default_factory=dict)
    # structured outputs: the grammar the output must follow (engine/structured.Grammar)
    grammar: Grammar | None = None
    # makes sampling reproducible for this request alone, whatever else is batched with it
    seed: int | None = None
    # generation stops before any of these strings (not included unless include_stop_str_in_output)
    stop: list[str] = field(default_factory=list)
    # generation stops after any of these tokens (in addition to EOS unless ignore_eos)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    # None: until the context is full
    max_tokens: int | None = 16
    # the request's field max_tokens came from (max_completion_tokens, ...): an error about it names that
    max_tokens_param: str = "max_tokens"
    # EOS and stop tokens are suppressed until this many tokens are generated
    min_tokens: int = 0
    ignore_eos: bool = False
    # None: no logprobs; k >= 0: the sampled token's logprob and the k most likely
    logprobs: int | None = None
    # the same for the prompt's tokens
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        if self.top_k == 0:
            self.top_k = -1
        self.logit_bias = dict(self.logit_bias)
        checks = [
            ("n", self.n >= 1, "must be at least 1"),
            ("temperature", 0.0 <= self.temperature <= 2.0, "must be between 0 and 2"),
            ("top_p", 0.0 < self.top_p <= 1.0, "must be in (0, 1]"),
            ("top_k", self.top_k == -1 or self.top_k >= 1, "must be -1 (disabled) or at least 1"),
            ("min_p", 0.0 <= self.min_p <= 1.0, "must be in [0, 1]"),
            ("presence_penalty", -2.0 <= self.presence_penalty <= 2.0, "must be between -2 and 2"),
            ("frequency_penalty", -2.0 <= self.frequency_penalty <= 2.0, "must be between -2 and 2"),
            ("repetition_penalty", 0.0 < self.repetition_penalty < math.inf, "must be a finite number above 0"),
            ("max_tokens", self.max_tokens is None or self.max_tokens >= 0, "must be at least 0"),
            ("min_tokens", self.min_tokens >= 0, "must be at least 0"),
            ("min_tokens", self.max_tokens is None or self.min_tokens <= self.max_tokens,
             f"must not exceed max_tokens ({self.max_tokens})"),
            ("logprobs", self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("prompt_logprobs", self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_LOGPROBS,
             f"must be between 0 and {MAX_LOGPROBS}"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop", len(self.stop) <= 16, "at most 16 stop strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative token ids"),
            ("logit_bias", all(isinstance(t, int) and t >= 0 and -100.0 <= b <= 100.0
                               for t, b in self.logit_bias.items()),
             "must map token ids to values between -100 and 100"),
            ("seed", self.seed is None or -(2**63) <= self.seed < 2**63, "must fit in 64 bits"),
        ]
        for param, ok, message in checks:
            if not ok:
                given = repr(getattr(self, param))  # (a list of 100,000 stop strings was said back whole)
                given = given if len(given) <= 200 else given[:200] + "…"
                raise InvalidParameter(param, f"{param} {message}, got {given}")
        if self.temperature < _GREEDY_EPS:
            self.temperature = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or bool(self.logit_bias))
