"""The response bodies as pydantic models: what the OpenAPI document (server/openapi.py)
says each route returns.

The handlers build their bodies as dicts (server/responses.py); these models describe
them, and the schema fuzzer (tests/test_openapi.py) checks every response it provokes
against them, so the two cannot drift apart unnoticed. Optional fields are ones a body
may leave out; `X | None` fields are always present and may be null.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

FinishReason = Literal["stop", "length", "tool_calls"]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error body, for every status that is not a success."""

    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    # prompt tokens whose K/V came from the prefix cache (computed for an earlier request)
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class AdapterCard(BaseModel):
    version: int
    frozen: bool
    path: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int
    # which adapter the served weights hold, where one does
    adapter: AdapterCard | None = None


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob] | None


class CalledFunction(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: CalledFunction


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    tool_calls: list[ToolCall] | None = None
    # with a reasoning parser (`--reasoning-parser`): the answer's <think> section, under vLLM's
    # name and its earlier one (DeepSeek's), null where the model gave none
    reasoning: str | None = None
    reasoning_content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None
    finish_reason: FinishReason | None
    # vLLM's: the stop string or stop token id that ended the choice
    stop_reason: int | str | None


class ChatCompletion(BaseModel):
    """A whole chat completion; with `"stream": true` the body is instead a
    text/event-stream of `chat.completion.chunk` objects, ended by `data: [DONE]`."""

    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None
    stop_reason: int | str | None


class Completion(BaseModel):
    """A whole text completion (streamed like a chat completion, as `text_completion` chunks)."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class FeedbackAccepted(BaseModel):
    id: str
    object: Literal["feedback"]
    # skipped: valid, but nothing to learn from (a group whose rewards are all equal)
    status: Literal["accepted", "skipped"]
    message: str | None = None


def _trained_into():
    return Field(description="The first adapter version holding the deleted label, which had already trained: its "
                             "effect stays in the weights until a rollback to a version before it. Null: the label "
                             "was in no weights.")


class FeedbackDeleted(BaseModel):
    id: str
    object: Literal["feedback.deleted"]
    deleted: Literal[True]
    trained_into_version: int | None = _trained_into()


class CompletionDeleted(BaseModel):
    """OpenAI's answer to deleting a stored chat completion (and the version its label trained into)."""

    id: str
    object: Literal["chat.completion.deleted"]
    deleted: Literal[True]
    trained_into_version: int | None = _trained_into()


class ResponseDeleted(BaseModel):
    """OpenAI's answer to deleting a stored response (and the version its label trained into)."""

    id: str
    object: Literal["response"]
    deleted: Literal[True]
    trained_into_version: int | None = _trained_into()


class SavedAdapter(BaseModel):
    version: int
    path: str
    created: int


class TrainingSummary(BaseModel):
    trained_entries: int
    train_tokens: int
    last_loss: float | None
    skipped_steps: int
    failed_jobs: int
    stale_entries: int
    activation_cache_bytes: int


class GateScores(BaseModel):
    """A version's scores on the eval set (nats; None: no probe of that kind, no KL sample yet)."""

    version: int
    preference_margin: float | None
    completion_logprob: float | None
    kl: float | None
    seconds: float


class RejectedScores(GateScores):
    # why the version was not served
    failures: list[str]


class GateSummary(BaseModel):
    """The eval gate: the version being scored, and the last promoted and rejected ones."""

    candidate_version: int | None
    last_promoted: GateScores | None
    last_rejected: RejectedScores | None
    evaluations: int
    eval_seconds: float
    promoted: int
    rejected: int
    # labels of rejected versions, kept out of training (release with `alchemist feedback release`)
    quarantined_labels: int


class ReplicaCard(BaseModel):
    """One replica of the server (one, rank 0, without --data-parallel-size)."""

    # its torch.distributed rank (the `engine` label of its metrics)
    rank: int
    # the adapter version it serves
    version: int
    # the first 16 hex digits of a SHA-256 of its live adapter weights (while the eval gate
    # scores a candidate, the candidate's, not the served version's): equal digests, equal
    # weights bit for bit
    digest: str
    # requests it finished
    requests_served: int


class AdapterStatus(BaseModel):
    """The live adapter: trained online (version, saved versions, training counters), or
    served frozen from a saved directory (`frozen`, `path`, `name`)."""

    object: Literal["adapter"]
    version: int | None
    mode: str
    restored_from: int | None = None
    adapter_dir: str | None = None
    save_every: int | None = None
    saved: list[SavedAdapter] | None = None
    training: TrainingSummary | None = None
    # rollbacks by reason: "manual" (POST /v1/adapters/rollback) and "eval_gate"
    rollbacks: dict[str, int] | None = None
    # the eval gate (None without --eval-set); `version` is then the last promoted version
    gate: GateSummary | None = None
    # every replica, by rank (training counters above are summed over them)
    replicas: list[ReplicaCard] | None = None
    frozen: bool | None = None
    path: str | None = None
    name: str | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfo(BaseModel):
    """vLLM's `/tokenizer_info`: what a client needs to tokenize as the server does, through
    `/tokenize` and `/detokenize` (lm-evaluation-harness's remote tokenizer)."""

    tokenizer_class: str
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    # the served context (what /tokenize calls max_model_len), not the tokenizer file's
    model_max_length: int
    # the template /v1/chat/completions renders with; None: the model has none
    chat_template: str | None = None


class Health(BaseModel):
    status: Literal["ok"]


class Version(BaseModel):
    # the installed alchemist package's version
    version: str
