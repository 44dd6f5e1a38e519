"""Training methods: how a mode turns a cache entry into LoRA gradients, two ways.

Each method has one loss (trainer/losses.py) fed by two jobs:
  - `reuse_job`: from the recorded prefill — backward only for the prompt (CPT), or the
    responses forwarded against the prompt's recorded K/V and the prompt's backward run
    once (DPO, trainer/dpo.py; GRPO, trainer/grpo.py);
  - `recompute_job`: from the entry's tokens, a full forward then backward — the
    server's job for an entry without a usable recording. `baseline_job` is the
    separate trainer the paper compares against (benchmarks), where it differs.
Jobs are generators: each `yield` ends one slice (one layer's forward or backward, the
loss); they accumulate gradients into the LoRA parameters and return a `JobResult`. The
optimizer step is the trainer's. Subclass `TrainingMethod` (with its own `CacheEntry`)
to add a method — the paper's `train_on_cache`; see examples/custom_method.py.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from engine.layerwise import LayerwiseModel
from engine.recording import RecordedPrefill, RecordSpec
from trainer.adapter import adapters_disabled
from trainer.entries import CacheEntry
from trainer.forward import SegmentedForward, backward_segments, backward_sweep, forward_segments, head_backward
from trainer.losses import cpt_weights


@dataclass
class TrainContext:
    # the served model, layer by layer (the engine's runner)
    runner: LayerwiseModel
    # the PeftModel (for disable_adapter when computing reference log-probs)
    peft_model: object
    # the activation offloader, when a device budget is set (offload/)
    offloader: object | None = None
    # rows of the LM head run per training slice (its forward and backward)
    head_chunk_rows: int = 64
    # a batch of suffixes and their prompt back-propagate in one top-down sweep
    # (trainer.forward.backward_sweep); false, or with an offloader: the suffixes', then the prompt's
    one_backward_sweep: bool = True
    # the job in progress runs under the weights that served its entry (fresh, or a stale
    # one's stashed weights); false: a stale entry under the live weights
    # (`train.stale_weights = "live"`), where a value decoding computed is not this job's
    under_served_weights: bool = True

    def residency(self, recording: RecordedPrefill):
        """What brings the recording's freed layers back for backward (None: all resident)."""
        return None if self.offloader is None else self.offloader.residency(recording)

    def ids(self, tokens: list[int]) -> torch.Tensor:
        """Token ids as a tensor on the model's device."""
        return torch.tensor(tokens, device=self.runner.device)

    def graph_layers(self, num_tokens: int) -> int:
        """How many of a training forward's top layers keep their graph, at `num_tokens`
        rows: as many as fit the offloader's device budget at once beside what it holds,
        each other layer holding its input, run again in backward (counted in the
        offloader's stats); no budget: every layer."""
        num_layers = len(self.runner.layers)
        if self.offloader is None:
            return num_layers
        kept = min(num_layers, self.offloader.graph_layers_fit(num_tokens))
        self.offloader.stats.rerun_training_layers += num_layers - kept
        return kept

    def graph_fits(self, num_tokens: int) -> bool:
        """Whether a training forward of `num_tokens` rows, every layer's graph alive at
        once, fits the offloader's device budget beside what it holds (no budget: it fits)."""
        return self.offloader is None or self.offloader.graph_fits(num_tokens)


@dataclass
class JobResult:
    loss: float
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)


def base_model_no_grad(ctx: TrainContext) -> contextlib.ExitStack:
    """The base model (adapter disabled), without autograd: for reference log-probs."""
    stack = contextlib.ExitStack()
    stack.enter_context(torch.no_grad())
    stack.enter_context(adapters_disabled(ctx.peft_model))
    return stack


def head_logits(ctx: TrainContext, hidden: torch.Tensor) -> torch.Tensor:
    """(N, hidden) last-layer outputs -> (N, V) logits."""
    return ctx.runner.lm_head(ctx.runner.norm(hidden))


def prompt_head_backward(recording: RecordedPrefill, last: torch.Tensor) -> None:
    """The recorded prompt's head segment, with what its suffixes left on its last logits
    row `last`: the gradient on its last layer's output (`recording.head_leaf.grad`)."""
    with torch.enable_grad():
        recording.logits[-1:].backward(last.grad)


def cached_prefix_backward(recording: RecordedPrefill, ctx: TrainContext, targets: torch.Tensor | None = None,
                           weights: torch.Tensor | None = None, graph_layers: int | None = None):
    """Generator: the backward of the prompt's beginning the recording read from the prefix
    cache (`recording.prefix_len` tokens; none: nothing to do), once the recorded tokens'
    backward has left its gradients on that beginning's K/V (`prefix_grads`): the
    beginning is recomputed under grad — under the weights the job runs with: the
    recording's own (stashed when stale), or today's under `stale_weights = "live"` — its
    layers keeping their K/V, and back-propagated with those gradients; with `targets` and
    `weights`, also a weighted next-token loss on its rows (CPT's, whose tokens these are).
    Returns that loss's value (0.0 without one). Its top `graph_layers` layers keep their
    graph through the forward (None: as many as the device budget has room for,
    `ctx.graph_layers`), each layer below its input only, run again in the backward."""
    num = recording.prefix_len
    if not num:
        return 0.0
    if graph_layers is None:
        graph_layers = ctx.graph_layers(num)
    fwd = yield from forward_segments(ctx.runner, [recording.prompt_token_ids[:num]], keep_kv=True,
                                      graph_layers=graph_layers)
    loss = 0.0
    if targets is not None:
        loss = yield from head_backward(ctx.runner, fwd.head_leaf, 0, targets, weights, ctx.head_chunk_rows)
    top = fwd.head_leaf.grad if fwd.head_leaf.grad is not None else torch.zeros_like(fwd.head_leaf)
    yield from backward_segments(fwd.segments, top, [(g.key, g.value) for g in recording.prefix_grads], fwd.rerun)
    return loss


def prompt_backward(recording: RecordedPrefill, last: torch.Tensor, prefix, ctx: TrainContext):
    """Generator: a recorded prompt's backward, once, with what its suffixes left on its
    last logits row `last` and on its K/V leaves `prefix`; then its cached beginning's."""
    prompt_head_backward(recording, last)
    yield
    yield from backward_segments(recording.segments, recording.head_leaf.grad,
                                 [(k.grad, v.grad) for k, v in prefix], ctx.residency(recording))
    yield from cached_prefix_backward(recording, ctx)


def suffixes_and_prompt_backward(recording: RecordedPrefill, last: torch.Tensor, suffixes: SegmentedForward,
                                 prefix, ctx: TrainContext):
    """Generator: the backward of a batch of suffixes forwarded against the prompt's K/V
    leaves `prefix` (their head rows done: `suffixes.head_leaf.grad`; their first tokens'
    share on `last`), and then of the prompt — in one top-down sweep
    (`ctx.one_backward_sweep`) or two. With an offloader (a device budget) always two:
    its reloads of the prompt's layers are budgeted beside serving, not beside the
    suffixes' graphs, which one sweep would still hold below the layer being reloaded."""
    if not ctx.one_backward_sweep or ctx.offloader is not None:
        yield from backward_segments(suffixes.segments, suffixes.head_leaf.grad)
        yield from prompt_backward(recording, last, prefix, ctx)
        return
    prompt_head_backward(recording, last)
    yield
    yield from backward_sweep(recording.segments, recording.head_leaf.grad, suffixes.segments,
                              suffixes.head_leaf.grad, prefix, ctx.residency(recording))
    yield from cached_prefix_backward(recording, ctx)


class TrainingMethod:
    name = "base"
    # which prefill logits the recording keeps (RecordSpec.all_logit_rows)
    all_logit_rows = True
    # a recording may begin after the prompt's cached beginning (RecordSpec.reads_cached_prefix):
    # the reuse job then trains that beginning by recomputing it (`cached_prefix_backward`);
    # off for a method that reads the recording's every row
    reads_cached_prefix = False
    # entries wait for POST /v1/feedback, and which label they take there ("preference" or
    # "rewards", trainer/feedback.py)
    uses_feedback = False
    label_kind = "preference"
    # served and trained log-probs are the sampling distribution's (the logits over the
    # request's temperature, GRPO's as TRL's), not the model's own
    logprobs_at_sampling_temperature = False

    def trains_on(self, num_choices: int) -> bool:
        """Whether a request with `num_choices` choices gets an entry (GRPO: groups only)."""
        return True

    def record_spec(self, adapter_version: int) -> RecordSpec:
        """How a prefill is recorded for this method, under `adapter_version`."""
        return RecordSpec(all_logit_rows=self.all_logit_rows, adapter_version=adapter_version,
                          reads_cached_prefix=self.reads_cached_prefix and not self.all_logit_rows)

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
        """The server's job for an entry without a usable recording: from its tokens."""
        raise NotImplementedError

    def baseline_job(self, entry: CacheEntry, ctx: TrainContext):
        """The separate trainer the paper compares against, as benchmarks run it: the same
        gradients as the two jobs above. `recompute_job` unless the method recomputes more
        cheaply than a separate trainer would (DPO and GRPO pack the prompt once, its
        responses after it, where TRL's trainers compute it once per response)."""
        return self.recompute_job(entry, ctx)


class CPTMethod(TrainingMethod):
    """Continual pre-training on the prompt: mean next-token cross-entropy.

    The loss is a weighted sum of per-token cross-entropies (`token_weights`: uniform for
    CPT; a subclass may weight or mask tokens), so the head segment runs in row chunks of
    `head_chunk_rows`, one slice each; the recording keeps only the last row's logits."""

    name = "cpt"
    all_logit_rows = False
    reads_cached_prefix = True

    def token_weights(self, entry: CacheEntry, ctx: TrainContext) -> torch.Tensor:
        """(T - 1,) the weight of each next-token target of the T-token prompt."""
        return cpt_weights(len(entry.prompt_token_ids), ctx.runner.device)

    def _train_head(self, entry: CacheEntry, ctx: TrainContext, head_leaf: torch.Tensor, first: int = 0):
        """Generator: the head segment's chunks over the prompt's rows from `first` on (its
        rows, `head_leaf`'s); returns the JobResult."""
        weights = self.token_weights(entry, ctx)
        loss = yield from head_backward(ctx.runner, head_leaf, 0, ctx.ids(entry.prompt_token_ids[first + 1:]),
                                        weights[first:], ctx.head_chunk_rows)
        return JobResult(loss, int((weights != 0).sum().item()), {"loss": loss})

    def reuse_job(self, entry: CacheEntry, ctx: TrainContext):
        recording = entry.recording
        cached = recording.prefix_len  # the rows before the recorded ones: recomputed last
        result = yield from self._train_head(entry, ctx, recording.head_leaf, cached)
        if recording.head_leaf.grad is not None:  # (a one-token prompt scores no token: no gradient)
            yield from backward_segments(recording.segments, recording.head_leaf.grad,
                                         residency=ctx.residency(recording))
        if cached:
            weights = self.token_weights(entry, ctx)[:cached]
            loss = yield from cached_prefix_backward(recording, ctx, ctx.ids(entry.prompt_token_ids[1:cached + 1]),
                                                     weights)
            result.loss += loss
            result.metrics["loss"] = result.loss
        return result

    def recompute_job(self, entry: CacheEntry, ctx: TrainContext):
        tokens = entry.prompt_token_ids
        fwd = yield from forward_segments(ctx.runner, [tokens], graph_layers=ctx.graph_layers(len(tokens)))
        result = yield from self._train_head(entry, ctx, fwd.head_leaf)
        if fwd.head_leaf.grad is not None:
            yield from backward_segments(fwd.segments, fwd.head_leaf.grad, residency=fwd.rerun)
        return result
