"""Recorded prefills without saved-tensor hooks, their bytes measured once per shape.

A recorded prefill counts the bytes autograd saves for it with saved-tensor hooks
(engine/recording.py, `SavedTensorTracker`): a Python object per saved tensor, made on
the serving path and unpacked, checked and released again in backward — about thirty
per decoder layer, each a handful of Python calls, which is host time a GPU waits for.

The hooks do more than count only where something needs them: an offloader placing a
recording's tensors, or a saved LoRA weight that a stale recording must resolve to its
version's stashed copy. Neither happens when every adapted layer's LoRA math runs from
a training copy (trainer/training_copy.py) or through the CPU's current merged copy
(trainer/adapter.py, `_MergedLoraFunction`) — their graph nodes hold the LoRA weights
and check their versions themselves, and save activations only — and no offloader is
set. Then the
hooks count, and a recording of the same shape saves the same tensors — so a shape is
measured with them the first time it is recorded (and every `remeasure_every`-th time
after, to catch a path that changed), and recorded without them in between, with the
measured figures. Autograd then checks every saved tensor's version itself.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RecordingShape:
    """What the tensors a recorded prefill saves depend on, besides the model."""

    rows: int  # the step's packed rows (the recorded prompt's tokens, then any decodes riding along)
    riders: int  # of which decodes of other sequences
    query_rows: int  # its attention's query rows, padded to a bucket
    num_keys: int  # its attention's key length, padded to a bucket
    all_logit_rows: bool  # the head's logits kept for every row, or the last one only
    cached_tokens: int = 0  # the prompt's beginning read from the prefix cache (its keys saved with the rest)


@dataclass
class SavedBytes:
    """A shape's measured bytes: the total (each storage once) and each storage's size."""

    total: int
    sizes: list[int]
    uses: int = field(default=0, compare=False)


class SavedBytesMemo:
    """`RecordingShape` -> the `SavedBytes` the tracker measured for it (module docstring)."""

    def __init__(self, remeasure_every: int = 64, max_shapes: int = 4096, applies: Callable[[], bool] | None = None):
        # asked before each recorded prefill: whether it saves activations only (a model
        # whose LoRA path depends on the moment: the CPU's merged copies, current or not)
        self.applies = applies or (lambda: True)
        self.remeasure_every = remeasure_every
        self.max_shapes = max_shapes
        self._known: OrderedDict[RecordingShape, SavedBytes] = OrderedDict()
        # remeasurements that differed from the figure they were to confirm
        self.mismatches = 0

    def lookup(self, shape: RecordingShape) -> SavedBytes | None:
        """The figures to record `shape` with, without hooks (read only: recordings share
        them); None: measure this one."""
        known = self._known.get(shape)
        if known is None:
            return None
        known.uses += 1
        if known.uses % self.remeasure_every == 0:
            return None
        self._known.move_to_end(shape)
        return known

    def measured(self, shape: RecordingShape, total: int, sizes: list[int]) -> None:
        """What the tracker measured for a recording of `shape`."""
        known = self._known.get(shape)
        fresh = SavedBytes(total, list(sizes), known.uses if known is not None else 0)
        if known is not None and known != fresh:
            self.mismatches += 1
            logger.warning("a recorded prefill of shape %s saved %d bytes in %d storages, not the %d in %d measured "
                           "before: the figure is replaced", shape, total, len(sizes), known.total, len(known.sizes))
        self._known[shape] = fresh
        self._known.move_to_end(shape)
        while len(self._known) > self.max_shapes:
            self._known.popitem(last=False)
