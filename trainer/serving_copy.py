"""The adapter's serving copy: the LoRA weights requests run with, in the model's dtype,
fused per shared input, changed only in place (DESIGN.md, "Two copies of the adapter").

PEFT keeps the master weights in float32 for the optimizer; serving them as they are
costs a bf16 model casts at every adapted layer, and three small GEMMs per layer (x Aᵀ,
then · Bᵀ, then the sum with the base output). The serving copy holds, per group of
adapted layers that read the same input (q/k/v; gate/up; o and down alone):

- `weight`: the members' base weights and their A stacked below them, (Σout + Σr, in),
  one buffer. The members' `base_layer.weight` become rows of it (the model keeps no
  other copy), and `a` is its last Σr rows;
- `b`: the members' s·B block-diagonal, (Σout, Σr).

A group is then two GEMMs, however many members it has: `x Wᵀ` gives every member's base
output and the group's x Aᵀ at once, and one `addmm` adds (x Aᵀ)(s·B)ᵀ to the base
outputs; each member's output is a slice of that. On the CPU, where the base layers run
oneDNN's packed weights (engine/packed_linear.py), the packs stay as they are: the group
runs x Aᵀ and · (s·B)ᵀ, and each member adds its slice to its packed GEMM in the same op.

Each base weight is an alias of its rows with a version counter of its own, not a view:
refreshing A changes the buffer, and must not look like a change of the frozen weights
to autograd (a recording saved them), to the packs or to the merged copies (all keyed on
their version). The copy is refreshed with `copy_` whenever the adapter changes and
serving follows it (`refresh_serving_copies`, from the trainer's maintenance) — never
while the eval gate holds serving on the promoted version — so a CUDA graph that reads
it by address stays valid.
"""

from __future__ import annotations

import torch

from engine.packed_linear import PackedLinear
from trainer.training_copy import TrainingCopies, masters_key


def _rows_of(buffer: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """Rows `start:stop` of `buffer`: the same memory, with a version counter of its own."""
    rows = buffer[start:stop]
    return torch.empty(0, dtype=buffer.dtype, device=buffer.device).set_(
        buffer.untyped_storage(), rows.storage_offset(), rows.shape, rows.stride())


class SharedInputGroup:
    """Adapted layers of one decoder layer that read the same input."""

    def __init__(self, layers: list, dtype: torch.dtype):
        self.layers = layers
        # the live master parameters, changed in place by the optimizer and a restore (the
        # weight stash swaps other tensors into the layers only inside training slices)
        self._masters = weights = [layer.serving_masters() for layer in layers]
        # the same, flat: each member's A, then its B (their version counters say when they change)
        self.master_tensors = [t for a, b, _ in weights for t in (a, b)]
        # the master weights' dtype (a stashed version's, swapped in, is the same); an
        # attribute, not a property: every adapted layer's forward under autograd reads it
        self.master_dtype = weights[0][0].dtype
        bases = [layer.base_layer for layer in layers]
        device = weights[0][0].device
        ranks = [a.shape[0] for a, _, _ in weights]
        self.outs = outs = [b.shape[0] for _, b, _ in weights]
        width = sum(outs)
        self.weight = torch.empty(width + sum(ranks), weights[0][0].shape[1], dtype=dtype, device=device)
        self._share_base_weights(bases, outs)
        # the members' base weights together, as one frozen weight (a training forward's
        # backward reads it: trainer/training_copy.py), and their A below them
        self.base_weight = torch.nn.Parameter(_rows_of(self.weight, 0, width), requires_grad=False)
        self.a = self.weight[width:]
        self.b = torch.zeros(width, sum(ranks), dtype=dtype, device=device)
        biases = [base.bias for base in bases]
        self.bias = None  # the members' base biases (zeros where a member has none)
        self._fused_bias = None  # the same, then zeros for the rank's columns of `x Wᵀ`
        if any(b is not None for b in biases):
            self.bias = torch.cat([torch.zeros(out, dtype=dtype, device=device) if b is None else b.detach().to(dtype)
                                   for b, out in zip(biases, outs)])
            self._fused_bias = torch.cat([self.bias, torch.zeros(sum(ranks), dtype=dtype, device=device)])
        self.blocks: list[tuple[slice, slice]] = []
        row = col = 0
        for rank, out in zip(ranks, outs):
            self.blocks.append((slice(row, row + out), slice(col, col + rank)))
            row, col = row + out, col + rank
        # each member's A and s·B in the copy, views made once (a refresh writes through them)
        self.block_views = [t for rows, cols in self.blocks for t in (self.a[cols], self.b[rows, cols])]
        # the group's copies for autograd in the model's dtype (trainer/training_copy.py); None: PEFT's path
        self.training: TrainingCopies | None = None
        # the identity and version of each master weight the copy holds now (None: none yet)
        self.held: tuple | None = None
        self._input: torch.Tensor | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._served = 0
        self._members = len(layers)
        self.refresh()

    @torch.no_grad()
    def _share_base_weights(self, bases: list, outs: list[int]) -> None:
        row = 0
        for base, out in zip(bases, outs):
            if base.weight.dtype != self.weight.dtype:
                raise ValueError(f"a base weight in {base.weight.dtype} cannot share a {self.weight.dtype} "
                                 "serving copy")
            self.weight[row:row + out].copy_(base.weight)
            base.weight = torch.nn.Parameter(_rows_of(self.weight, row, row + out), base.weight.requires_grad)
            row += out

    @property
    def live_masters(self) -> list[tuple[torch.Tensor, torch.Tensor, float]]:
        """Each member's live (A, B, scale): what its layer holds unless `swapped`."""
        return self._masters

    @property
    def swapped(self) -> bool:
        """The weight stash has another version's LoRA weights in a member's layer."""
        for layer in self.layers:  # a loop, not any(): asked per group in every forward under autograd
            if layer.weights_swapped:
                return True
        return False

    @property
    def pinned(self) -> bool:
        return any([layer.serving_pinned for layer in self.layers])

    def refresh(self) -> None:
        """Copies the master weights in, in place (the storage never changes), and makes
        the training copy of them now (two clones of the serving copy's), not in the
        next recorded prefill."""
        _refresh([self])

    def _check_bases_shared(self) -> None:
        storage = self.weight.untyped_storage().data_ptr()
        if any(layer.base_layer.weight.untyped_storage().data_ptr() != storage for layer in self.layers):
            raise RuntimeError("a base weight was replaced after the serving copy was built: serving and "
                               "training would read different weights")

    def _refreshed(self) -> None:
        self.held = masters_key(self._masters)
        # the next recorded prefill finds the training copy built (not while a stashed
        # version is swapped in: its copy would push the live weights' out)
        if self.training is not None and not self.swapped:
            self.training.current()

    def outputs(self, x: torch.Tensor, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Every member's output (base + adapter) for the input `x` (its rows `flat`),
        computed by the group's first member to ask and kept until each has read it."""
        if self._input is not x:
            packed = _packed_bases(self.layers, flat)
            self._outputs = self._packed_outputs(flat, packed) if packed else self._fused_outputs(flat)
            self._input, self._served = x, 0
        outputs = self._outputs
        self._served += 1
        if self._served == self._members:
            self._input, self._outputs = None, ()
        return outputs

    def _fused_outputs(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.fused_output(flat).split_with_sizes(self.outs, dim=1)  # not `split`: its Python wrapper

    def fused_output(self, flat: torch.Tensor) -> torch.Tensor:
        """The members' outputs side by side, (N, Σout), in two GEMMs."""
        width = self.b.shape[0]
        base_and_rank = (torch.addmm(self._fused_bias, flat, self.weight.t()) if self._fused_bias is not None
                         else torch.mm(flat, self.weight.t()))
        return torch.addmm(base_and_rank[:, :width], base_and_rank[:, width:], self.b.t())

    def _packed_outputs(self, flat: torch.Tensor, packed: list) -> tuple[torch.Tensor, ...]:
        xa = flat @ self.a.t()
        delta = torch.addmm(self.bias, xa, self.b.t()) if self.bias is not None else xa @ self.b.t()
        return tuple(torch.ops.mkldnn._linear_pointwise.binary(flat, delta[:, rows], pack, None, "add")
                     for pack, (rows, _) in zip(packed, self.blocks))


def _packed_bases(layers: list, flat: torch.Tensor) -> list[torch.Tensor]:
    """The members' oneDNN packs, where every member's base layer runs packed for `flat`."""
    packs = []
    for layer in layers:
        base = layer.base_layer
        if not (isinstance(base, PackedLinear) and flat.device.type == "cpu" and flat.dtype == base.weight.dtype):
            return []
        base.ensure_packed()
        packs.append(base._packed)
    return packs


def serve_from_copy(layer, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output (base + adapter) from its group's serving copy."""
    flat = x.reshape(-1, x.shape[-1])
    out = layer.serving_group.outputs(x, flat)[layer.serving_index]
    return out.view(*x.shape[:-1], out.shape[-1])


# a decoder layer's linears grouped by the input they read (Llama, Mistral, Qwen2; Phi-3's are fused already)
SHARED_INPUTS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.qkv_proj",),
                 ("self_attn.o_proj",), ("mlp.gate_proj", "mlp.up_proj"), ("mlp.gate_up_proj",), ("mlp.down_proj",))


def build_serving_copies(decoder_layers, is_adapted, dtype: torch.dtype,
                         train_in_model_dtype: bool = False) -> list[SharedInputGroup]:
    """A serving copy for every adapted linear of `decoder_layers`, grouped by shared input
    (a group's members are those of its names that are adapted); `train_in_model_dtype`:
    recorded and training forwards run their LoRA math in `dtype` too (trainer/training_copy.py)."""
    groups = []
    for block in decoder_layers:
        modules = dict(block.named_modules())
        for names in SHARED_INPUTS:
            members = [modules[n] for n in names if n in modules and is_adapted(modules[n])]
            if not members:
                continue
            group = SharedInputGroup(members, dtype)
            if train_in_model_dtype:
                group.training = TrainingCopies(group)
            for index, member in enumerate(members):
                member.serving_group, member.serving_index = group, index
            groups.append(group)
    return groups


def refresh_serving_copies(groups: list[SharedInputGroup]) -> None:
    """The adapter changed: serving follows it, except where the eval gate pins it."""
    _refresh([group for group in groups if not group.pinned])


@torch.no_grad()
def _refresh(groups: list[SharedInputGroup]) -> None:
    """The groups' A and s·B from their masters in three foreach ops, not three ops per
    member; s·B is scaled in the masters' dtype before its one rounding to the copy's, as
    a member's own copy would. A GPU copies a list in one launch only where each block is
    laid out as its source: the B blocks of a group of several members, strided across
    the others', go in a list of their own (copied one by one on a GPU)."""
    blocks, masters = [], []
    for group in groups:
        group._check_bases_shared()
        blocks += group.block_views
        masters += group._masters
    if not masters:
        return
    scaled_b = torch._foreach_mul([b for _, b, _ in masters], [scale for _, _, scale in masters])
    sources = [t for (a, _, _), b in zip(masters, scaled_b) for t in (a, b)]
    alike = [block.stride() == source.stride() for block, source in zip(blocks, sources)]
    for same_layout in (True, False):
        pairs = [(block, source) for block, source, same in zip(blocks, sources, alike) if same is same_layout]
        if pairs:
            torch._foreach_copy_([block for block, _ in pairs], [source for _, source in pairs])
    for group in groups:
        group._refreshed()
