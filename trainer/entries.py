"""What the activation cache holds: an entry per recorded (or label-only) request, its
label types, the states an entry moves through, and where the cache writes how each ended.

`CacheEntry` is the paper's AlchemistCacheBase: subclass it (and `TrainingMethod`) to
train with another method. An entry's `state` is moved only by the cache
(trainer/cache.py), which owns every transition, from its admission on.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Protocol

from engine.recording import RecordedPrefill


class EntryState(str, enum.Enum):
    WAITING_LABEL = "waiting_label"
    # never an entry: the request was served with "train": false (or only scored)
    NOT_TRAINABLE = "not_trainable"
    # never an entry: a single-choice request on a server that trains on groups (GRPO)
    NOT_A_GROUP = "not_a_group"
    READY = "ready"
    TRAINING = "training"
    TRAINED = "trained"
    EXPIRED = "expired"
    EVICTED = "evicted"
    DROPPED = "dropped"
    # a group whose rewards were all equal: no advantage, so no gradient; not trained
    SKIPPED = "skipped"


TERMINAL = {EntryState.TRAINED, EntryState.EXPIRED, EntryState.EVICTED, EntryState.DROPPED, EntryState.SKIPPED}


@dataclass(eq=False)
class CacheEntry:
    """One recorded request. Ready for training as soon as it is recorded; subclasses
    that need a label override `needs_label`."""

    completion_id: str
    prompt_token_ids: list[int]
    # the recorded prefill; None once trained, evicted or released
    recording: RecordedPrefill | None
    adapter_version: int
    # bytes of activations the recording holds (measured)
    nbytes: int
    created: float = field(default_factory=time.monotonic)
    state: EntryState = EntryState.READY
    # served responses by choice index (token ids), filled when the request finishes
    responses: dict[int, list[int]] = field(default_factory=dict)
    # their summed log-probs as serving computed them (under this entry's adapter version)
    served_logps: dict[int, float] = field(default_factory=dict)
    # and each token's (GRPO's log π_old)
    served_token_logps: dict[int, list[float]] = field(default_factory=dict)
    # the temperature those were taken at and are trained at (GRPO's sampling temperature; 1: the model's own)
    logprob_temperature: float = 1.0
    # the text the client read of a response a stop string ended (its ids hold the stop string's tokens)
    texts_read: dict[int, str] = field(default_factory=dict)
    response_finished: bool = False
    # monotonic time after which an entry still waiting for its label expires
    label_deadline: float | None = None
    # held for a label once (one that needs a label from its admission; a custom method's by `hold`)
    held: bool = False

    # the cache holds an entry that needs a label (WAITING_LABEL) from its admission until it comes
    needs_label = False

    def __post_init__(self) -> None:
        # made with a recording (which may be released later), or a label entry from the start
        self.was_recorded = self.recording is not None
        # trained once in a step skipped for a non-finite gradient: a second skip drops it
        self.retried_after_skip = False

    @property
    def num_tokens(self) -> int:
        """Tokens trained on (for throughput)."""
        return len(self.prompt_token_ids)

    def release(self) -> None:
        if self.recording is not None:
            self.recording.release()
            self.recording = None


@dataclass
class PreferenceLabel:
    # response token ids (each ends with the end-of-turn token)
    chosen: list[int]
    rejected: list[int]
    # policy log-probs already known from serving: "chosen"/"rejected" -> value (a side
    # that is the served response, scored while it was decoded)
    served_logps: dict[str, float] = field(default_factory=dict)


@dataclass(eq=False)
class PreferenceEntry(CacheEntry):
    """A DPO entry: waits for feedback; caches the reference model's log-probs."""

    label: PreferenceLabel | None = None
    # summed log-probs of (chosen, rejected) under the base model, computed once
    reference_logps: tuple[float, float] | None = None

    needs_label = True

    @property
    def num_tokens(self) -> int:
        extra = len(self.label.chosen) + len(self.label.rejected) if self.label else 0
        return len(self.prompt_token_ids) + extra


@dataclass
class GroupRewards:
    # one finite reward per choice, by choice index
    rewards: list[float]


@dataclass(eq=False)
class GroupEntry(CacheEntry):
    """A GRPO entry: one prompt recording for a request's n sampled responses (`responses`,
    with their per-token served log-probs), waiting for a reward per response."""

    label: GroupRewards | None = None
    # per choice, the base model's log-prob of each response token (KL term), computed once
    reference_token_logps: dict[int, list[float]] | None = None

    needs_label = True

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + sum(len(r) for r in self.responses.values())


class FateJournal(Protocol):
    """Where the cache writes how each entry ended (the feedback ledger, trainer/ledger.py):
    called under the cache's lock, so it must only queue the write."""

    def record_fate(self, request_id: str, fate: str, version: int | None = None, path: str | None = None,
                    reason: str | None = None) -> None: ...
