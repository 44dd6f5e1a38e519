"""Training forwards and backwards, one decoder layer per slice.

`forward_segments` runs packed sequences through the model with autograd, making every
layer a segment (DESIGN.md); with `prefix` it runs one sequence's new tokens attending to
a prefix's K/V given per layer — detached leaves of a recorded prompt, whose gradients
(gK, gV) then accumulate there. `backward_segments` runs backward one segment at a time,
top to bottom, handing each layer's input gradient to the layer below.
With `graph_layers`, only the top layers keep their graphs through the forward; each
layer below keeps its input, and `backward_segments` runs it again from there
(`SegmentedForward.rerun`): a training forward held within a device budget.

Both are generators that yield after each layer (so that a caller can stop between
slices) and return their result through StopIteration, for `yield from`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.kv_cache import AttentionMetadata, CachedPrefixGrads, gather_rows, own_storage
from engine.layerwise import LayerwiseModel
from engine.recording import LayerSegment
from trainer.losses import weighted_nll


def within(context: Callable[[], contextlib.AbstractContextManager], generator):
    """Runs `generator` with `context` entered around each of its steps only — never
    across a yield, so that no grad mode or disabled adapter leaks into the serving steps
    that run between training slices. Returns the generator's return value."""
    while True:
        with context():
            try:
                next(generator)
            except StopIteration as stop:
                return stop.value
        yield


# per layer, a prefix's (key, value), (1, KVH, P, D) each: a list, or a dict by layer index
PrefixKV = list[tuple[torch.Tensor, torch.Tensor]] | dict[int, tuple[torch.Tensor, torch.Tensor]]


class SequenceKV:
    """`past_key_values` for a training forward: each sequence attends to its own new
    tokens, after the prefix K/V if one is given (the suffixes of one prefix: the prefix is
    expanded to every sequence, so that its gradients sum over them). With `keep`, each
    layer's new K/V are kept (a prompt's layer run again, whose K/V its suffixes' gradients
    reach); a training forward's own are not: nothing back-propagates into them but its
    own attention, and a kept copy of a fused projection's slice would cost a copy."""

    def __init__(self, metadata: AttentionMetadata, prefix: "PrefixKV | None" = None, keep: bool = False):
        assert prefix is None or not metadata.reads_packed_keys, "a shared-prefix pack holds its prefix itself"
        self.metadata = metadata
        self.prefix = prefix
        self.keep = keep
        # layer -> the new tokens' (key, value), (1, KVH, T, D), graph-connected (with `keep`)
        self.new: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def _per_sequence(self, packed: torch.Tensor) -> torch.Tensor:
        # (1, KVH, T, D) -> (B, KVH, Qmax, D)
        return gather_rows(packed[0].transpose(0, 1), self.metadata.single.query_index).transpose(1, 2)

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self.keep:
            self.new[layer_idx] = (own_storage(key), own_storage(value))
        if self.metadata.reads_packed_keys:  # a prompt and its suffixes in one pack: (T, KVH, D) rows
            return key[0].transpose(0, 1), value[0].transpose(0, 1)
        key, value = self._per_sequence(key), self._per_sequence(value)
        if self.prefix is not None:
            prefix_key, prefix_value = (t.expand(key.shape[0], -1, -1, -1) for t in self.prefix[layer_idx])
            key, value = torch.cat([prefix_key, key], dim=2), torch.cat([prefix_value, value], dim=2)
        pad = self.metadata.single.num_keys - key.shape[2]  # a bucketed key length: masked columns
        if pad:
            key, value = F.pad(key, (0, 0, 0, pad)), F.pad(value, (0, 0, 0, pad))
        return key, value


@dataclass
class Rerun:
    """The layers of a forward that kept only their input (a segment whose `out` is None),
    run again under grad for their backward, as they ran: the residency
    `backward_segments` takes (`before` gives each layer's segment, `after` has nothing
    to release)."""
    runner: LayerwiseModel
    segments: list[LayerSegment]
    metadata: AttentionMetadata
    position_ids: torch.Tensor
    tables: object
    prefix: "PrefixKV | None"
    keep_kv: bool

    def before(self, index: int) -> LayerSegment:
        segment = self.segments[index]
        if segment.out is not None:
            return segment
        past = SequenceKV(self.metadata, self.prefix, keep=self.keep_kv)
        leaf = segment.leaf.requires_grad_()
        with torch.enable_grad():
            out = self.runner.run_layer(index, leaf, self.position_ids, self.metadata, past, self.tables)
        return LayerSegment(leaf, out, *past.new.get(index, ()))

    def after(self, index: int) -> None:
        pass


@dataclass
class SegmentedForward:
    # per layer: its graph (input leaf, output, and its K/V with `keep_kv`), or below
    # `graph_layers` its input alone (`out` None), run again by `rerun`
    segments: list[LayerSegment]
    # (1, T, hidden) the last layer's output as a leaf (the head segment's input)
    head_leaf: torch.Tensor
    # packed row ranges of each sequence: rows offsets[b] .. offsets[b + 1] - 1
    offsets: list[int]
    # the residency that runs a layer kept as its input again (None: every graph kept)
    rerun: Rerun | None = None


def forward_segments(runner: LayerwiseModel, token_lists: list[list[int]], starts: list[int] | None = None,
                     prefix: list[tuple[torch.Tensor, torch.Tensor]] | None = None, with_grad: bool = True,
                     shared_prefix: bool = False, keep_kv: bool = False, graph_layers: int | None = None):
    """Generator: one slice per layer; returns a SegmentedForward (segments empty without
    grad). `shared_prefix`: token_lists[0] is a prompt that each of the others continues
    (they attend to it, then to themselves), all in one pack (`starts` is implied).
    `keep_kv`: each segment keeps its layer's K/V, graph-connected (a prompt run again,
    whose K/V other tokens' gradients reach). `graph_layers` (with grad; None: all): the
    top layers that keep their graph; each layer below keeps only its input (its graph,
    built as the kept layers' are so that the rerun computes exactly what it did, is
    dropped as soon as the layer has run), and is run again in backward
    (`SegmentedForward.rerun`)."""
    device = runner.device
    lengths = [len(t) for t in token_lists]
    assert starts is None or not shared_prefix, "a shared-prefix pack's positions follow from its lengths"
    if shared_prefix and len(lengths) > 1:
        starts = [0] + [lengths[0]] * (len(lengths) - 1)
        metadata = runner.shared_prefix_metadata(lengths[0], lengths[1:])
    else:
        starts = starts or [0] * len(token_lists)
        metadata = runner.attention_metadata(lengths, starts)
    ids = torch.tensor([t for tokens in token_lists for t in tokens], device=device)
    position_ids = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths)]).to(device).unsqueeze(0)
    past = SequenceKV(metadata, prefix)
    num_layers = len(runner.layers)
    first_graph = num_layers - (num_layers if graph_layers is None else graph_layers) if with_grad else num_layers
    with torch.no_grad():
        hidden = runner.embed(ids.unsqueeze(0))
        tables = runner.rotary(hidden, position_ids)
    segments: list[LayerSegment] = []
    for index in range(num_layers):
        graph = index >= first_graph
        past.keep = keep_kv and graph
        if with_grad:  # each layer's input a fresh leaf: one segment per layer
            hidden = hidden.detach().requires_grad_(graph)
        leaf = hidden
        with torch.set_grad_enabled(with_grad):
            hidden = runner.run_layer(index, leaf, position_ids, metadata, past, tables)
        if with_grad and graph:
            segments.append(LayerSegment(leaf, hidden, *past.new.pop(index, ())))
        elif with_grad:
            segments.append(LayerSegment(leaf, None))
            hidden = hidden.detach()  # its graph dropped now, not across the slice's end
        yield
    below = with_grad and first_graph > 0  # layers kept as their input, run again in backward
    rerun = Rerun(runner, segments, metadata, position_ids, tables, prefix, keep_kv) if below else None
    head_leaf = hidden.detach().requires_grad_(with_grad)
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return SegmentedForward(segments, head_leaf, offsets, rerun)


def head_score(runner: LayerwiseModel, leaf: torch.Tensor, start: int, targets: torch.Tensor, chunk_rows: int):
    """Generator, one slice per chunk of rows, no grad: returns the summed log p(targets)
    of rows start .. start + len(targets) − 1 of `leaf` (1, T, hidden), through the
    final norm and LM head."""
    total = torch.zeros((), device=leaf.device)
    for a in range(0, len(targets), chunk_rows):
        with torch.no_grad():  # per chunk: no grad mode held across a yield (serving runs between)
            rows = leaf[0, start + a:start + min(a + chunk_rows, len(targets))]
            chunk = targets[a:a + chunk_rows]
            total -= weighted_nll(runner.lm_head(runner.norm(rows)), chunk, torch.ones_like(chunk, dtype=torch.float))
        yield
    return total


@dataclass
class HeadGradient:
    """The gradient of a summed log-prob through the final norm and LM head, with respect to
    the head's input rows (the head itself is never adapted: trainer.adapter.attach_lora)."""
    rows: torch.Tensor

    def add_to(self, leaf: torch.Tensor, start: int, scale: torch.Tensor) -> None:
        """Accumulates `scale` times this gradient into `leaf` (1, T, hidden) at rows start ..
        (an autograd leaf: what `head_backward` would have left there)."""
        if leaf.grad is None:
            leaf.grad = torch.zeros_like(leaf)
        leaf.grad[0, start:start + len(self.rows)] += scale * self.rows


def head_logp_and_grad(runner: LayerwiseModel, leaf: torch.Tensor, start: int, targets: torch.Tensor,
                       chunk_rows: int):
    """Generator, one slice per chunk of rows: the summed log p(targets) of rows start ..
    start + len(targets) − 1 of `leaf` (1, T, hidden), and its HeadGradient — the head run
    once, forward and backward, a chunk at a time. A loss that weights this sum by one
    number w then back-propagates as `gradient.add_to(leaf, start, w)`, without running the
    head again."""
    total = torch.zeros((), device=leaf.device)
    grads = []
    for a in range(0, len(targets), chunk_rows):
        rows = leaf[0, start + a:start + min(a + chunk_rows, len(targets))].detach().requires_grad_()
        with torch.enable_grad():
            logp = -weighted_nll(runner.lm_head(runner.norm(rows)), targets[a:a + chunk_rows],
                                 torch.ones(len(rows), device=leaf.device))
            (grad,) = torch.autograd.grad(logp, rows)
        total += logp.detach()
        grads.append(grad)
        yield
    return total, HeadGradient(torch.cat(grads))


def head_backward(runner: LayerwiseModel, leaf: torch.Tensor, start: int, targets: torch.Tensor,
                  weights: torch.Tensor, chunk_rows: int):
    """Generator, one slice per chunk of rows: back-propagates sum(weights · −log p(targets))
    over rows start .. start + len(targets) − 1 of the head segment's input `leaf` (an
    autograd leaf, whose `.grad` accumulates), the head's forward and backward run a
    chunk at a time: the logits of a long prompt are never all alive, and no slice runs
    the whole (rows × vocabulary) head. Returns the loss's value."""
    def nll(logits: torch.Tensor, a: int) -> torch.Tensor:
        return weighted_nll(logits, targets[a:a + len(logits)], weights[a:a + len(logits)])

    return (yield from head_token_loss(runner, leaf, start, len(targets), nll, chunk_rows))


def head_token_loss(runner: LayerwiseModel, leaf: torch.Tensor, start: int, num_rows: int,
                    loss: Callable[[torch.Tensor, int], torch.Tensor], chunk_rows: int):
    """Generator, one slice per chunk of rows: back-propagates a loss that is a sum over
    rows start .. start + num_rows − 1 of `leaf` — `loss(logits, a)` for the chunk of
    rows whose first is row start + a, logits (rows, V) with grad — running the head a
    chunk at a time (see `head_backward`). Returns the loss's value."""
    total = 0.0
    for a in range(0, num_rows, chunk_rows):
        b = min(a + chunk_rows, num_rows)
        with torch.enable_grad():
            part = loss(runner.lm_head(runner.norm(leaf[0, start + a:start + b])), a)
            part.backward()
        total += part.item()
        yield
    return total


def kv_leaves(segments: list[LayerSegment]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Detached, grad-requiring copies of each layer's K/V: what suffixes attend to."""
    return [(s.key.detach().requires_grad_(), s.value.detach().requires_grad_()) for s in segments]


def recompute_segment(runner: LayerwiseModel, index: int, leaf_rows: torch.Tensor,
                      prefix: tuple[torch.Tensor, torch.Tensor, CachedPrefixGrads] | None = None) -> LayerSegment:
    """Decoder layer `index` run again under grad from its kept input, `leaf_rows`
    (1, T, hidden): the recorded prompt's rows, positions 0 .. T-1 — or, after a cached
    beginning, positions P .. P+T-1, attending first to that beginning's keys and values
    of this layer, `prefix` = (key, value, where their gradients accumulate: the
    recording's `prefix_grads[index]`). The fresh segment equals the recorded one on
    those rows (a recorded step's other rows are decodes of other sequences, which get no
    gradient), its K/V the whole prompt's as the recording's are."""
    num = leaf_rows.shape[1]
    start = 0 if prefix is None else prefix[0].shape[2]
    metadata = runner.attention_metadata([num], [start])
    if prefix is not None:  # leaves for this layer's backward alone, handing their gradients on
        key_rows, value_rows, grads = prefix
        prefix = key_rows.detach().requires_grad_(), value_rows.detach().requires_grad_()
        prefix[0].register_post_accumulate_grad_hook(lambda leaf: _hand_on(leaf, grads.add, "key"))
        prefix[1].register_post_accumulate_grad_hook(lambda leaf: _hand_on(leaf, grads.add, "value"))
    past = SequenceKV(metadata, None if prefix is None else {index: prefix}, keep=True)
    leaf = leaf_rows.detach().requires_grad_()
    position_ids = torch.arange(start, start + num, device=runner.device).unsqueeze(0)
    with torch.enable_grad():
        out = runner.run_layer(index, leaf, position_ids, metadata, past, runner.rotary(leaf, position_ids))
        key, value = past.new[index]
        if prefix is not None:
            key, value = torch.cat([prefix[0], key], dim=2), torch.cat([prefix[1], value], dim=2)
    return LayerSegment(leaf, out, key, value)


def _hand_on(leaf: torch.Tensor, add: Callable, name: str) -> None:
    """Moves a temporary leaf's gradient to where it accumulates (held once, not twice)."""
    grad, leaf.grad = leaf.grad, None
    add(**{name: grad})


def _fit_rows(grad: torch.Tensor, rows: int) -> torch.Tensor:
    """A recomputed segment holds the prompt rows only; the rows beyond them (decodes of
    other sequences in the recorded step) have zero gradient, so this is exact."""
    if grad.shape[1] > rows:
        return grad[:, :rows]
    return torch.nn.functional.pad(grad, (0, 0, 0, rows - grad.shape[1]))


def backward_layer(segments: list[LayerSegment], index: int, grad: torch.Tensor,
                   kv_grads: tuple[torch.Tensor | None, torch.Tensor | None] | None = None,
                   residency=None) -> torch.Tensor:
    """Backward through segment `index` alone, with `grad` on its output and `kv_grads`
    on its K and V (None: none); frees the segment (`residency`: brings it back first,
    releases it after) and returns the gradient on its input."""
    segment = segments[index] if residency is None else residency.before(index)
    assert segment.out is not None, "a layer kept as its input alone runs again by its forward's `rerun`"
    if grad.shape[1] != segment.out.shape[1]:
        grad = _fit_rows(grad, segment.out.shape[1])
    tensors, grads = [segment.out], [grad]
    for tensor, g in zip((segment.key, segment.value), kv_grads or (None, None)):
        if g is not None:
            tensors.append(tensor)
            grads.append(g)
    torch.autograd.backward(tensors, grads)
    grad = segment.leaf.grad
    segments[index] = segment = None  # free this layer's graph and activations now
    if residency is not None:
        residency.after(index)
    return grad


def backward_segments(segments: list[LayerSegment], top_grad: torch.Tensor,
                      kv_grads: list[tuple[torch.Tensor | None, torch.Tensor | None]] | None = None,
                      residency=None):
    """Generator: backward through `segments` top to bottom, one slice per layer.

    top_grad: gradient on the last segment's output. kv_grads: per layer, gradients on
    its K and V from suffixes that attended to them (None where there are none). Each
    segment's graph is freed as soon as it has been back-propagated. `residency` gives
    each layer's segment before its backward and releases it after: a recording's
    (offload.offloader.Residency) brings its freed layers back, reloaded or recomputed;
    a training forward's (`SegmentedForward.rerun`) runs its layers kept as their input
    again."""
    grad = top_grad
    for index in reversed(range(len(segments))):
        grad = backward_layer(segments, index, grad, None if kv_grads is None else kv_grads[index], residency)
        yield


def backward_sweep(prompt: list[LayerSegment], prompt_grad: torch.Tensor, suffix: list[LayerSegment],
                   suffix_grad: torch.Tensor, prefix: list[tuple[torch.Tensor, torch.Tensor]], residency=None):
    """Generator: the suffixes' backward and the prompt's in one top-down sweep, one slice
    each per layer: at each layer the suffixes' (a batch that attended to the prompt's K/V
    leaves `prefix`, whose gK/gV it leaves there), then the prompt's with that layer's
    gK/gV. Each layer of both is freed as the sweep passes it, where two sweeps (the
    suffixes', then `backward_segments` over the prompt) hold the whole prompt until the
    suffixes are done; the peak is the same either way (it comes before any backward),
    and so are the gradients."""
    for index in reversed(range(len(prompt))):
        suffix_grad = backward_layer(suffix, index, suffix_grad)
        yield
        key, value = prefix[index]
        prompt_grad = backward_layer(prompt, index, prompt_grad, (key.grad, value.grad), residency)
        key.grad = value.grad = None  # this layer's gK/gV, spent
        yield
