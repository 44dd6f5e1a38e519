"""The gated MLP's activation under autograd, saving what its backward needs and no more.

The families the engine serves (Llama, Mistral, Qwen2, Qwen3, Phi-3) compute their MLP as
`down(silu(gate(x)) * up(x))` (Gemma 3's is GELU's, and keeps its own forward). Under autograd,
`silu` saves its input (the gate) and the `*` saves both its inputs: silu(gate) and up — one tensor the width of the MLP's
intermediate more than the backward needs, since silu(gate) is one cheap elementwise op
from the gate. Every recorded prefill keeps those tensors per token and layer until its
label comes (the MLP's are the widest a recording holds), and every training forward holds
them until its backward; the bytes a recording keeps per token are in BENCHMARKS.md.

`SiluAndMul` saves the gate and up only, and forms silu(gate) again in its backward: one
more elementwise op per layer and backward, the same ops otherwise, so that the values
and gradients are those of the model's own module to the bit (`tests/test_gated_mlp.py`).
The product itself is the down projection's input, which its LoRA function saves for the
adapter's gradients; the project's LoRA functions (trainer/adapter.py's merged one,
trainer/training_copy.py's group one) save the gate and up instead — the same storages
`SiluAndMul` saved — and form the product again in their backward (two elementwise ops).
A recording then keeps two intermediate-wide tensors per token and layer where autograd
alone keeps four.
With grad disabled (every serving step but a recorded prefill) the module runs the
model's own ops, with no autograd Function on the way.

`install_gated_mlp(model)` swaps the class of each such MLP whose activation is SiLU for
a subclass of its own (names, parameters and state dict unchanged), as
engine/fused_norm.py does for RMSNorm.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_apply import direct_apply

# the MLPs computing `down(act(gate(x)) * up(x))`, and Phi-3's with gate and up fused in one linear
_GATE_AND_UP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
_FUSED_GATE_UP = ("Phi3MLP",)


class SiluAndMul(torch.autograd.Function):
    """silu(gate) * up, saving gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        return F.silu(gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # as autograd's own graph: the product's two gradients, then silu's backward
        grad_gate = torch.ops.aten.silu_backward(grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * F.silu(gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up


_silu_and_mul = direct_apply(SiluAndMul)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up: through `SiluAndMul` where a graph is recorded, else the plain ops.
    Under autograd the product remembers its factors (`silu_and_mul_inputs`), so that the
    down projection's LoRA function can save them (saved here already) in its place."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        product = _silu_and_mul(gate, up)
        product._silu_and_mul_of = (gate, up, (product._version, gate._version, up._version))
        return product
    return F.silu(gate) * up


def silu_and_mul_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The (gate, up) of which `x` is `silu_and_mul`'s product under autograd, else None —
    also when any of the three changed in place since (a hook's edit): then x is what a
    backward must read, and it is saved as autograd would."""
    made = getattr(x, "_silu_and_mul_of", None)
    if made is None:
        return None
    gate, up, versions = made
    return (gate, up) if (x._version, gate._version, up._version) == versions else None


def silu_and_mul_again(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The product once more, in a backward (the forward's ops: the same values to the bit)."""
    return F.silu(gate) * up


def _gate_and_up_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(silu_and_mul(self.gate_proj(x), self.up_proj(x)))


def _fused_gate_up_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(silu_and_mul(gate, up))


@functools.cache
def _gated_class(original: type) -> type:
    forward = _fused_gate_up_forward if original.__name__ in _FUSED_GATE_UP else _gate_and_up_forward
    name = f"Gated{original.__name__}"
    globals()[name] = gated = type(name, (original,), {"forward": forward, "__module__": __name__})
    return gated  # a module-level name, as pickle looks it up, in a process that installed it


def _activation(module: nn.Module) -> nn.Module | None:
    return getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)


def install_gated_mlp(model: nn.Module) -> int:
    """Switches every gated SiLU MLP of a supported family to `silu_and_mul`; returns how many."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if name in _GATE_AND_UP + _FUSED_GATE_UP and type(_activation(module)).__name__ in ("SiLUActivation", "SiLU"):
            module.__class__ = _gated_class(type(module))
            count += 1
    return count
