"""A sequence's state inside the engine, tracked by counters rather than phase flags.

A request with `n` choices is `n` sequences sharing a request id. What a sequence still
needs is `num_tokens - num_computed_tokens` tokens of forward pass: the whole prompt at
first (possibly over several chunked steps), then one token per decode step. A
preempted sequence resets `num_computed_tokens` to 0 and recomputes prompt + output.

The choices of a request are prefilled once: choice 0 is prefilled and the others wait
as its `fork_children` until its prompt is complete, then fork its KV blocks and sample
their first tokens from its last prompt row (engine/scheduler.py, `Fork`).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.outputs import TokenLogprob
from engine.recording import RecordSpec
from engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    # engine-wide unique id
    seq_id: int
    # the request this sequence answers, and which of its n choices it is
    request_id: str
    index: int
    prompt_token_ids: list[int]
    params: SamplingParams
    # max_tokens resolved against the context length
    max_tokens: int
    # time.monotonic() when the request reached the engine
    arrival_time: float
    detokenizer: IncrementalDetokenizer
    # per-sequence RNG when the request has a seed; None uses the global RNG
    generator: torch.Generator | None = None
    output_token_ids: list[int] = field(default_factory=list)
    # tokens whose K/V are in this sequence's blocks
    num_computed_tokens: int = 0
    # KV blocks, filled by the scheduler through the block allocator
    block_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    # "stop" | "length" | "abort", set when the sequence finishes
    finish_reason: str | None = None
    # the stop string or stop token id that ended it, if one did
    stop_reason: str | int | None = None
    # filled by update() as tokens are sampled; drained into each step's output
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[TokenLogprob] = field(default_factory=list)
    # prompt logprobs computed so far (position 0 has none); emitted once complete
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    prompt_logprobs_sent: bool = False
    # time.monotonic() of the first step that computed this sequence, and of the first and latest sampled token
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # a trainable request's first choice, before the scheduler asked whether to record it
    awaits_admission: bool = False
    # on that choice, the request's EngineRequest.client_prompt, handed to the recorder
    client_prompt: object = None
    # set by the scheduler's admission when this prefill is to be recorded; cleared once done
    record: RecordSpec | None = None
    # record the log-prob of each sampled token: set for trainable requests when the
    # recording or the label needs them (DPO's served response, GRPO's log π_old)
    track_logprob: bool = False
    # the temperature those are taken at: 1, the model's own distribution (DPO's); GRPO's are
    # the sampling distribution's, the request's temperature (TRL's), 1 for greedy decoding
    logprob_temperature: float = 1.0
    # the log-prob of each sampled token, when tracked (GRPO's per token, DPO's summed)
    token_logprobs: list[float] = field(default_factory=list)
    # choices of the same request waiting for this sequence's prompt to fork from it, and,
    # on such a choice, the sequence it waits for
    fork_children: list["Sequence"] = field(default_factory=list)
    fork_parent: "Sequence | None" = None
    # structured outputs: the grammar's state for this sequence (engine/structured.py)
    matcher: object | None = None
    # the prefix cache (engine/block_pool.py): the weights generation this sequence's K/V are
    # computed under (set when it is admitted; None before), the names of its full blocks
    # under it, how many of its blocks are cached by name, the prompt tokens its first
    # prefill read from the cache, and the client's salt that keeps its prefixes its own
    kv_generation: int | None = None
    block_names: list[bytes] = field(default_factory=list)
    num_named_blocks: int = 0
    num_cached_tokens: int | None = None
    cache_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_pending_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_until(self, end: int) -> list[int]:
        """The ids of positions 0 .. end - 1, prompt then output."""
        prompt = self.prompt_token_ids
        return prompt[:end] if end <= len(prompt) else prompt + self.output_token_ids[:end - len(prompt)]

    def token_id_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
