"""Linear layers that run inference through oneDNN with a prepacked weight on CPU.

At decode batch sizes MKL's sgemm is bound by streaming the weights; oneDNN with the
weight reordered once into its blocked layout streams them faster (`alchemist bench
serving` compares the engine with and without packing, and against plain Hugging Face,
end to end: measured in BENCHMARKS.md, "Serving"). The weights are frozen (only LoRA
adapters train), so the packed copy also serves forwards that autograd records: a recorded
prefill or a training forward needs the gradient with respect to the input only, which
`_PackedLinearFunction` computes as `grad @ W` from the original weight. A weight that
itself requires grad goes through plain `F.linear`. If a weight is modified in place,
its version counter changes: the pack is rebuilt, and a backward through a forward that
used the old weight raises instead of returning a wrong gradient.

Cost: a second copy of each packed weight in host memory.
`install_packed_linear(model)` swaps the class of every `nn.Linear` in place; parameters,
names and state dict are unchanged and PEFT still sees an `nn.Linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_apply import direct_apply

# batch-size hint for oneDNN's weight layout; the packed weight serves any row count
_PACK_ROWS_HINT = 8


def packed_linear_available(device: torch.device, dtype: torch.dtype = torch.float32) -> bool:
    """oneDNN packs float32 weights on any x86 CPU, bfloat16 ones only where it has the
    instructions (AVX-512 BF16 or AVX-NE-CONVERT), and no others."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class _PackedLinearFunction(torch.autograd.Function):
    """Packed forward; backward to the input only (the weight and bias are frozen)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: "PackedLinear") -> torch.Tensor:
        ctx.layer = layer
        ctx.weight_version = layer.weight._version
        return layer._packed_forward(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        layer = ctx.layer
        if layer.weight._version != ctx.weight_version:
            raise RuntimeError("a frozen weight was modified in place between forward and backward")
        return grad.matmul(layer.weight), None


_packed_linear = direct_apply(_PackedLinearFunction)


class PackedLinear(nn.Linear):
    _packed: torch.Tensor | None = None
    _packed_version: int = -1

    def _params_need_grad(self) -> bool:
        return self.weight.requires_grad or (self.bias is not None and self.bias.requires_grad)

    def ensure_packed(self) -> None:
        if self._packed is None or self._packed_version != self.weight._version:
            with torch.no_grad():
                self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach(), _PACK_ROWS_HINT)
            self._packed_version = self.weight._version

    def _packed_forward(self, x: torch.Tensor) -> torch.Tensor:
        self.ensure_packed()
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self._packed, self.bias, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu" or x.dtype != self.weight.dtype:
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and self._params_need_grad():
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and x.requires_grad:
            return _packed_linear(x, self)
        return self._packed_forward(x)


def install_packed_linear(model: nn.Module) -> int:
    """Switches every plain nn.Linear of a CPU model; returns how many were switched."""
    weight = next(model.parameters())
    if not packed_linear_available(weight.device, weight.dtype):
        return 0
    count = 0
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = PackedLinear
            count += 1
    return count
