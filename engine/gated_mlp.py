"""The gated MLP's activation under autograd, saving what its backward needs and no more.

The families the engine serves compute their MLP as `down(act(gate(x)) * up(x))`, the
activation SiLU (Llama, Mistral, Qwen2, Qwen3, Phi-3) or the tanh-approximated GELU
(Gemma 3). Under autograd, the activation saves its input (the gate) and the `*` saves
both its inputs: act(gate) and up — one tensor the width of the MLP's intermediate more
than the backward needs, since act(gate) is one cheap elementwise op from the gate. Every
recorded prefill keeps those tensors per token and layer until its label comes (the MLP's
are the widest a recording holds), and every training forward holds them until its
backward; the bytes a recording keeps per token are in BENCHMARKS.md.

`ActAndMul` saves the gate and up only, and forms act(gate) again in its backward: one
more elementwise op per layer and backward, the same ops otherwise, so that the values
and gradients are those of the model's own module to the bit (`tests/test_gated_mlp.py`).
The product itself is the down projection's input, which its LoRA function saves for the
adapter's gradients; the project's LoRA functions (trainer/adapter.py's merged one,
trainer/training_copy.py's group one) save the gate and up instead — the same storages
`ActAndMul` saved — and form the product again in their backward (two elementwise ops).
A recording then keeps two intermediate-wide tensors per token and layer where autograd
alone keeps four.
With grad disabled (every serving step but a recorded prefill) the module runs the
model's own ops, with no autograd Function on the way.

`install_gated_mlp(model)` swaps the class of each such MLP whose activation is exactly
one of those two for a subclass of its own (names, parameters and state dict unchanged),
as engine/fused_norm.py does for RMSNorm.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.direct_apply import direct_apply

# the MLPs computing `down(act(gate(x)) * up(x))`, and Phi-3's with gate and up fused in one linear
_GATE_AND_UP = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "Gemma3MLP")
_FUSED_GATE_UP = ("Phi3MLP",)
# the activations it forms again, by name: SiLU, and the tanh-approximated GELU (Gemma's)
SILU, GELU_TANH = "silu", "gelu_tanh"


def activation(kind: str, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if kind == SILU else F.gelu(x, approximate="tanh")


def _activation_backward(kind: str, grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if kind == SILU:
        return torch.ops.aten.silu_backward(grad, x)
    return torch.ops.aten.gelu_backward(grad, x, approximate="tanh")


class ActAndMul(torch.autograd.Function):
    """act(gate) * up, saving gate and up."""

    @staticmethod
    def forward(ctx, gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.kind = kind
        return activation(kind, gate) * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        gate, up = ctx.saved_tensors
        # as autograd's own graph: the product's two gradients, then the activation's backward
        grad_gate = _activation_backward(ctx.kind, grad * up, gate) if ctx.needs_input_grad[0] else None
        grad_up = grad * activation(ctx.kind, gate) if ctx.needs_input_grad[1] else None
        return grad_gate, grad_up, None


_act_and_mul = direct_apply(ActAndMul)


def act_and_mul(gate: torch.Tensor, up: torch.Tensor, kind: str = SILU) -> torch.Tensor:
    """act(gate) * up: through `ActAndMul` where a graph is recorded, else the plain ops.
    Under autograd the product remembers its factors (`act_and_mul_inputs`), so that the
    down projection's LoRA function can save them (saved here already) in its place."""
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        product = _act_and_mul(gate, up, kind)
        product._act_and_mul_of = (gate, up, kind, (product._version, gate._version, up._version))
        return product
    return activation(kind, gate) * up


def act_and_mul_inputs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """The (gate, up, activation) of which `x` is `act_and_mul`'s product under autograd,
    else None — also when any of the three tensors changed in place since (a hook's edit):
    then x is what a backward must read, and it is saved as autograd would."""
    made = getattr(x, "_act_and_mul_of", None)
    if made is None:
        return None
    gate, up, kind, versions = made
    return (gate, up, kind) if (x._version, gate._version, up._version) == versions else None


def act_and_mul_again(gate: torch.Tensor, up: torch.Tensor, kind: str) -> torch.Tensor:
    """The product once more, in a backward (the forward's ops: the same values to the bit)."""
    return activation(kind, gate) * up


def _gate_and_up_forward(self, x: torch.Tensor) -> torch.Tensor:
    return self.down_proj(act_and_mul(self.gate_proj(x), self.up_proj(x), self.activation_kind))


def _fused_gate_up_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)
    return self.down_proj(act_and_mul(gate, up, self.activation_kind))


@functools.cache
def _gated_class(original: type, kind: str) -> type:
    forward = _fused_gate_up_forward if original.__name__ in _FUSED_GATE_UP else _gate_and_up_forward
    name = ("Gated" if kind == SILU else "GatedGeluTanh") + original.__name__
    globals()[name] = gated = type(name, (original,), {"forward": forward, "__module__": __name__,
                                                      "activation_kind": kind})
    return gated  # a module-level name, as pickle looks it up, in a process that installed it


def _activation_kind(module: nn.Module) -> str | None:
    """SILU or GELU_TANH for the module's activation, where it is exactly that op; else None."""
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None)
    if type(act).__name__ in ("SiLUActivation", "SiLU"):
        return SILU
    op = getattr(act, "act", None)  # transformers' GELUTanh: F.gelu(approximate="tanh") unless told otherwise
    if type(act).__name__ == "GELUTanh" and isinstance(op, functools.partial) and op.func is F.gelu \
            and op.keywords == {"approximate": "tanh"}:
        return GELU_TANH
    return None


def install_gated_mlp(model: nn.Module) -> int:
    """Switches every gated MLP of a supported family whose activation is SiLU or the tanh
    GELU to `act_and_mul`; returns how many."""
    count = 0
    for module in model.modules():
        kind = _activation_kind(module) if type(module).__name__ in _GATE_AND_UP + _FUSED_GATE_UP else None
        if kind is not None:
            module.__class__ = _gated_class(type(module), kind)
            count += 1
    return count
