"""What a recorded prefill keeps, and how many bytes autograd really holds for it.

A recorded prefill runs one sequence's whole prompt with autograd enabled for the LoRA
path — or the prompt after a beginning the prefix cache holds, whose K/V it then reads
from the pool (`RecordedPrefill.prefix_len`, `prefix_grads`). Each decoder layer's input
is made a fresh leaf, so every layer is a separate segment `(leaf, out, key, value)`
(DESIGN.md, "Layer-segmented execution"): backward can run one segment at a time, and
the K/V of the prompt can receive gradients from suffixes that attended to them.

`SavedTensorTracker` measures activation memory instead of estimating it: it counts the
bytes of every tensor autograd saves (each storage once) from the moment it is saved
until autograd lets go of it, and keeps the peak. Saved-tensor hooks take autograd's own
version check out of the loop, so the tracker repeats it: unpacking a tensor that was
modified in place since it was saved raises, as autograd would (DESIGN.md invariant).

Each saved tensor belongs to the layer segment being recorded when autograd saved it
(`SavedTensorTracker.segment`); the offloader (offload/) moves a segment's saved tensors
off the device and back through these handles, which is why a handle may be empty
(`tensor is None`) and then asks `fetch` to bring its tensor back.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch


@dataclass
class LayerSegment:
    # (1, T, hidden) the layer's input, an autograd leaf
    leaf: torch.Tensor
    # (1, T, hidden) the layer's output, with its graph back to `leaf` and the LoRA weights;
    # None in a training forward's layer kept as its input alone, run again for its
    # backward (trainer.forward.Rerun)
    out: torch.Tensor | None
    # (1, KVH, T, D) the layer's keys (after RoPE) and values, part of the same graph: a
    # prompt's, which its suffixes' gradients reach (None: a training forward's own); a
    # recording after a cached prefix: the whole prompt's, P + T rows
    # (RecordedPrefill.prefix_len)
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


@dataclass
class RecordedPrefill:
    prompt_token_ids: list[int]
    # the adapter version the graph was recorded under
    adapter_version: int
    segments: list[LayerSegment]
    # (1, T, hidden) the last layer's output, as a leaf: the input of the head segment
    head_leaf: torch.Tensor
    # (R, V) logits with their graph back to head_leaf: every prompt row, or only the last
    logits: torch.Tensor
    all_logit_rows: bool
    # the recorded step's rows: the prompt's, then any riding decodes' (its layers' inputs hold them)
    rows: int
    # bytes autograd saved for this recording (measured)
    saved_bytes: int = 0
    # the bytes of each storage it saved (HeapWarmer.fit)
    saved_sizes: list[int] = field(default_factory=list)
    # where the segments' saved tensors live (offload/), when an offloader manages them
    placement: object | None = None
    # prompt tokens read from the prefix cache, not recorded (RecordSpec.reads_cached_prefix):
    # the segments, head leaf and logits are of the tokens after them, and each segment's
    # key and value of the whole prompt, whose first `prefix_len` rows are these tokens'
    prefix_len: int = 0
    # per layer, where the gradients on the cached tokens' key and value rows accumulate
    # (engine.kv_cache.CachedPrefixGrads); training recomputes the cached tokens' layers and
    # back-propagates those gradients (trainer.methods.cached_prefix_backward)
    prefix_grads: list = field(default_factory=list)
    # of `saved_bytes`, the cached tokens' rows within the whole prompt's K/V, every layer's
    prefix_bytes: int = 0

    @property
    def recorded_bytes(self) -> int:
        """`saved_bytes` less what the cached beginning adds, its rows in the whole prompt's
        K/V — what recording its tokens cost."""
        return self.saved_bytes - self.prefix_bytes

    def release(self) -> None:
        """Drop the graph (after training on it, or when the entry is evicted); on the
        device thread only (freeing a graph and the offloader's copies is tensor work)."""
        assert_off_event_loop("releasing a recorded prefill")
        self.segments, self.prefix_grads = [], []
        self.head_leaf = self.logits = None
        if self.placement is not None:
            self.placement.release()
            self.placement = None


def assert_off_event_loop(what: str) -> None:
    """Raises if called from a thread running an asyncio event loop: tensor work belongs
    on the device thread (DESIGN.md invariant), where it cannot stall every request."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return  # no loop runs in this thread
    raise RuntimeError(f"{what} is tensor work and must not run on the asyncio event loop")


class SegmentPlacement(Protocol):
    """Takes each layer segment of one recording as soon as it is recorded (offload/)."""

    def add_segment(self, index: int, segment: LayerSegment, saved: list["SavedTensor"]) -> None: ...

    def keep(self, *tensors: torch.Tensor) -> None: ...

    def finish(self, recording: "RecordedPrefill", head_saved: list["SavedTensor"]) -> None: ...

    def release(self) -> None: ...


class SegmentSink(Protocol):
    def begin_recording(self, num_tokens: int, rows: int) -> SegmentPlacement:
        """A recording of a `num_tokens`-token prompt begins, in a step of `rows` rows
        (the prompt's, then any riding decodes', which its layers' saved inputs hold)."""


@dataclass(frozen=True)
class RecordSpec:
    """How to record one prefill; decided when it is admitted (engine/hooks.py)."""

    # keep logits for every prompt row (a method that reads them), or only the last one
    # (CPT, DPO, GRPO: CPT re-runs the head over the recorded last layer's output in row
    # chunks; the last row scores the first response token)
    all_logit_rows: bool
    # the adapter version serving runs under: the recording's graph is of these weights
    adapter_version: int
    # the prompt's beginning may come from the prefix cache, only the rest recorded: the
    # method trains the cached tokens by recomputing them (RecordedPrefill.prefix_len)
    reads_cached_prefix: bool = False

    def tokens_to_record(self, num_prompt_tokens: int, num_cached_tokens: int) -> int:
        """The prompt tokens this recording records when the prefix cache holds the first
        `num_cached_tokens`: those after them, where it reads the cache; else all."""
        return num_prompt_tokens - (num_cached_tokens if self.reads_cached_prefix else 0)


def stale_tensor_error(tensor: torch.Tensor, expected_version: int) -> RuntimeError:
    """What backward raises for a tensor a graph needs that was changed in place since (as
    autograd words it), when no stashed copy stands for it."""
    return RuntimeError(
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{tuple(tensor.shape)} is at version {tensor._version}; expected version {expected_version} "
        "(a graph recorded under older weights must not be back-propagated)")


class SavedTensor:
    """What autograd holds instead of a saved tensor while the tracker is active."""

    __slots__ = ("tensor", "tracker", "key", "version", "fetch", "__weakref__")

    def __init__(self, tensor: torch.Tensor, tracker: "SavedTensorTracker"):
        # detached: a saved output keeps its grad_fn, whose node keeps this object — a
        # cycle through C++ that Python's gc cannot see, so a graph dropped without a
        # backward (an expired or evicted entry) would never be freed. The detached
        # tensor shares storage and version counter; unpacking re-attaches the autograd
        # metadata, as for tensors saved without hooks.
        self.tensor = tensor.detach()
        self.tracker = tracker
        self.version = tensor._version
        self.key = tracker._acquire(tensor)
        # set by the offloader while the tensor is off the device: puts it back
        self.fetch = None
        if tracker.collected is not None and tracker.segment is not None and self.key is not None:
            tracker.collected.setdefault(tracker.segment, []).append(weakref.ref(self))

    def unpack(self) -> torch.Tensor:
        if self.tensor is None:
            self.fetch(self)
        if self.tensor._version != self.version:
            stashed = self.tracker.resolve_stale(self.tensor, self.version) if self.tracker.resolve_stale else None
            if stashed is not None:
                return stashed
            raise stale_tensor_error(self.tensor, self.version)
        return self.tensor

    def rebind(self, tensor: torch.Tensor | None) -> None:
        """The offloader moved the data: `tensor` (same values, a new storage) or None
        (not resident). The tracker counts resident storages only."""
        if self.key is not None:
            self.tracker._release(self.key)
            self.key = None
        self.tensor = tensor
        if tensor is not None:
            self.version = tensor._version
            self.key = self.tracker._acquire(tensor)

    def __del__(self):
        if self.key is not None:
            self.tracker._release(self.key)


@dataclass
class SavedTensorTracker:
    """Context manager: counts live autograd-saved bytes (deduplicated by storage).

    Parameters (requires_grad leaves such as LoRA weights, frozen weights) and views of
    them are not activations and are not counted.
    """

    live_bytes: int = 0
    peak_bytes: int = 0
    # the layer segment being recorded: saved tensors are attributed to it
    segment: int | None = None
    # when a dict is given: segment -> weak references to its saved tensors
    collected: dict[int, list] | None = None
    # (tensor, its version counter when saved) -> a copy of its values then, for a tensor
    # changed in place since (the LoRA weights of an older adapter version, stashed by
    # the trainer: trainer/stash.py); None: such a tensor raises, as in autograd
    resolve_stale: "Callable[[torch.Tensor, int], torch.Tensor | None] | None" = None
    # when a list is given: the bytes of each storage first saved (a recording's, which
    # size the heap warmer's pieces: engine/malloc_tuning.py)
    new_storage_sizes: list[int] | None = None
    # storage pointer -> (references, bytes)
    _storages: dict[int, list[int]] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def _acquire(self, tensor: torch.Tensor) -> int | None:
        base = tensor._base
        if base is None:
            base = tensor
        # a parameter, or a view of one (addmm saves `weight.t()`); an activation is no
        # leaf, which answers most calls before the slower isinstance (a Python metaclass check)
        if (base.is_leaf and isinstance(base, torch.nn.Parameter)) or tensor.is_meta:
            return None
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with self._lock:
            entry = self._storages.get(key)
            if entry is None:
                nbytes = storage.nbytes()
                self._storages[key] = [1, nbytes]
                if self.new_storage_sizes is not None:
                    self.new_storage_sizes.append(nbytes)
                self.live_bytes += nbytes
                if self.live_bytes > self.peak_bytes:
                    self.peak_bytes = self.live_bytes
            else:
                entry[0] += 1
        return key

    def _release(self, key: int) -> None:
        with self._lock:
            entry = self._storages[key]
            entry[0] -= 1
            if entry[0] == 0:
                self.live_bytes -= entry[1]
                del self._storages[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(functools.partial(SavedTensor, tracker=self),
                                                        SavedTensor.unpack)
