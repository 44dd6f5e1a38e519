"""A request the engine accepted: validated once, when it is made (`LLMEngine.make_request`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams
    # time.monotonic() when the request reached the server
    arrival_time: float
    # the client allows training on it (whether its prefill is recorded is decided at
    # scheduling time, by the engine's PrefillRecorder)
    train: bool = False
    # the prompt as the client wrote it (chat messages, or text), kept only when a reward
    # function will be shown it; it travels to the recorder with the request
    client_prompt: object = None
    # its grammar's matcher at the start, compiled when the request was checked (off the
    # engine's thread): choice 0 decodes with it, the others with copies
    matcher: object = field(default=None, compare=False, repr=False)
    # the client's salt for the prefix cache: prompts salted otherwise share no blocks with it
    cache_salt: str | None = None
