"""The adapter's serving copy: the LoRA weights requests run with, in the model's dtype,
fused per shared input, changed only in place (DESIGN.md, "Two copies of the adapter").

PEFT keeps the master weights in float32 for the optimizer; serving them as they are
costs a bf16 model casts at every adapted layer, and three small GEMMs per layer (x Aᵀ,
then · Bᵀ, then the sum with the base output). The serving copy holds, per group of
adapted layers that read the same input (q/k/v; gate/up; o and down alone):

- `a`: the members' A stacked, (Σr, in): one GEMM for the group's x Aᵀ;
- `b`: their s·B block-diagonal, (Σout, Σr), with the base biases: one GEMM for every
  member's LoRA output at once;

and each member adds its slice of that to its base GEMM in the same op (`addmm`, or
oneDNN's linear with a fused add on the CPU). It is refreshed with `copy_` whenever the
adapter changes and serving follows it (`refresh_serving_copies`, from the trainer's
maintenance) — never while the eval gate holds serving on the promoted version — so a
CUDA graph that reads it by address stays valid.
"""

from __future__ import annotations

import torch

from engine.packed_linear import PackedLinear
from trainer.training_copy import TrainingCopies


class SharedInputGroup:
    """Adapted layers of one decoder layer that read the same input."""

    def __init__(self, layers: list, dtype: torch.dtype):
        self.layers = layers
        # the live master parameters, changed in place by the optimizer and a restore (the
        # weight stash swaps other tensors into the layers only inside training slices)
        self._masters = weights = [layer.serving_masters() for layer in layers]
        device = weights[0][0].device
        ranks = [a.shape[0] for a, _, _ in weights]
        outs = [b.shape[0] for _, b, _ in weights]
        self.a = torch.zeros(sum(ranks), weights[0][0].shape[1], dtype=dtype, device=device)
        self.b = torch.zeros(sum(outs), sum(ranks), dtype=dtype, device=device)
        biases = [layer.base_layer.bias for layer in layers]
        self.bias = None  # the members' base biases, added by the group's GEMM (zeros where a member has none)
        if any(b is not None for b in biases):
            self.bias = torch.cat([torch.zeros(out, dtype=dtype, device=device) if b is None else b.detach().to(dtype)
                                   for b, out in zip(biases, outs)])
        self.blocks: list[tuple[slice, slice]] = []
        row = col = 0
        for rank, out in zip(ranks, outs):
            self.blocks.append((slice(row, row + out), slice(col, col + rank)))
            row, col = row + out, col + rank
        self.columns = [rows for rows, _ in self.blocks]  # each member's slice of the group's output
        # the group's copies for autograd in the model's dtype (trainer/training_copy.py); None: PEFT's path
        self.training: TrainingCopies | None = None
        self._input: torch.Tensor | None = None
        self._delta: torch.Tensor | None = None
        self._served = 0
        self.refresh()

    @property
    def pinned(self) -> bool:
        return any(layer.serving_pinned for layer in self.layers)

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies the master weights in, in place (the storage never changes)."""
        for (rows, cols), (a, b, scale) in zip(self.blocks, self._masters):
            self.a[cols].copy_(a)
            self.b[rows, cols].copy_(b * scale)

    def delta(self, x: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        """(N, Σout): every member's LoRA output (and base bias) for the input `x` (its rows
        `flat`), computed by the group's first member to ask and kept until each has read it."""
        if self._input is not x:
            xa = flat @ self.a.t()
            self._delta = torch.addmm(self.bias, xa, self.b.t()) if self.bias is not None else xa @ self.b.t()
            self._input, self._served = x, 0
        delta = self._delta
        self._served += 1
        if self._served == len(self.layers):
            self._input = self._delta = None
        return delta


def serve_from_copy(layer, x: torch.Tensor) -> torch.Tensor:
    """`layer`'s output (base + adapter) from its group's serving copy: one op beyond the group's two."""
    flat = x.reshape(-1, x.shape[-1])
    group = layer.serving_group
    delta = group.delta(x, flat)[:, group.columns[layer.serving_index]]
    base = layer.base_layer
    if isinstance(base, PackedLinear) and flat.device.type == "cpu" and flat.dtype == base.weight.dtype:
        base.ensure_packed()
        out = torch.ops.mkldnn._linear_pointwise.binary(flat, delta, base._packed, None, "add")
    else:
        out = torch.addmm(delta, flat, base.weight.t())
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
    for group in groups:
        if not group.pinned:
            group.refresh()
