"""The eval gate: a new adapter version serves only once it has been scored and has not
regressed (`--eval-set FILE`).

After each optimizer step the new version is a candidate. Serving stays on the promoted
version meanwhile — the weights serving reads are pinned to it: the merged copies on the
CPU (trainer/adapter.py) and the adapter's serving copy, which a GPU serves from and
which is not refreshed while pinned (trainer/serving_copy.py) —
a recorded prefill runs with the promoted version's weights from the stash (it trains
later on the stashed path, one version old), and the trainer starts no job —
while the gate scores the candidate in idle slices (one layer of a packed forward, or a
chunk of LM-head rows, per slice):
  - preference probes: the mean log-prob margin of chosen over rejected (nats);
  - completion probes: the mean log-prob of the completion (nats);
  - drift: the mean per-token KL(candidate || base model) over the served responses of
    the most recently trained requests (the base model's side computed once per sample).
The candidate is promoted unless a probe kind's mean falls more than `tolerance` nats
below the last promoted version's, or its KL exceeds `max_kl`. The verdict is carried out
by the adapter's lifecycle (trainer/lifecycle.py): promote (serving moves to it), or
reject (training returns to the promoted weights and optimizer state, the version number
is spent, and the step's labels are quarantined).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from engine.layerwise import LayerwiseModel
from trainer.adapter import LeanLoraLinear, adapters_disabled
from trainer.eval_set import Probe
from trainer.forward import forward_segments, head_score, within

logger = logging.getLogger(__name__)

# tokens of a served prompt (its end) and response kept for the KL sample, and response rows scored
KL_MAX_TOKENS = 256
KL_MAX_ROWS = 32


@dataclass(eq=False)
class KLSample:
    """A trained prompt with its served response: the KL is measured on the rows that
    predict the response (`start` on), against the base model's log-probs there."""

    tokens: list[int]
    start: int
    # (rows, vocabulary) log-probs under the base model, once computed (float16)
    base_logp: torch.Tensor | None = None

    @property
    def rows(self) -> int:
        return len(self.tokens) - self.start

    @classmethod
    def of(cls, prompt: list[int], response: list[int]) -> "KLSample":
        response = list(response)[:KL_MAX_ROWS]
        if not response:  # nothing served to measure on
            return cls(list(prompt)[-KL_MAX_TOKENS:], len(list(prompt)[-KL_MAX_TOKENS:]))
        tokens = (list(prompt) + response)[-KL_MAX_TOKENS:]
        # rows start .. end−1 predict the response's tokens (the last token predicts past it: not fed)
        return cls(tokens[:-1], len(tokens) - len(response) - 1)


@dataclass(frozen=True)
class Scores:
    version: int
    # means over the probes of each kind (None: the eval set has none of that kind)
    preference_margin: float | None
    completion_logprob: float | None
    # mean per-token KL(version || base) over the KL sample (None: no sample yet)
    kl: float | None
    seconds: float

    def as_dict(self) -> dict:
        return {"version": self.version, "preference_margin": self.preference_margin,
                "completion_logprob": self.completion_logprob, "kl": self.kl, "seconds": round(self.seconds, 4)}


@dataclass(frozen=True)
class Verdict:
    scores: Scores
    # why the candidate failed (empty: promoted)
    failures: tuple[str, ...] = ()
    # the completion ids whose labels trained into the candidate
    trained_ids: tuple[str, ...] = ()
    # a baseline scoring (after a rollback): nothing to judge
    baseline: bool = False

    @property
    def promoted(self) -> bool:
        return not self.failures


def judge(candidate: Scores, promoted: Scores, tolerance: float, max_kl: float | None) -> tuple[str, ...]:
    """Why `candidate` may not serve after `promoted` (empty: it may)."""
    failures = []
    for name, label in (("preference_margin", "preference probes' mean margin"),
                        ("completion_logprob", "completion probes' mean log-prob")):
        new, old = getattr(candidate, name), getattr(promoted, name)
        if new is not None and old is not None and new < old - tolerance:
            failures.append(f"{label} fell from {old:.3f} to {new:.3f} nats (tolerance {tolerance:g})")
    if max_kl is not None and candidate.kl is not None and candidate.kl > max_kl:
        failures.append(f"KL to the base model {candidate.kl:.4f} exceeds {max_kl:g}")
    return tuple(failures)


@dataclass
class GateStats:
    evaluations: int = 0
    eval_seconds: float = 0.0
    promoted: int = 0
    rejected: int = 0


class EvalGate:
    def __init__(self, probes: list[Probe], runner: LayerwiseModel, peft_model, tolerance: float,
                 max_kl: float | None, kl_prompts: int, head_chunk_rows: int = 64):
        self.probes = probes
        self.runner = runner
        self.peft_model = peft_model
        self.tolerance = tolerance
        self.max_kl = max_kl
        self.head_chunk_rows = head_chunk_rows
        self.layers = [m for m in peft_model.modules() if isinstance(m, LeanLoraLinear)]
        # recently trained prompts with their served responses (the KL sample)
        self.recent: collections.deque[KLSample] = collections.deque(maxlen=kl_prompts)
        self.promoted: Scores | None = None
        # the promoted scores are another version's (a rollback's weights not scored yet): not shown
        self.rescoring = False
        self.last_rejected: tuple[Scores, tuple[str, ...]] | None = None
        self.stats = GateStats()
        # the version being scored, its scoring (a generator) and its labels' completion ids
        self._candidate: int | None = None
        self._scoring = None
        self._trained_ids: tuple[str, ...] = ()
        self._baseline = False
        # seconds the slices of the scoring in progress have taken
        self._busy = 0.0

    # -- what the rest of training asks -------------------------------------------------

    @property
    def pending(self) -> bool:
        """A version is being scored: the trainer waits, and serving stays pinned."""
        return self._candidate is not None

    @property
    def candidate_version(self) -> int | None:
        return None if self._baseline else self._candidate

    def candidate(self, version: int, entries) -> None:
        """An optimizer step made `version` from `entries`: pin serving to the promoted
        weights and score it in the next slices."""
        for entry in entries:
            response = entry.responses.get(0) or next(iter(entry.responses.values()), [])
            self.recent.append(KLSample.of(entry.prompt_token_ids, response))
        self.pin(True)
        self._start(version, tuple(e.completion_id for e in entries), baseline=False)

    def rebaseline(self, version: int) -> None:
        """The live weights changed by hand (a rollback): score them as the promoted
        version's baseline, judging nothing; a candidate being scored is dropped."""
        self.pin(False)
        if self.promoted is not None:  # the bar stays until the new weights are scored
            self.promoted = dataclasses.replace(self.promoted, version=version)
            self.rescoring = True
        self._start(version, (), baseline=True)

    def score_now(self, version: int) -> Scores:
        """Scores the live weights at once (at start, before serving): the baseline."""
        self._start(version, (), baseline=True)
        verdict = None
        while verdict is None:
            verdict = self.run_slice()
        return verdict.scores

    def run_slice(self) -> Verdict | None:
        """One slice of the scoring; the verdict once it is complete (device thread)."""
        started = time.perf_counter()
        failures: tuple[str, ...] = ()
        try:
            with self._scoring_weights():
                next(self._scoring)
            return None
        except StopIteration as stop:
            scores: Scores = stop.value
        except Exception as exc:  # noqa: BLE001 - a version that cannot be scored does not serve
            logger.exception("eval gate: scoring version %d failed", self._candidate)
            scores, failures = Scores(self._candidate, None, None, None, 0.0), (f"scoring failed: {exc!r}",)
        finally:
            self._busy += time.perf_counter() - started
        scores = dataclasses.replace(scores, seconds=self._busy)
        self.stats.evaluations += 1
        self.stats.eval_seconds += scores.seconds
        if not failures and not self._baseline and self.promoted is not None:
            failures = judge(scores, self.promoted, self.tolerance, self.max_kl)
        verdict = Verdict(scores, failures, self._trained_ids, self._baseline)
        self._candidate, self._scoring, self._trained_ids = None, None, ()
        return verdict

    def drop_candidate(self) -> tuple[str, ...]:
        """Ends the candidate's scoring unfinished, for a verdict reached elsewhere (rank 0's,
        among replicas); the completion ids whose labels trained into it."""
        trained = self._trained_ids
        self._candidate, self._scoring, self._trained_ids = None, None, ()
        return trained

    def settled(self, verdict: Verdict, promoted_version: int) -> None:
        """The lifecycle carried out `verdict`; `promoted_version` now serves."""
        if verdict.baseline or verdict.promoted:
            self.rescoring = bool(verdict.failures)
        if verdict.baseline and verdict.failures:  # the bar could not be scored: the last one stays
            if self.promoted is not None:
                self.promoted = dataclasses.replace(self.promoted, version=promoted_version)
        elif verdict.promoted:
            self.promoted = dataclasses.replace(verdict.scores, version=promoted_version)
            self.stats.promoted += not verdict.baseline
        else:
            self.last_rejected = (verdict.scores, verdict.failures)
            self.stats.rejected += 1
            self.promoted = dataclasses.replace(self.promoted, version=promoted_version)
        self.pin(False)

    def pin(self, pinned: bool) -> None:
        """Serving keeps (True) the promoted version's weights (merged copies, serving copy)
        however the live LoRA weights change, or (False) follows them again."""
        for layer in self.layers:
            layer.serving_pinned = pinned

    # -- scoring ------------------------------------------------------------------------

    def _start(self, version: int, trained_ids: tuple[str, ...], baseline: bool) -> None:
        self._candidate, self._trained_ids, self._baseline = version, trained_ids, baseline
        self._scoring = self._score(version)
        self._busy = 0.0

    @contextlib.contextmanager
    def _scoring_weights(self):
        """Within a slice: the live (candidate) LoRA weights, never the pinned merged copy."""
        previous = [layer.weights_swapped for layer in self.layers]
        for layer in self.layers:
            layer.weights_swapped = True
        try:
            yield
        finally:
            for layer, was in zip(self.layers, previous):
                layer.weights_swapped = was

    def _score(self, version: int):
        """Generator over slices: the live weights' Scores (their `seconds` filled in by
        `run_slice`, which times the slices)."""
        sequences = [p.prompt_ids + r[:-1] for p in self.probes for r in p.responses]
        fwd = yield from forward_segments(self.runner, sequences, with_grad=False)
        logps, row = [], 0
        for probe in self.probes:
            for response in probe.responses:
                targets = torch.tensor(response, device=self.runner.device)
                score = head_score(self.runner, fwd.head_leaf, fwd.offsets[row] + len(probe.prompt_ids) - 1,
                                   targets, self.head_chunk_rows)
                logps.append(float((yield from score)))
                row += 1
        margins, completions, i = [], [], 0
        for probe in self.probes:
            if probe.kind == "preference":
                margins.append(logps[i] - logps[i + 1])
            else:
                completions.append(logps[i])
            i += len(probe.responses)
        kl = yield from self._kl()
        return Scores(version, _mean(margins), _mean(completions), kl, 0.0)

    def _kl(self):
        """Generator: the mean per-token KL(live || base) over the response rows of the KL
        sample (None: no sample). The base model's log-probs of a sample are computed the
        first time it is scored and kept with it (the base never changes)."""
        sample = [s for s in self.recent if s.rows > 0]
        if not sample:
            return None
        for missing in [s for s in sample if s.base_logp is None]:
            base = yield from within(lambda: adapters_disabled(self.peft_model),
                                     forward_segments(self.runner, [missing.tokens], with_grad=False))
            with torch.no_grad():
                missing.base_logp = torch.log_softmax(self._logits(base.head_leaf[0, missing.start:]), -1).to(
                    torch.float16)
            yield
        live = yield from forward_segments(self.runner, [s.tokens for s in sample], with_grad=False)
        total = 0.0
        for s, offset in zip(sample, live.offsets):
            with torch.no_grad():
                log_p = torch.log_softmax(self._logits(live.head_leaf[0, offset + s.start:offset + len(s.tokens)]), -1)
                total += float((log_p.exp() * (log_p - s.base_logp.float())).sum())
            yield
        return total / sum(s.rows for s in sample)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.runner.lm_head(self.runner.norm(hidden)).float()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None

