"""What the routes share: the async engine, the tokenizer, the served model's name and
limits, the metrics, and online training (None when training is off), typed by what the
routes use of it."""

from __future__ import annotations

import concurrent.futures
import time
import uuid
from dataclasses import dataclass, field
from typing import Protocol

from engine.async_engine import AsyncEngine
from server.fanout import Peers
from server.metrics import ServingMetrics
from server.response_store import ResponseStore
from server.token_shown import TokenShown
from server.tool_calls import TOOL_CALL_OPEN
from trainer.adapter_store import AdapterSnapshot, SavedVersion
from trainer.feedback import FeedbackLabel, FeedbackResult
from trainer.frozen import ServedAdapter
from trainer.methods import TrainingMethod
from trainer.replicated import Replica
from trainer.status import Forgotten, TrainerStatus


class FeedbackSink(Protocol):
    def submit(self, label: FeedbackLabel) -> FeedbackResult:
        """Attaches a label to its completion's entry (blocking: call on a worker thread)."""
        ...

    def count(self, result: FeedbackResult, rewards: list[float] | None = None) -> None:
        """Counts an outcome: also a body refused before it reached `submit`."""
        ...


class SavedAdapters(Protocol):
    def saved_versions(self) -> list[SavedVersion]: ...

    def load_saved(self, version: int) -> AdapterSnapshot:
        """Disk I/O: call on a worker thread; raises AdapterLoadError."""
        ...


class Training(Protocol):
    """What the routes use of online training (trainer/online.py)."""

    method: TrainingMethod
    feedback: FeedbackSink
    lifecycle: SavedAdapters

    def status(self) -> TrainerStatus: ...

    def rollback(self, snapshot: AdapterSnapshot) -> int | concurrent.futures.Future:
        """On the device thread (`AsyncEngine.run_on_device`); with replicas, a future of
        the version every replica rolls back to."""
        ...

    def adapter_digest(self) -> str:
        """A hash of the adapter's weights (device thread)."""
        ...

    def forget(self, completion_id: str, label_only: bool = False) -> Forgotten:
        """Deletes a completion's label, or its request and label (a worker thread's call;
        LedgerUnavailable)."""
        ...

    def withdraw_from_training(self, completion_ids: list[str]) -> list[str]:
        """Takes entries deleted while they train out of their job (device thread); the
        ids it could not withdraw (their step could not be stopped)."""
        ...

    def close(self) -> None: ...


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: ServingMetrics
    # online training, when it is on
    training: Training | None = None
    # the saved adapter served frozen, when training is off (trainer/frozen.py)
    served_adapter: ServedAdapter | None = None
    # other names the model is served under (--served-model-name's after its first)
    model_aliases: tuple[str, ...] = ()
    # each request's prompt as the client wrote it goes to the recorder (for a reward
    # function, and the feedback ledger)
    keeps_client_prompt: bool = False
    # the sampling fields a request leaves out take these values (server/generation_config.py)
    sampling_defaults: dict = field(default_factory=dict)
    # a chat's reasoning apart from its answer (server/reasoning.py): a parser's name, or "" for none
    reasoning_parser: str = ""
    # this process's place among data-parallel replicas, and how it reaches the others
    # (server/replicas.py, server/fanout.py); None for a single server
    replica: Replica | None = None
    peers: Peers | None = None
    # stored responses (the Responses API's `store`); None: none are kept
    responses: ResponseStore | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # `<tool_call>` as one special token (Qwen's), or None where the tokenizer spells it in text
    tool_call_token: int | None = field(init=False)
    # tokens as logprobs show them
    tokens: TokenShown = field(init=False)

    def __post_init__(self) -> None:
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        self.tool_call_token = added.get(TOOL_CALL_OPEN)
        self.tokens = TokenShown(self.tokenizer)

    @property
    def model_names(self) -> tuple[str, ...]:
        return (self.model_name, *self.model_aliases)

    def completion_id(self, prefix: str) -> str:
        """A new completion's id, after `prefix` (with its separator: "chatcmpl-", OpenAI's
        "resp_"); among replicas it names the one serving it."""
        tag = self.replica.tag(prefix) if self.replica is not None else prefix
        return tag + uuid.uuid4().hex
