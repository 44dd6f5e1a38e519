"""LoRA compute in the model's dtype under autograd: mixed precision for the adapter.

PEFT keeps the LoRA weights in float32 (the master weights, with the optimizer state).
On a bfloat16 model, its forward casts every adapted layer's input to float32, runs both
LoRA GEMMs in float32 and casts the sum back — forward and backward, in every recorded
prefill and every training forward. Instead, per group of adapted layers that read the
same input (trainer/serving_copy.py's groups: q/k/v, gate/up, o, down), a recorded or
training forward runs with a copy of the group's LoRA weights in the model's dtype as
autograd leaves, laid out as the serving copy is:

- `a`: the members' A stacked, (Σr, in): one GEMM for the group's x Aᵀ;
- `b`: their s·B block-diagonal, (Σout, Σr), with the base biases: one GEMM for every
  member's LoRA output at once, split (a view) among the members, each added to its
  base GEMM in the same op (`addmm`).

A copy is built from the weights the layers hold at that moment (the live ones, or a
stashed version's that trainer/stash.py swapped in) and never changed: a graph recorded
under version v keeps v's copy, and the first forward after the weights change builds a
new one (a cast of the adapter's weights, once per version, not per step). The gradient
that autograd accumulates on a copy is cast onto the float32 weights it was built from
at once (a post-accumulate hook), so the optimizer, clipping, the replicas' all-reduce
and the stash find it where PEFT's path puts it. That is mixed precision as AMP does it:
float32 master weights and optimizer state, low-precision compute.

Used where the model's dtype is not the adapter's (the GPU's bfloat16 models); a float32
model keeps PEFT's path and the CPU's merged one (trainer/adapter.py). The gradient's
difference from PEFT's float32 path is measured in tests/test_training_copy.py.
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict

import torch

# copies kept per group: the live weights' and those of the stashed version a job swaps in
# (a graph holds its own copy for as long as it lives)
_KEPT_COPIES = 2


class _Copy:
    """One group's LoRA weights in the model's dtype, for one set of source weights."""

    def __init__(self, group, sources: list[tuple[torch.Tensor, torch.Tensor, float]]):
        self.sources = sources  # kept alive: their identities key this copy
        a = torch.zeros_like(group.a)
        b = torch.zeros_like(group.b)
        with torch.no_grad():
            for (rows, cols), (source_a, source_b, scale) in zip(group.blocks, sources):
                a[cols].copy_(source_a)
                b[rows, cols].copy_(source_b * scale)
        # parameters, as the weights they copy: a recording's byte count skips them
        self.a, self.b = torch.nn.Parameter(a), torch.nn.Parameter(b)
        # the hooks hold the sources, not the copy: a copy a graph no longer needs is freed
        self.a.register_post_accumulate_grad_hook(functools.partial(_a_grad_to_sources, group.blocks, sources))
        self.b.register_post_accumulate_grad_hook(functools.partial(_b_grad_to_sources, group.blocks, sources))


@torch.no_grad()
def _a_grad_to_sources(blocks, sources, a: torch.Tensor) -> None:
    try:
        grad = a.grad.to(sources[0][0].dtype)  # one cast for the group
        for (_, cols), (source, _, _) in zip(blocks, sources):
            _accumulate(source, grad[cols], 1.0)
    finally:
        a.grad = None


@torch.no_grad()
def _b_grad_to_sources(blocks, sources, b: torch.Tensor) -> None:
    try:
        grad = b.grad.to(sources[0][1].dtype)
        for (rows, cols), (_, source, scale) in zip(blocks, sources):
            _accumulate(source, grad[rows, cols], scale)  # d(s·B) = s dB
    finally:
        b.grad = None


def _accumulate(weight: torch.Tensor, grad: torch.Tensor, scale: float) -> None:
    if weight.grad is None:
        weight.grad = grad * scale if scale != 1.0 else grad.contiguous()
    else:
        weight.grad.add_(grad, alpha=scale)


class TrainingCopies:
    """A group's copies for autograd, by the identity and version of its source weights."""

    def __init__(self, group, parameter_keys: set[int] | None = None):
        """`parameter_keys`: storages the activation offloader counts as weights (a copy
        saved by a recorded graph is a weight, not an activation), while each copy lives."""
        self.group = group
        self.parameter_keys = parameter_keys
        self._copies: OrderedDict[tuple, _Copy] = OrderedDict()
        # every copy alive, those graphs keep included
        self._alive: weakref.WeakSet[_Copy] = weakref.WeakSet()
        self._input: torch.Tensor | None = None
        self._pieces: tuple[torch.Tensor, ...] = ()
        self._served = 0

    def count_as_weights(self, parameter_keys: set[int]) -> None:
        """From now on (and for the copies alive now) the offloader counts copies as weights."""
        self.parameter_keys = parameter_keys
        for copy in self._copies.values():
            self._track(copy)

    def current(self) -> _Copy:
        sources = [layer.serving_masters() for layer in self.group.layers]
        key = tuple((id(t), t._version) for a, b, _ in sources for t in (a, b))
        copy = self._copies.get(key)
        if copy is None:
            copy = self._copies[key] = _Copy(self.group, sources)
            self._alive.add(copy)
            self._track(copy)
            while len(self._copies) > _KEPT_COPIES:
                self._copies.popitem(last=False)
        self._copies.move_to_end(key)
        return copy

    @torch.no_grad()
    def aim_at_sources(self) -> None:
        """Gives every copy alive its sources' values now (`train.stale_weights = "live"`,
        trainer/stash.py), through `.data`: a graph that saved a copy reads them rather
        than refusing it as changed."""
        for copy in list(self._alive):
            for (rows, cols), (source_a, source_b, scale) in zip(self.group.blocks, copy.sources):
                copy.a.data[cols].copy_(source_a)
                copy.b.data[rows, cols].copy_(source_b * scale)

    def _track(self, copy: _Copy) -> None:
        if self.parameter_keys is None:
            return
        for tensor in (copy.a, copy.b):
            key = tensor.untyped_storage().data_ptr()
            self.parameter_keys.add(key)
            weakref.finalize(tensor, self.parameter_keys.discard, key)

    def pieces(self, x: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's LoRA output (with its base bias) for the input `x` (rows `flat`),
        computed by the group's first member to ask and kept until each has read it."""
        if self._input is not x:
            copy = self.current()
            xa = flat @ copy.a.t()
            bias = self.group.bias
            delta = torch.addmm(bias, xa, copy.b.t()) if bias is not None else xa @ copy.b.t()
            self._pieces = delta.split([rows.stop - rows.start for rows, _ in self.group.blocks], dim=1)
            self._input, self._served = x, 0
        pieces = self._pieces
        self._served += 1
        if self._served == len(self.group.layers):
            self._input, self._pieces = None, ()
        return pieces


def train_from_copy(layer, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output (base + adapter) under autograd, the LoRA part in the model's dtype."""
    flat = x.reshape(-1, x.shape[-1])
    piece = layer.serving_group.training.pieces(x, flat)[layer.serving_index]
    out = torch.addmm(piece, flat, layer.base_layer.weight.t())
    return out.view(*x.shape[:-1], out.shape[-1])


def uses_training_copy(layer, x: torch.Tensor) -> bool:
    """Whether `layer` (single adapter, adapters on, in a group) should take this path for
    `x`: the model's dtype differs from the master weights'."""
    group = layer.serving_group
    if group is None or group.training is None or layer.merged or layer.active_adapters[0] in layer.lora_variant:
        return False
    return x.dtype != layer.serving_masters()[0].dtype
