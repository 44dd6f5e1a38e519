"""GRPO on a group of samples of one prompt (`--train-mode grpo`).

A request with n >= 2 choices is a group: one recording of its prompt (the choices forked
its KV blocks in serving, engine/scheduler.py), each sample's tokens and the log-prob
decoding gave each token (log π_old, under the adapter version that served it). When a
reward per sample arrives (POST /v1/feedback, or `train.reward_function`), the loss is
GRPO's (trainer/losses.py): group-normalised advantages, the clipped ratio against the
served log-probs per token, optionally a KL term to the base model. Every log-prob, served,
trained and the reference's, is the sampling distribution's: the logits divided by the
group's temperature (`entry.logprob_temperature`), as TRL's GRPOTrainer takes them.

Two jobs, as for every method (trainer/methods.py):
  - `reuse_job`, the shared-prefix schedule (papers/shared-prefix-reuse.txt) on the
    served recording: the samples' suffixes are forwarded against the prompt's K/V as
    detached leaves (expanded to every row), in batches of as many samples as the dense
    trainer's token bound holds (one at a time when the offloader's budget has no room
    for a batch's graphs), and back-propagated at once, their gK/gV accumulating in the
    leaves; then the prompt's backward runs once. A group in one batch back-propagates
    with the prompt in one top-down sweep (trainer.forward.backward_sweep, with
    `train.one_backward_sweep` and no device budget); micro-batches each run their own
    sweep first, the prompt's layer needing every one's gK/gV (measured in BENCHMARKS.md,
    "One backward sweep for suffixes and prompt"). The prompt's forward is serving's:
    it is not computed here at all;
  - `recompute_job`, for a group without a usable recording: the prompt and the samples
    packed in one forward (AttentionMetadata.shared_prefix), the prompt computed once,
    in packs of as many samples as fit beside it in `recompute_tokens` (the server's
    `train.max_record_tokens`);
  - `baseline_job`, the dense trainer the paper compares against (TRL's GRPOTrainer):
    each sample a row `prompt + response`, the group in one batch where it fits in
    `recompute_tokens`, else in micro-batches of as many rows as fit; the prompt is
    computed once per row, in the KL term's reference too.
A sample whose advantage is 0 gives no gradient (without the KL term) and is skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.recording import RecordedPrefill
from trainer.entries import GroupEntry
from trainer.forward import backward_segments, forward_segments, head_token_loss, kv_leaves, within
from trainer.losses import group_advantages, grpo_token_loss, token_logprobs
from trainer.methods import (JobResult, TrainContext, TrainingMethod, base_model_no_grad, head_logits,
                             prompt_backward, suffixes_and_prompt_backward)


@dataclass
class _Tally:
    """What a job's losses saw of its group's tokens, TRL's GRPO figures: those whose ratio to
    the served log-prob was clipped (`clip_ratio/region_mean`, over all `tokens` of the group's
    samples, a sample without advantage never clipped) and the KL to the reference (`kl`,
    with its term on). Kept on the device until the job ends, then read at once."""

    tokens: int
    sums: list[torch.Tensor] = field(default_factory=list)  # per loss call: (clipped tokens, KL summed over its tokens)
    kl_tokens: int = 0

    @classmethod
    def of(cls, entry: GroupEntry) -> "_Tally":
        return cls(sum(map(len, entry.responses.values())))

    def add(self, logps: torch.Tensor, served: torch.Tensor, advantage: float, clip_eps: float,
            reference: torch.Tensor | None) -> None:
        with torch.no_grad():
            ratio = torch.exp(logps.detach() - served)
            clipped = ratio > 1 + clip_eps if advantage > 0 else ratio < 1 - clip_eps if advantage < 0 \
                else torch.zeros_like(ratio, dtype=torch.bool)
            kl = logps.new_zeros(())
            if reference is not None:
                log_ratio = reference - logps.detach()
                kl = (torch.exp(log_ratio) - log_ratio - 1).sum()
                self.kl_tokens += len(logps)
            self.sums.append(torch.stack([clipped.sum().float(), kl.float()]))

    def result(self, loss: float, tokens: int) -> JobResult:
        clipped, kl = torch.stack(self.sums).sum(0).tolist() if self.sums else (0.0, 0.0)
        return JobResult(loss, tokens, {"loss": loss, "clipped_tokens": clipped, "completion_tokens": self.tokens,
                                        "kl_sum": kl, "kl_tokens": self.kl_tokens})


class GRPOMethod(TrainingMethod):
    name = "grpo"
    all_logit_rows = False  # the prompt's last row scores each sample's first token
    reads_cached_prefix = True
    uses_feedback = True
    label_kind = "rewards"
    logprobs_at_sampling_temperature = True

    def __init__(self, beta: float = 0.0, clip_eps: float = 0.2, recompute_tokens: int | None = None):
        """`beta`: weight of the KL to the base model (0, as in current practice, needs no
        reference forward); `clip_eps`: the ratio's clip range; `recompute_tokens`: tokens
        per forward on the recompute paths (None: the whole group in one batch)."""
        self.beta = beta
        self.clip_eps = clip_eps
        self.recompute_tokens = recompute_tokens
        # rows per forward of the baseline, when set (benchmarks: 1, or the group)
        self.recompute_rows: int | None = None

    def _rows_per_forward(self, prompt_len: int, samples: list) -> int:
        if self.recompute_rows is not None:
            return self.recompute_rows
        if self.recompute_tokens is None or not samples:
            return max(len(samples), 1)
        longest = prompt_len + max(len(response) for _, response, _, _ in samples)
        return max(1, self.recompute_tokens // longest)

    def trains_on(self, num_choices: int) -> bool:
        return num_choices >= 2

    def make_entry(self, completion_id: str, recording: RecordedPrefill) -> GroupEntry:
        return GroupEntry(completion_id, list(recording.prompt_token_ids), recording, recording.adapter_version,
                          recording.saved_bytes)

    def make_label_entry(self, completion_id: str, prompt_token_ids: list[int], adapter_version: int) -> GroupEntry:
        return GroupEntry(completion_id, list(prompt_token_ids), None, adapter_version, 0)

    # -- the loss -------------------------------------------------------------------------

    def _samples(self, entry: GroupEntry) -> list[tuple[int, list[int], float, float]]:
        """(choice index, response, advantage, token weight) of each sample that gives a
        gradient; the weight makes the loss the mean over a sample's tokens, then over the group."""
        indices = sorted(entry.responses)
        advantages = group_advantages(torch.tensor([entry.label.rewards[i] for i in indices],
                                                   dtype=torch.float64)).tolist()
        return [(i, entry.responses[i], a, 1.0 / (len(indices) * len(entry.responses[i])))
                for i, a in zip(indices, advantages) if a != 0.0 or self.beta]

    def _token_loss(self, entry: GroupEntry, index: int, response: list[int], advantage: float, weight: float,
                    device: torch.device, tally: _Tally):
        """loss(logits, a): GRPO's loss over the response's tokens a .. a + len(logits) − 1
        (what it saw added to `tally`)."""
        targets = torch.tensor(response, device=device)
        served = entry.served_token_logps.get(index)
        reference = (entry.reference_token_logps or {}).get(index)

        def loss(logits: torch.Tensor, a: int) -> torch.Tensor:
            b = a + len(logits)
            logps = token_logprobs(logits, targets[a:b], entry.logprob_temperature)
            old = torch.tensor(served[a:b], device=device) if served is not None else logps.detach()
            ref = torch.tensor(reference[a:b], device=device) if reference is not None and self.beta else None
            tally.add(logps, old, advantage, self.clip_eps, ref)
            return grpo_token_loss(logps, old, advantage, weight, self.clip_eps, ref, self.beta)

        return loss

    def reference_token_logps(self, entry: GroupEntry, ctx: TrainContext):
        """Generator -> per choice, the base model's log-prob of each response token (no
        grad): the prompt and the samples in one forward, the samples attending to the
        prompt's keys (AttentionMetadata.shared_prefix), in packs of as many as fit
        beside the prompt in `recompute_tokens` (a slice's rows stay bounded)."""
        def compute():
            prompt, temperature = entry.prompt_token_ids, entry.logprob_temperature
            longer = [(index, response) for index, response in entry.responses.items() if len(response) > 1]
            per_pack = self._samples_per_pack(len(prompt), [response for _, response in longer])
            for start in range(0, max(len(longer), 1), per_pack):
                pack = longer[start:start + per_pack]
                fwd = yield from forward_segments(ctx.runner, [prompt, *(response[:-1] for _, response in pack)],
                                                  with_grad=False, shared_prefix=True)
                if start == 0:  # the first pack's prompt scores every sample's first token
                    last = head_logits(ctx, fwd.head_leaf[0, len(prompt) - 1:len(prompt)])
                    result = {index: token_logprobs(last, ctx.ids(response[:1]), temperature).tolist()
                              for index, response in entry.responses.items()}
                for b, (index, response) in enumerate(pack):
                    rows = fwd.head_leaf[0, fwd.offsets[b + 1]:fwd.offsets[b + 2]]
                    result[index] += token_logprobs(head_logits(ctx, rows), ctx.ids(response[1:]),
                                                    temperature).tolist()
            return result

        return (yield from within(lambda: base_model_no_grad(ctx), compute()))

    def _reference(self, entry: GroupEntry, ctx: TrainContext):
        if self.beta and entry.reference_token_logps is None:
            entry.reference_token_logps = yield from self.reference_token_logps(entry, ctx)

    def separate_trainer_reference_token_logps(self, entry: GroupEntry, ctx: TrainContext):
        """Generator -> `reference_token_logps` as TRL's GRPOTrainer computes them (the
        per-token log-probs of its `prompt + completion` rows with the adapter disabled, no
        grad): each sample a row, as many rows per forward as the dense trainer's, the
        prompt computed once per row (`baseline_job`'s)."""
        prompt = entry.prompt_token_ids

        def compute():
            samples = [(index, response, 0.0, 0.0) for index, response in sorted(entry.responses.items())]
            per_forward, result = self._rows_per_forward(len(prompt), samples), {}
            for start in range(0, len(samples), per_forward):
                batch = samples[start:start + per_forward]
                fwd = yield from forward_segments(ctx.runner, [prompt + response[:-1] for _, response, _, _ in batch],
                                                  with_grad=False)
                for b, (index, response, _, _) in enumerate(batch):
                    first = fwd.offsets[b] + len(prompt) - 1
                    logits = head_logits(ctx, fwd.head_leaf[0, first:first + len(response)])
                    result[index] = token_logprobs(logits, ctx.ids(response), entry.logprob_temperature).tolist()
            return result

        return (yield from within(lambda: base_model_no_grad(ctx), compute()))

    # -- the two jobs ---------------------------------------------------------------------

    def _suffix_rows(self, ctx: TrainContext, samples: list) -> int:
        """Samples per suffix forward: as many as the dense trainer's token bound holds
        (`recompute_tokens`; the whole group without one), or one at a time when the
        offloader's budget has no room for that batch's graphs."""
        longest = max((len(response) for _, response, _, _ in samples), default=1)
        rows = len(samples) if self.recompute_tokens is None else self.recompute_tokens // longest
        rows = max(1, min(rows, len(samples)))
        return rows if ctx.graph_fits(rows * longest) else 1

    def reuse_job(self, entry: GroupEntry, ctx: TrainContext):
        yield from self._reference(entry, ctx)
        recording = entry.recording
        prompt_len = len(entry.prompt_token_ids)
        prefix = kv_leaves(recording.segments)
        last = recording.logits[-1:].detach().requires_grad_()  # scores every sample's first token
        samples = self._samples(entry)
        tally = _Tally.of(entry)
        if not samples:  # no sample gives a gradient: nothing to back-propagate into the prompt
            return tally.result(0.0, entry.num_tokens)
        losses = {index: self._token_loss(entry, index, response, advantage, weight, last.device, tally)
                  for index, response, advantage, weight in samples}
        with torch.enable_grad():
            first = sum(losses[index](last, 0) for index, _, _, _ in samples)
            first.backward()
        total = first.item()
        longer = [sample for sample in samples if len(sample[1]) > 1]
        rows = self._suffix_rows(ctx, longer)
        for start in range(0, len(longer), rows):
            batch = longer[start:start + rows]
            fwd = yield from forward_segments(ctx.runner, [response[:-1] for _, response, _, _ in batch],
                                              [prompt_len] * len(batch), prefix)
            for b, (index, response, _, _) in enumerate(batch):
                total += yield from head_token_loss(ctx.runner, fwd.head_leaf, fwd.offsets[b], len(response) - 1,
                                                    lambda logits, a, loss=losses[index]: loss(logits, a + 1),
                                                    ctx.head_chunk_rows)
            if len(batch) == len(longer):  # the group in one batch: its backward and the prompt's, together
                yield from suffixes_and_prompt_backward(recording, last, fwd, prefix, ctx)
                return tally.result(total, entry.num_tokens)
            yield from backward_segments(fwd.segments, fwd.head_leaf.grad)
        yield from prompt_backward(recording, last, prefix, ctx)
        return tally.result(total, entry.num_tokens)

    def recompute_job(self, entry: GroupEntry, ctx: TrainContext):
        """The prompt and the samples in one forward (AttentionMetadata.shared_prefix: the
        prompt computed once, not once per sample), in packs of as many samples as
        `recompute_tokens` holds beside the prompt; each pack's backward at once (the
        layers whose graphs the device budget has no room for run again there)."""
        yield from self._reference(entry, ctx)
        prompt = entry.prompt_token_ids
        samples = self._samples(entry)
        rows = self._samples_per_pack(len(prompt), [response for _, response, _, _ in samples])
        total, tally = 0.0, _Tally.of(entry)
        for start in range(0, len(samples), rows):
            batch = samples[start:start + rows]
            longer = [sample for sample in batch if len(sample[1]) > 1]
            pack = [prompt, *(response[:-1] for _, response, _, _ in longer)]
            fwd = yield from forward_segments(ctx.runner, pack, shared_prefix=True,
                                              graph_layers=ctx.graph_layers(sum(map(len, pack))))
            losses = {index: self._token_loss(entry, index, response, advantage, weight, fwd.head_leaf.device, tally)
                      for index, response, advantage, weight in batch}
            with torch.enable_grad():  # the prompt's last row scores every sample's first token
                last = head_logits(ctx, fwd.head_leaf[0, len(prompt) - 1:len(prompt)])
                first = sum(losses[index](last, 0) for index, _, _, _ in batch)
                first.backward()
            total += first.item()
            for b, (index, response, _, _) in enumerate(longer):
                total += yield from head_token_loss(ctx.runner, fwd.head_leaf, fwd.offsets[b + 1], len(response) - 1,
                                                    lambda logits, a, loss=losses[index]: loss(logits, a + 1),
                                                    ctx.head_chunk_rows)
            yield from backward_segments(fwd.segments, fwd.head_leaf.grad, residency=fwd.rerun)
        return tally.result(total, entry.num_tokens)

    def _samples_per_pack(self, prompt_len: int, responses: list[list[int]]) -> int:
        """How many of `responses` fit beside the prompt in `recompute_tokens` (all, unbounded)."""
        if self.recompute_tokens is None or not responses:
            return max(len(responses), 1)
        return max(1, (self.recompute_tokens - prompt_len) // max(map(len, responses)))

    def baseline_job(self, entry: GroupEntry, ctx: TrainContext):
        """TRL's GRPOTrainer: each sample a row `prompt + response`, the prompt computed
        once per row, and so in its reference."""
        if self.beta and entry.reference_token_logps is None:
            entry.reference_token_logps = yield from self.separate_trainer_reference_token_logps(entry, ctx)
        prompt = entry.prompt_token_ids
        samples = self._samples(entry)
        rows = self._rows_per_forward(len(prompt), samples)
        total, tally = 0.0, _Tally.of(entry)
        for start in range(0, len(samples), rows):
            batch = samples[start:start + rows]
            fwd = yield from forward_segments(ctx.runner, [prompt + response[:-1] for _, response, _, _ in batch])
            for b, (index, response, advantage, weight) in enumerate(batch):
                loss = self._token_loss(entry, index, response, advantage, weight, fwd.head_leaf.device, tally)
                total += yield from head_token_loss(ctx.runner, fwd.head_leaf, fwd.offsets[b] + len(prompt) - 1,
                                                    len(response), loss, ctx.head_chunk_rows)
            yield from backward_segments(fwd.segments, fwd.head_leaf.grad)
        return tally.result(total, entry.num_tokens)
