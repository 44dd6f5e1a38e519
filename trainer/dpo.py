"""DPO over a shared prompt (`--train-mode dpo`): a preference between two responses.

A served answer is recorded; a label (POST /v1/feedback) names the chosen and the
rejected response — the served one and one the client gives, or two served choices. The
loss is DPO's sigmoid loss (trainer/losses.py) against a reference (`train.dpo_reference`:
the base model, or the served adapter version). Two jobs, as for every method
(trainer/methods.py), and the separate trainer that benchmarks compare them against:
  - `reuse_job`, the shared-prefix schedule (papers/shared-prefix-reuse.txt) on the
    served recording: both responses forwarded as one batch against the prompt's K/V as
    detached leaves, their gK/gV accumulating there, and the prompt's backward run once;
  - `recompute_job`, for an entry without a usable recording: the prompt and both
    responses in one forward (AttentionMetadata.shared_prefix), the prompt computed once;
  - `baseline_job`, the separate trainer (benchmarks): `[prompt+chosen; prompt+rejected]`
    in one batch, as TRL does, so the prompt is computed twice.
The base reference is computed once per entry. The server's two jobs compute it as the
prompt and both responses in one forward without grad (AttentionMetadata.shared_prefix);
the separate trainer as TRL's DPOTrainer does (`compute_ref_log_probs`: its batch of two
rows again, the adapter disabled), the prompt twice there too.
"""

from __future__ import annotations

import torch

from engine.recording import RecordedPrefill
from trainer.config import DPO_REFERENCES
from trainer.entries import PreferenceEntry
from trainer.forward import (HeadGradient, SegmentedForward, backward_segments, forward_segments, head_backward,
                             head_logp_and_grad, head_score, kv_leaves, within)
from trainer.losses import dpo_loss, token_logprobs
from trainer.methods import (JobResult, TrainContext, TrainingMethod, base_model_no_grad, head_logits,
                             prompt_backward, suffixes_and_prompt_backward)


class DPOMethod(TrainingMethod):
    """Direct preference optimization over a shared prompt (sigmoid loss)."""

    name = "dpo"
    all_logit_rows = False  # only the last prompt row: it scores each response's first token
    reads_cached_prefix = True
    uses_feedback = True

    def __init__(self, beta: float = 0.1, reference: str = "base"):
        """`reference`: "base", the model without the adapter (DPO as published; one
        extra forward of prompt and both responses per entry, cached on the entry), or
        "served", the adapter version the gradient is computed under — the one that
        served the prompt on the reuse paths (TR-DPO with the reference synced every
        step): its log-probs are the policy's own values, so no reference forward runs,
        and the loss is anchored to the served policy instead of the base model."""
        if reference not in DPO_REFERENCES:
            raise ValueError(f"DPO reference must be one of {DPO_REFERENCES}, got {reference!r}")
        self.beta = beta
        self.reference = reference

    def make_entry(self, completion_id: str, recording: RecordedPrefill) -> PreferenceEntry:
        return PreferenceEntry(completion_id, list(recording.prompt_token_ids), recording,
                               recording.adapter_version, recording.saved_bytes)

    def make_label_entry(self, completion_id: str, prompt_token_ids: list[int],
                         adapter_version: int) -> PreferenceEntry:
        return PreferenceEntry(completion_id, list(prompt_token_ids), None, adapter_version, 0)

    def _response_logp(self, ctx: TrainContext, prompt_len: int, response: list[int], last_logits: torch.Tensor,
                       prefix, with_grad: bool, score: bool = True):
        """Generator -> (summed log p(response | prompt) as a value, the response's
        SegmentedForward or None, its HeadGradient or None). last_logits (1, V): the
        prompt's last row, which scores the first response token. with_grad: the forward
        keeps its graph (for `_response_backward`), and when scoring, the head runs
        forward and backward at once; score: compute the value (else None)."""
        value = gradient = None
        if score:
            with torch.no_grad():
                value = token_logprobs(last_logits, ctx.ids(response[:1])).sum()
        fwd = None
        if len(response) > 1:
            fwd = yield from forward_segments(ctx.runner, [response[:-1]], [prompt_len], prefix, with_grad)
            targets = ctx.ids(response[1:])
            if score and with_grad:
                rest, gradient = yield from head_logp_and_grad(ctx.runner, fwd.head_leaf, 0, targets,
                                                               ctx.head_chunk_rows)
                value = value + rest
            elif score:
                value = value + (yield from head_score(ctx.runner, fwd.head_leaf, 0, targets, ctx.head_chunk_rows))
        return value, fwd, gradient

    def _response_backward(self, ctx: TrainContext, response: list[int], last: torch.Tensor, fwd, weight,
                           gradient: HeadGradient | None = None):
        """Generator: back-propagates `weight` * log p(response | prompt) through the
        response's head (in row chunks; or, given the head's `gradient` from scoring, by
        scaling it) and layers; the first token's share goes to `last` (the prompt's last
        logits row, a leaf), the K/V share to the prefix leaves."""
        with torch.enable_grad():
            (token_logprobs(last, ctx.ids(response[:1])).sum() * weight).backward()
        if fwd is None:
            return
        if gradient is not None:
            gradient.add_to(fwd.head_leaf, 0, weight)
        else:
            targets = ctx.ids(response[1:])
            yield from head_backward(ctx.runner, fwd.head_leaf, 0, targets, -weight.expand(len(targets)),
                                     ctx.head_chunk_rows)
        yield from backward_segments(fwd.segments, fwd.head_leaf.grad)

    def response_logps(self, ctx: TrainContext, prompt_len: int, responses: dict[str, list[int]],
                       last_logits: torch.Tensor, prefix, with_grad: bool):
        """Generator -> (summed log p(response | prompt) of each response, as values; the
        responses' batched SegmentedForward, or None when every response is one token;
        with grad, each batched response's (first head row, the HeadGradient of its summed
        log-prob)). The first token of each is scored by
        `last_logits` (1, V), the prompt's last row; the rest run as one batch against the
        prompt's K/V `prefix` (expanded to every row: with grad, their gradients sum
        there); with_grad: the forward keeps its graph, and the head runs forward and
        backward once, so that the loss's gradient only scales what it left."""
        longer = [r[:-1] for r in responses.values() if len(r) > 1]
        fwd = None
        if longer:
            fwd = yield from forward_segments(ctx.runner, longer, [prompt_len] * len(longer), prefix, with_grad)
        values, rows = yield from self._score(ctx, responses, last_logits, fwd, 0, with_grad)
        return values, fwd, rows

    def _score(self, ctx: TrainContext, responses: dict[str, list[int]], last_logits: torch.Tensor,
               fwd: SegmentedForward | None, first_sequence: int, with_grad: bool):
        """Generator -> (each response's summed log-prob, as a value; with grad, each
        batched response's (first head row, HeadGradient)): its first token scored by
        `last_logits`, the rest by `fwd`'s rows, where the responses longer than one token
        are the sequences from `first_sequence` on, in order."""
        with torch.no_grad():
            values = {name: token_logprobs(last_logits, ctx.ids(r[:1])).sum() for name, r in responses.items()}
        rows = {}
        longer = [(name, r) for name, r in responses.items() if len(r) > 1]
        for b, (name, response) in enumerate(longer):
            start, targets = fwd.offsets[first_sequence + b], ctx.ids(response[1:])
            if with_grad:
                value, grad = yield from head_logp_and_grad(ctx.runner, fwd.head_leaf, start, targets,
                                                            ctx.head_chunk_rows)
                rows[name] = (start, grad)
            else:
                value = yield from head_score(ctx.runner, fwd.head_leaf, start, targets, ctx.head_chunk_rows)
            values[name] = values[name] + value
        return values, rows

    def reference_logps(self, entry: PreferenceEntry, ctx: TrainContext):
        """Generator -> (chosen, rejected) summed log-probs under the base model, no grad:
        the prompt and both responses in one forward, the responses attending to the
        prompt's keys (AttentionMetadata.shared_prefix)."""
        def compute():
            prompt = entry.prompt_token_ids
            responses = {"chosen": entry.label.chosen, "rejected": entry.label.rejected}
            sequences = [prompt, *(r[:-1] for r in responses.values() if len(r) > 1)]
            fwd = yield from forward_segments(ctx.runner, sequences, with_grad=False, shared_prefix=True)
            last = head_logits(ctx, fwd.head_leaf[0, len(prompt) - 1:len(prompt)])
            values, _ = yield from self._score(ctx, responses, last, fwd, 1, with_grad=False)
            return tuple(torch.stack([values["chosen"], values["rejected"]]).tolist())

        return (yield from within(lambda: base_model_no_grad(ctx), compute()))

    def _base_reference(self, entry: PreferenceEntry, ctx: TrainContext):
        """Generator: computes the base model's (chosen, rejected) log-probs once per entry."""
        if self.reference == "base" and entry.reference_logps is None:
            entry.reference_logps = yield from self.reference_logps(entry, ctx)

    def separate_trainer_reference_logps(self, entry: PreferenceEntry, ctx: TrainContext):
        """Generator -> `reference_logps` as TRL's DPOTrainer computes them (its
        `concatenated_forward` with the adapter disabled, no grad): `[prompt+chosen;
        prompt+rejected]` in one batch, the prompt computed twice (`baseline_job`'s)."""
        prompt, label = entry.prompt_token_ids, entry.label

        def compute():
            fwd = yield from forward_segments(ctx.runner, [prompt + label.chosen, prompt + label.rejected],
                                              with_grad=False)
            values = []
            for b, response in enumerate((label.chosen, label.rejected)):
                values.append((yield from head_score(ctx.runner, fwd.head_leaf, fwd.offsets[b] + len(prompt) - 1,
                                                     ctx.ids(response), ctx.head_chunk_rows)))
            return tuple(torch.stack(values).tolist())

        return (yield from within(lambda: base_model_no_grad(ctx), compute()))

    def loss(self, policy_chosen, policy_rejected, entry: PreferenceEntry):
        if self.reference == "served":  # the reference is the policy itself, as a constant
            reference = (policy_chosen.detach().item(), policy_rejected.detach().item())
        else:
            reference = entry.reference_logps
        reference_chosen, reference_rejected = (torch.tensor(v) for v in reference)
        loss, metrics = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, self.beta)
        if self.reference == "served":  # implicit rewards against itself: 0 by construction, no figure
            metrics = {"loss": metrics["loss"]}
        return loss, metrics

    def reuse_job(self, entry: PreferenceEntry, ctx: TrainContext):
        """Shared-prefix schedule: the responses read the prompt's K/V as detached leaves
        and accumulate gK/gV there; the prompt's backward runs once. Both responses
        forward as one batch, whose log-probs give the loss; its gradient with respect to
        each response weights that response's head rows, and one backward runs through
        both, then the prompt's, or both layer by layer in one sweep
        (`suffixes_and_prompt_backward`, `train.one_backward_sweep`). Peak: the
        prompt's recording plus both responses' graphs — when the offloader's budget has
        no room for that, `_reuse_one_response_at_a_time`."""
        recording, label = entry.recording, entry.label
        longest = max(len(label.chosen), len(label.rejected))
        if not ctx.graph_fits(2 * longest):
            return (yield from self._reuse_one_response_at_a_time(entry, ctx))
        yield from self._base_reference(entry, ctx)
        prefix = kv_leaves(recording.segments)
        last = recording.logits[-1:].detach().requires_grad_()
        responses = {"chosen": label.chosen, "rejected": label.rejected}
        values, fwd, rows = yield from self.response_logps(ctx, len(entry.prompt_token_ids), responses, last, prefix,
                                                           with_grad=True)
        metrics = yield from self._loss_onto_heads(ctx, entry, responses, values, last, fwd, rows)
        if fwd is None:
            yield from prompt_backward(recording, last, prefix, ctx)
        else:
            yield from suffixes_and_prompt_backward(recording, last, fwd, prefix, ctx)
        return JobResult(metrics["loss"], entry.num_tokens, metrics)

    def _loss_onto_heads(self, ctx: TrainContext, entry: PreferenceEntry, responses: dict[str, list[int]],
                         values: dict, last: torch.Tensor, fwd: SegmentedForward | None, rows: dict):
        """Generator -> the loss's metrics, from the responses' log-prob `values`; its
        gradient left where the backward starts: through `last` (the prompt's last logits
        row, which scored each response's first token), and on `fwd`'s head rows (`rows`,
        from `_score`)."""
        metrics, weights = yield from self._loss_weights(values, entry)
        with torch.enable_grad():
            sum(token_logprobs(last, ctx.ids(r[:1])).sum() * weights[name] for name, r in responses.items()).backward()
        for name, (start, gradient) in rows.items():
            gradient.add_to(fwd.head_leaf, start, weights[name])
        return metrics

    def _reuse_one_response_at_a_time(self, entry: PreferenceEntry, ctx: TrainContext):
        """`reuse_job` holding as little as possible: only one response graph is alive at a time: the
        loss needs the responses' log-probs only as values, and its gradient with respect
        to each then weights that response's backward. The served response's value comes
        from decoding, where the job runs under the weights that decoded it; otherwise (or
        a stale entry under the live weights) the shorter response is scored once without
        grad. Then each response is forwarded and back-propagated in turn, its head in row
        chunks (the first's run once, as it is scored). Peak: the prompt's recording plus
        one response's graph."""
        yield from self._base_reference(entry, ctx)
        recording, label = entry.recording, entry.label
        prompt_len = len(entry.prompt_token_ids)
        prefix = kv_leaves(recording.segments)
        last = recording.logits[-1:].detach().requires_grad_()
        responses = {"chosen": label.chosen, "rejected": label.rejected}
        values = {}
        if label.served_logps and ctx.under_served_weights:
            second = next(iter(label.served_logps))
            values[second] = torch.tensor(label.served_logps[second], device=ctx.runner.device)
        else:
            second = min(responses, key=lambda k: len(responses[k]))
            detached_prefix = [(k.detach(), v.detach()) for k, v in prefix]
            values[second], _, _ = yield from self._response_logp(ctx, prompt_len, responses[second],
                                                                  last.detach(), detached_prefix, with_grad=False)
        first = "rejected" if second == "chosen" else "chosen"
        values[first], first_fwd, first_head = yield from self._response_logp(ctx, prompt_len, responses[first],
                                                                              last, prefix, True)
        metrics, weights = yield from self._loss_weights(values, entry)
        yield from self._response_backward(ctx, responses[first], last, first_fwd, weights[first], first_head)
        _, second_fwd, _ = yield from self._response_logp(ctx, prompt_len, responses[second], last, prefix, True,
                                                          score=False)
        yield from self._response_backward(ctx, responses[second], last, second_fwd, weights[second])
        yield from prompt_backward(recording, last, prefix, ctx)
        return JobResult(metrics["loss"], entry.num_tokens, metrics)

    def _loss_weights(self, values: dict, entry: PreferenceEntry):
        """Generator (one slice): the loss from the responses' log-prob values, and its
        gradient with respect to each, which weights that response's backward."""
        leaves = {k: v.detach().clone().float().requires_grad_() for k, v in values.items()}
        with torch.enable_grad():
            loss, metrics = self.loss(leaves["chosen"], leaves["rejected"], entry)
            loss.backward()
        yield
        return metrics, {k: leaf.grad for k, leaf in leaves.items()}

    def recompute_job(self, entry: PreferenceEntry, ctx: TrainContext):
        """The prompt and both responses in one forward (AttentionMetadata.shared_prefix:
        the prompt computed once, as the reuse job's recording computed it), the loss from
        that forward, one backward through all of it (the layers whose graphs the device
        budget has no room for run again there: `TrainContext.graph_layers`)."""
        yield from self._base_reference(entry, ctx)
        prompt = entry.prompt_token_ids
        responses = {"chosen": entry.label.chosen, "rejected": entry.label.rejected}
        pack = [prompt, *(r[:-1] for r in responses.values() if len(r) > 1)]
        fwd = yield from forward_segments(ctx.runner, pack, shared_prefix=True,
                                          graph_layers=ctx.graph_layers(sum(map(len, pack))))
        with torch.enable_grad():  # the prompt's last row scores each response's first token
            last = head_logits(ctx, fwd.head_leaf[0, len(prompt) - 1:len(prompt)])
        values, rows = yield from self._score(ctx, responses, last.detach(), fwd, 1, with_grad=True)
        metrics = yield from self._loss_onto_heads(ctx, entry, responses, values, last, fwd, rows)
        yield from backward_segments(fwd.segments, fwd.head_leaf.grad, residency=fwd.rerun)
        return JobResult(metrics["loss"], entry.num_tokens, metrics)

    def baseline_job(self, entry: PreferenceEntry, ctx: TrainContext):
        """TRL's DPO: `[prompt+chosen; prompt+rejected]` in one batch, the prompt computed
        twice, and so in its reference."""
        if self.reference == "base" and entry.reference_logps is None:
            entry.reference_logps = yield from self.separate_trainer_reference_logps(entry, ctx)
        prompt, label = entry.prompt_token_ids, entry.label
        fwd = yield from forward_segments(ctx.runner, [prompt + label.chosen, prompt + label.rejected])
        spans = {}  # response -> (its first scoring row, its token ids)
        for b, (name, response) in enumerate((("chosen", label.chosen), ("rejected", label.rejected))):
            spans[name] = (fwd.offsets[b] + len(prompt) - 1, ctx.ids(response))
        values, grads = {}, {}  # the head runs once per row, forward and backward, as TRL's logits do
        for name, (first, targets) in spans.items():
            values[name], grads[name] = yield from head_logp_and_grad(ctx.runner, fwd.head_leaf, first, targets,
                                                                      ctx.head_chunk_rows)
        metrics, weights = yield from self._loss_weights(values, entry)
        for name, (first, _) in spans.items():
            grads[name].add_to(fwd.head_leaf, first, weights[name])
        yield from backward_segments(fwd.segments, fwd.head_leaf.grad)
        return JobResult(metrics["loss"], entry.num_tokens, metrics)
