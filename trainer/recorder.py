"""The trainer's side of serving: which prefills are recorded, and what becomes of them.

`Recorder` is the engine's `PrefillRecorder` and one of its `EngineObserver`s (engine/
hooks.py), called on the device thread:
  - `admit` is the one place that decides whether a trainable request's prefill is
    recorded: the record fraction, the prompt length, room in the activation cache, room
    on the device (the offloader's budget), and whether the labelled recordings ahead of it
    leave it trainable within `max_staleness`; the spec it returns carries the adapter
    version serving runs under, so the recording is stamped when it is made;
  - `on_recorded` turns a recording into a cache entry (the training method's);
  - `on_output` collects the served responses and their log-probs (at the temperature the
    method trains them at: `logprob_temperature`), and completes the entry when the
    request finishes (and has a group scored by the reward function, if one is set, shown
    the prompt the client wrote, which came with the request).
What it keeps about a request in flight lives here, on the device thread, from its
admission to its last output; label expiry is the arbiter's (trainer/maintenance.py).
A request gets an entry only if the method trains on it (GRPO: n >= 2, one entry for the
group, whose choices share the one recording).
With a feedback ledger, each request that gets an entry is written there (its prompt as
the client wrote it and as tokens, the served choices and log-probs when it finishes), and
its answer goes out once that is committed (`answer_written`): a label for an answered
request finds it after a crash.
No label is lost: with a method that takes feedback, a trainable request whose prefill is
not recorded (not drawn, too long, no room, too far behind) still gets an entry when it
finishes — its tokens, without activations — and its label trains by recomputation.
"""

from __future__ import annotations

import dataclasses

import concurrent.futures
import random
import time
from typing import Callable, Protocol

from engine.malloc_tuning import HeapWarmer
from engine.outputs import RequestOutput, StepStats
from engine.recording import RecordedPrefill, RecordSpec
from trainer.cache import ActivationCache
from trainer.entries import EntryState, GroupEntry
from trainer.config import TrainConfig
from trainer.ledger import Ledger
from trainer.ledger_db import ChoiceRecord, ClientPrompt, RequestRecord
from trainer.methods import TrainingMethod
from trainer.rewards import RewardScorer
from trainer.status import TrainingStats


class DeviceRoom(Protocol):
    """Whether a recording's never-freed tensors fit on the device (the offloader)."""

    def admits(self, num_tokens: int, cached_tokens: int = 0) -> bool: ...


class Recorder:
    def __init__(self, config: TrainConfig, method: TrainingMethod, cache: ActivationCache,
                 adapter_version: Callable[[], int], trained_version: Callable[[], int], stats: TrainingStats,
                 device_room: DeviceRoom | None = None, warmer: HeapWarmer | None = None,
                 rewards: RewardScorer | None = None, ledger: Ledger | None = None,
                 recording_paused: Callable[[], bool] = lambda: False):
        """`warmer`: pre-faulted heap (engine.malloc_tuning.HeapWarmer), released just
        before a recording and sized to the largest one; `rewards`: the reward function's
        scorer (trainer/rewards.py), which gets each finished group; `ledger`: the feedback
        ledger, where every request that gets an entry is written (queued: its answer, not
        the device thread, waits for the commit);
        `recording_paused`: no prefill is recorded meanwhile (the weights serving runs
        under cannot be recorded with: the eval gate scores a candidate and the promoted
        version's weights are not stashed, as with `max_staleness` 0); `adapter_version`: the
        version serving, which recordings and the ledger are stamped with; `trained_version`:
        the optimizer's, against which a recording's staleness is counted."""
        self.trained_version = trained_version
        self.ledger = ledger
        self.recording_paused = recording_paused
        # what is kept of a request only for the reward function and the ledger
        self.keeps_client_prompt = rewards is not None or ledger is not None
        self.config = config
        self.method = method
        self.wants_served_logprobs = method.uses_feedback
        self.rewards = rewards
        self.cache = cache
        self.adapter_version = adapter_version
        self.stats = stats
        self.device_room = device_room
        self.warmer = warmer
        self._rng = random.Random(config.seed)
        # measured bytes per recorded prompt token (to predict whether a recording fits)
        self._bytes_per_token: float | None = None
        # bytes a recording holds per cached prompt token it read (its K/V rows), once seen
        self._bytes_per_cached_token = 0.0
        # completion id -> choice index -> served token ids, for recorded requests in flight
        self._responses: dict[str, dict[int, list[int]]] = {}
        # completion id -> choice index -> each served token's log-prob, and the response
        # text (kept for the reward function and the ledger only)
        self._token_logps: dict[str, dict[int, list[float]]] = {}
        self._texts: dict[str, dict[int, str]] = {}
        # completion id -> choice index -> why it finished, for the ledger: (finish_reason, stop_reason)
        self._finish_reasons: dict[str, dict[int, tuple[str, str | int | None]]] = {}
        # completion id -> the prompt as the client wrote it (kept for the reward function and the ledger)
        self._client_prompts: dict[str, ClientPrompt] = {}
        # completion id -> the temperature its tracked log-probs are taken at, where it is not 1
        self._logprob_temperatures: dict[str, float] = {}
        # completion id -> (prompt token ids, adapter version) of trainable requests in
        # flight that were not recorded: they get a label entry when they finish
        self._label_only: dict[str, tuple[list[int], int]] = {}
        # completion id -> the ledger's commit of its finished answer, until it lands (read on the event loop)
        self._answers_written: dict[str, concurrent.futures.Future] = {}

    # -- PrefillRecorder ------------------------------------------------------------------

    def logprob_temperature(self, sampling_temperature: float, num_choices: int) -> float:
        """GRPO's log-probs, served and trained, are its sampling distribution's (TRL divides
        the logits by its temperature), a greedy group's the model's own; DPO's are the
        model's own (its policy log-probs), as are those of a request the method does not
        train on."""
        if (self.method.logprobs_at_sampling_temperature and sampling_temperature > 0.0
                and self.method.trains_on(num_choices)):
            return sampling_temperature
        return 1.0

    def expect(self, request_id: str, expected: bool = True) -> None:
        if not expected:
            self.cache.expected.discard(request_id)
        elif self.method.uses_feedback:
            self.cache.expected.add(request_id)

    def admit(self, request_id: str, prompt_token_ids: list[int], num_choices: int = 1,
              client_prompt: object = None, logprob_temperature: float = 1.0,
              num_cached_tokens: int = 0) -> RecordSpec | None:
        if not self.method.trains_on(num_choices):
            self.cache.expected.discard(request_id)  # its feedback: why it cannot take one, once it ends
            return None
        if logprob_temperature != 1.0:
            self._logprob_temperatures[request_id] = logprob_temperature
        if self.keeps_client_prompt and client_prompt is not None:
            self._client_prompts[request_id] = client_prompt if isinstance(client_prompt, ClientPrompt) \
                else ClientPrompt(client_prompt)
        spec = None if self.recording_paused() else self._decide(len(prompt_token_ids), num_cached_tokens)
        if spec is None and self.method.uses_feedback:  # its label will train by recomputation
            self._label_only[request_id] = (list(prompt_token_ids), self.adapter_version())
            self._responses[request_id] = {}
        return spec

    def confirm(self, request_id: str, prompt_token_ids: list[int], spec: RecordSpec,
                num_cached_tokens: int = 0) -> RecordSpec | None:
        """An admitted recording holds while the weights serving runs under are its
        version's, recording is not paused and what it would record (after the
        `num_cached_tokens` the prefix cache holds now, which may be fewer than when it was
        admitted) is within `max_record_tokens` and the offloader's device room as it is
        now; otherwise its prefill runs unrecorded and the request gets a label entry, as
        one not drawn does."""
        recorded = spec.tokens_to_record(len(prompt_token_ids), num_cached_tokens)
        if (not self.recording_paused() and spec.adapter_version == self.adapter_version()
                and recorded <= self.config.max_record_tokens
                and (self.device_room is None
                     or self.device_room.admits(len(prompt_token_ids), len(prompt_token_ids) - recorded))):
            if self.warmer is not None:  # each time: pages warmed again while it waited for KV blocks
                self.warmer.release()  # the recording's activations take the warm pages
            return spec
        with self.stats.lock:
            self.stats.not_recorded += 1
        if self.method.uses_feedback:
            self._label_only[request_id] = (list(prompt_token_ids), self.adapter_version())
            self._responses[request_id] = {}
        return None

    def _decide(self, num_prompt_tokens: int, num_cached_tokens: int) -> RecordSpec | None:
        """Whether to record a prompt of `num_prompt_tokens` whose first `num_cached_tokens`
        the prefix cache holds now: `max_record_tokens` and the activation cache's room by
        the tokens it would record and the cached tokens' K/V it would hold (a guess: the
        cache may change before its step); the offloader's device room by what it would
        keep of each (a cached token's keys and values) and the recorded tokens' step."""
        if self._rng.random() >= self.config.record_fraction:
            return None
        spec = self.method.record_spec(self.adapter_version())
        if not self.config.record_after_cached_prefix:
            spec = dataclasses.replace(spec, reads_cached_prefix=False)
        recorded = spec.tokens_to_record(num_prompt_tokens, num_cached_tokens)
        cached = num_prompt_tokens - recorded
        expected = (self._bytes_per_token or 0.0) * recorded + self._bytes_per_cached_token * cached
        if (recorded > self.config.max_record_tokens or not self.cache.has_room_for(int(expected))
                or (self.device_room is not None and not self.device_room.admits(num_prompt_tokens, cached))
                or self._would_go_stale()):
            with self.stats.lock:
                self.stats.not_recorded += 1
            return None
        return spec

    def _would_go_stale(self) -> bool:
        """Whether the recordings ready to train before this one take more optimizer steps
        than it may wait (`max_staleness`): it would be recomputed when its turn came, and
        recording it would only cost its prefill and the cache's room. Only where its label
        would train by recomputation just the same: a method with label entries (CPT trains
        on what it recorded), and stale recordings recomputed rather than dropped."""
        if not self.method.uses_feedback or self.config.stale_policy != "recompute":
            return False
        bound = self.config.max_staleness
        lag = self.cache.lag_of_next_recording(self.trained_version(), self.adapter_version(), bound,
                                               self.config.cohort_max_entries)
        return lag > bound

    def on_recorded(self, request_id: str, recording: RecordedPrefill) -> None:
        self._bytes_per_token = recording.recorded_bytes / max(recording.rows, 1)
        if recording.prefix_len:
            self._bytes_per_cached_token = (recording.saved_bytes - recording.recorded_bytes) / recording.prefix_len
        if self.warmer is not None:
            self.warmer.fit(recording.saved_sizes)
        entry = self.method.make_entry(request_id, recording)
        self._write_request(request_id, entry.prompt_token_ids, entry.adapter_version)
        added = self.cache.add(entry)
        self.cache.expected.discard(request_id)
        if added:
            self._responses[request_id] = {}
        with self.stats.lock:
            if added:
                self.stats.recorded += 1
                self.stats.recorded_cached_tokens += recording.prefix_len
                self.stats.recorded_prompt_tokens += len(recording.prompt_token_ids) - recording.prefix_len
            else:
                self.stats.not_recorded += 1

    # -- EngineObserver -------------------------------------------------------------------

    def on_step(self, stats: StepStats) -> None:
        """Nothing per step: a request's outputs are all it needs."""

    def on_output(self, output: RequestOutput) -> None:
        request_id = output.request_id
        responses = self._responses.get(request_id)
        if responses is None:
            if output.finished:
                expected = request_id in self.cache.expected
                self.cache.expected.discard(request_id)
                if self.method.uses_feedback and not _aborted(output):
                    group = self.method.trains_on(len(output.outputs))
                    self.cache.note_ended(request_id, EntryState.NOT_TRAINABLE if group else EntryState.NOT_A_GROUP)
                elif expected:  # cut short while it was queued: its feedback says so, as an entry's would
                    self.cache.note_ended(request_id, EntryState.DROPPED, counted=True)
                self._client_prompts.pop(request_id, None)
                self._logprob_temperatures.pop(request_id, None)
            return
        token_logps = self._token_logps.setdefault(request_id, {})
        texts = self._texts.setdefault(request_id, {})
        reasons = self._finish_reasons.setdefault(request_id, {})
        for completion in output.outputs:
            responses.setdefault(completion.index, []).extend(completion.token_ids)
            if completion.finish_reason is not None:
                reasons[completion.index] = (completion.finish_reason, completion.stop_reason)
            texts[completion.index] = texts.get(completion.index, "") + completion.text
            if completion.token_logprob_values is not None:
                token_logps.setdefault(completion.index, []).extend(completion.token_logprob_values)
        if output.finished:
            del self._responses[request_id], self._token_logps[request_id], self._texts[request_id]
            del self._finish_reasons[request_id]
            logps = {index: sum(values) for index, values in token_logps.items()}
            temperature = self._logprob_temperatures.pop(request_id, 1.0)
            aborted = _aborted(output)
            label_only = self._label_only.pop(request_id, None)
            if label_only is not None and not aborted:
                self._write_request(request_id, *label_only)
                self.cache.add(self.method.make_label_entry(request_id, *label_only))
            elif label_only is not None:  # cut short, unrecorded: no entry to drop, but its feedback says why
                self.cache.note_ended(request_id, EntryState.DROPPED, counted=True)
            self.cache.expected.discard(request_id)
            if self.ledger is not None and (label_only is None or not aborted):
                self._keep_answer(request_id, self.ledger.record_finished(request_id, [
                    ChoiceRecord(i, responses[i], texts.get(i, ""), token_logps.get(i), *reasons.get(i, (None, None)),
                                 logprob_temperature=temperature if i in token_logps and temperature != 1.0 else None)
                    for i in sorted(responses)], aborted))
            entry = self.cache.get(request_id)
            if entry is not None:  # (before a label can come)
                entry.texts_read = {i: texts.get(i, "") for i, (reason, stop) in reasons.items()
                                    if reason == "stop" and isinstance(stop, str)}
            waiting = self.cache.response_finished(request_id, responses, aborted, logps, token_logps,
                                                   logprob_temperature=temperature)
            client = self._client_prompts.pop(request_id, None)
            if self.rewards is not None and isinstance(waiting, GroupEntry):
                self.rewards.score(waiting, client.prompt if client is not None else None,
                                   [texts[i] for i in sorted(texts)])

    def answer_written(self, request_id: str) -> concurrent.futures.Future | None:
        """The ledger's commit of a finished request's answer while it is on its way: the
        server answers once it lands, so that a label for an answered request finds it after
        a crash (called on the event loop)."""
        return self._answers_written.get(request_id)

    def _keep_answer(self, request_id: str, written: concurrent.futures.Future | None) -> None:
        if written is not None:
            self._answers_written[request_id] = written
            written.add_done_callback(lambda _: self._answers_written.pop(request_id, None))

    def _write_request(self, request_id: str, prompt_token_ids: list[int], adapter_version: int) -> None:
        """Writes a request to the ledger before its entry exists, so a label never
        reaches the ledger before its request."""
        if self.ledger is not None:
            client = self._client_prompts.get(request_id) or ClientPrompt(None)
            self.ledger.record_request(RequestRecord(request_id, time.time(), adapter_version, self.method.name,
                                                     list(prompt_token_ids),
                                                     None if not client.as_written else
                                                     client.prompt if client.rendered is None else client.rendered,
                                                     client.tools, client.chat_template_kwargs,
                                                     client.generation_prompt))


def _aborted(output: RequestOutput) -> bool:
    return all(c.finish_reason == "abort" for c in output.outputs)
