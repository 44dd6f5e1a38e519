"""Training methods: how a mode turns a cache entry into LoRA gradients, two ways.

Each method has one loss (trainer/losses.py) fed by two jobs:
  - `reuse_job`: from the recorded prefill — backward only for the prompt (CPT), or the
    responses forwarded against the prompt's recorded K/V and the prompt's backward run
    once (DPO);
  - `recompute_job`: the separate trainer the paper compares against — a full forward
    from tokens, then backward (DPO: `[prompt+chosen; prompt+rejected]` in one batch, as
    TRL does, so the prompt is computed twice).
Jobs are generators: each `yield` ends one slice (one layer's forward or backward, the
loss); they accumulate gradients into the LoRA parameters and return a `JobResult`. The
optimizer step is the trainer's. Subclass `TrainingMethod` (with its own `CacheEntry`)
to add a method — the paper's `train_on_cache`; see examples/custom_method.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from engine.model_runner import ModelRunner
from engine.recording import RecordedPrefill, RecordSpec
from trainer.adapter import adapters_disabled
from trainer.cache import CacheEntry, PreferenceEntry
from trainer.forward import backward_segments, forward_segments, kv_leaves, within
from trainer.losses import cpt_loss, dpo_loss, token_logprobs


@dataclass
class TrainContext:
    runner: ModelRunner
    # the PeftModel (for disable_adapter when computing reference log-probs)
    peft_model: object
    # the activation offloader, when a device budget is set (offload/)
    offloader: object | None = None

    def residency(self, recording: RecordedPrefill):
        """What brings the recording's freed layers back for backward (None: all resident)."""
        return None if self.offloader is None else self.offloader.residency(recording)


@dataclass
class JobResult:
    loss: float
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


def _ids(ctx: TrainContext, tokens: list[int]) -> torch.Tensor:
    return torch.tensor(tokens, device=ctx.runner.device)


def _head(ctx: TrainContext, hidden: torch.Tensor) -> torch.Tensor:
    """(N, hidden) last-layer outputs -> (N, V) logits."""
    return ctx.runner.lm_head(ctx.runner.norm(hidden))


class TrainingMethod:
    name = "base"
    # which prefill logits the recording keeps (RecordSpec.all_logit_rows)
    all_logit_rows = True
    # entries wait for POST /v1/feedback
    uses_feedback = False

    def record_spec(self, adapter_version: int) -> RecordSpec:
        """How a prefill is recorded for this method, under `adapter_version`."""
        return RecordSpec(all_logit_rows=self.all_logit_rows, adapter_version=adapter_version)

    def make_entry(self, completion_id: str, recording: RecordedPrefill) -> CacheEntry:
        return CacheEntry(completion_id, list(recording.prompt_token_ids), recording, recording.adapter_version,
                          recording.saved_bytes)

    def make_label_entry(self, completion_id: str, prompt_token_ids: list[int], adapter_version: int) -> CacheEntry:
        """An entry without activations, for a request that can receive feedback but whose
        prefill was not recorded (or was given up): it trains by recomputation."""
        return CacheEntry(completion_id, list(prompt_token_ids), None, adapter_version, 0)

    def reuse_job(self, entry: CacheEntry, ctx: TrainContext):
        raise NotImplementedError

    def recompute_job(self, entry: CacheEntry, ctx: TrainContext):
        raise NotImplementedError


class CPTMethod(TrainingMethod):
    """Continual pre-training on the prompt: mean next-token cross-entropy."""

    name = "cpt"
    all_logit_rows = True

    def loss(self, logits: torch.Tensor, entry: CacheEntry, ctx: TrainContext):
        return cpt_loss(logits, _ids(ctx, entry.prompt_token_ids))

    def reuse_job(self, entry: CacheEntry, ctx: TrainContext):
        recording = entry.recording
        with torch.enable_grad():
            loss, metrics = self.loss(recording.logits, entry, ctx)
            loss.backward()  # the head segment: fills recording.head_leaf.grad
        yield
        yield from backward_segments(recording.segments, recording.head_leaf.grad,
                                     residency=ctx.residency(recording))
        return JobResult(metrics["loss"], metrics["tokens"], metrics)

    def recompute_job(self, entry: CacheEntry, ctx: TrainContext):
        fwd = yield from forward_segments(ctx.runner, [entry.prompt_token_ids])
        with torch.enable_grad():
            loss, metrics = self.loss(_head(ctx, fwd.head_leaf[0]), entry, ctx)
            loss.backward()
        yield
        yield from backward_segments(fwd.segments, fwd.head_leaf.grad)
        return JobResult(metrics["loss"], metrics["tokens"], metrics)


class DPOMethod(TrainingMethod):
    """Direct preference optimization over a shared prompt (sigmoid loss)."""

    name = "dpo"
    all_logit_rows = False  # only the last prompt row: it scores each response's first token
    uses_feedback = True

    def __init__(self, beta: float = 0.1):
        self.beta = beta

    def make_entry(self, completion_id: str, recording: RecordedPrefill) -> PreferenceEntry:
        return PreferenceEntry(completion_id, list(recording.prompt_token_ids), recording,
                               recording.adapter_version, recording.saved_bytes)

    def make_label_entry(self, completion_id: str, prompt_token_ids: list[int],
                         adapter_version: int) -> PreferenceEntry:
        return PreferenceEntry(completion_id, list(prompt_token_ids), None, adapter_version, 0)

    def _response_logp(self, ctx: TrainContext, prompt_len: int, response: list[int], last_logits: torch.Tensor,
                       prefix, with_grad: bool):
        """Generator -> (summed log p(response | prompt), the response's SegmentedForward or None).
        last_logits (1, V): the prompt's last row, which scores the first response token."""
        grad_mode = torch.enable_grad if with_grad else torch.no_grad
        with grad_mode():
            logp = token_logprobs(last_logits, _ids(ctx, response[:1])).sum()
        fwd = None
        if len(response) > 1:
            fwd = yield from forward_segments(ctx.runner, [response[:-1]], [prompt_len], prefix, with_grad)
            with grad_mode():
                logp = logp + token_logprobs(_head(ctx, fwd.head_leaf[0]), _ids(ctx, response[1:])).sum()
        return logp, fwd

    def reference_logps(self, entry: PreferenceEntry, ctx: TrainContext):
        """Generator -> (chosen, rejected) summed log-probs under the base model, no grad."""
        def compute():
            prompt = yield from forward_segments(ctx.runner, [entry.prompt_token_ids], with_grad=False)
            last = _head(ctx, prompt.head_leaf[0, -1:])
            results = []
            for response in (entry.label.chosen, entry.label.rejected):
                logp, _ = yield from self._response_logp(ctx, len(entry.prompt_token_ids), response, last,
                                                         prompt.kv, with_grad=False)
                results.append(logp.item())
            return tuple(results)

        def base_model_no_grad():
            stack = contextlib.ExitStack()
            stack.enter_context(torch.no_grad())
            stack.enter_context(adapters_disabled(ctx.peft_model))
            return stack

        return (yield from within(base_model_no_grad, compute()))

    def loss(self, policy_chosen, policy_rejected, entry: PreferenceEntry):
        reference_chosen, reference_rejected = (torch.tensor(v) for v in entry.reference_logps)
        return dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, self.beta)

    def reuse_job(self, entry: PreferenceEntry, ctx: TrainContext):
        """Shared-prefix schedule: the responses read the prompt's K/V as detached leaves
        and accumulate gK/gV there; the prompt's backward runs once at the end.

        To hold as little as possible, only one response graph is alive at a time: the
        loss needs the other response's log-prob only as a value, to give the first its
        gradient. That value is reused from serving when the other response is the served
        one (it was scored while decoding, under this same adapter version); otherwise the
        shorter response is scored once without grad. Then each response is forwarded and
        back-propagated in turn. Peak: the prompt's recording plus one response's graph."""
        if entry.reference_logps is None:
            entry.reference_logps = yield from self.reference_logps(entry, ctx)
        recording, label = entry.recording, entry.label
        prompt_len = len(entry.prompt_token_ids)
        prefix = kv_leaves(recording.segments)
        last = recording.logits[-1:].detach().requires_grad_()
        responses = {"chosen": label.chosen, "rejected": label.rejected}
        if label.served_logps:
            second = next(iter(label.served_logps))
            second_value = torch.tensor(label.served_logps[second])
        else:
            second = min(responses, key=lambda k: len(responses[k]))
            detached_prefix = [(k.detach(), v.detach()) for k, v in prefix]
            second_value, _ = yield from self._response_logp(ctx, prompt_len, responses[second], last.detach(),
                                                             detached_prefix, with_grad=False)
        first = "rejected" if second == "chosen" else "chosen"
        first_logp, first_fwd = yield from self._response_logp(ctx, prompt_len, responses[first], last, prefix, True)
        second_leaf = second_value.detach().clone().float().requires_grad_()
        policy = {first: first_logp, second: second_leaf}
        with torch.enable_grad():
            loss, metrics = self.loss(policy["chosen"], policy["rejected"], entry)
            loss.backward()
        yield
        if first_fwd is not None:
            yield from backward_segments(first_fwd.segments, first_fwd.head_leaf.grad)
        second_logp, second_fwd = yield from self._response_logp(ctx, prompt_len, responses[second], last, prefix,
                                                                 True)
        with torch.enable_grad():
            second_logp.backward(second_leaf.grad)
        yield
        if second_fwd is not None:
            yield from backward_segments(second_fwd.segments, second_fwd.head_leaf.grad)
        with torch.enable_grad():
            recording.logits[-1:].backward(last.grad)  # the prompt's head segment
        yield
        yield from backward_segments(recording.segments, recording.head_leaf.grad,
                                     [(k.grad, v.grad) for k, v in prefix], ctx.residency(recording))
        return JobResult(metrics["loss"], entry.num_tokens, metrics)

    def recompute_job(self, entry: PreferenceEntry, ctx: TrainContext):
        if entry.reference_logps is None:
            entry.reference_logps = yield from self.reference_logps(entry, ctx)
        prompt, label = entry.prompt_token_ids, entry.label
        fwd = yield from forward_segments(ctx.runner, [prompt + label.chosen, prompt + label.rejected])
        with torch.enable_grad():
            logps = []
            for b, response in enumerate((label.chosen, label.rejected)):
                first = fwd.offsets[b] + len(prompt) - 1  # the row that scores the response's first token
                rows = fwd.head_leaf[0, first:first + len(response)]
                logps.append(token_logprobs(_head(ctx, rows), _ids(ctx, response)).sum())
            loss, metrics = self.loss(logps[0], logps[1], entry)
            loss.backward()
        yield
        yield from backward_segments(fwd.segments, fwd.head_leaf.grad)
        return JobResult(metrics["loss"], entry.num_tokens, metrics)
