"""RMSNorm as one op: `torch.nn.functional.rms_norm` in place of the model's own pieces.

The Hugging Face families the engine serves (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 3) normalise in
six ops (eight in bfloat16, with the casts): `pow`, `mean`, `add`, `rsqrt`, `mul`, then
the weight's `mul`. Every decoder layer runs two, and the model one more before the head,
in every serving step and every training forward. On a GPU each op is a kernel launch,
and torch dispatches `rms_norm` to one fused kernel there (`_fused_rms_norm`, which has a
backward of its own; `bench/gpu.sh profile` lists a step's kernels). On the CPU it runs
the same pieces inside one op, so the CPU's time does not change, only the count of ops
dispatched.

The results are those of the model's own module, to the bit on the CPU (in float32 and
bfloat16, forward and input gradient; `tests/test_fused_norm.py`); on an H100 to the bit in
bfloat16, and in float32 not to the bit (the fused kernel sums in another order). The
module normalises in float32, rounds to the model's dtype and then multiplies by the weight in that dtype,
so outside float32 the weight stays a separate `mul` after the fused op. Gemma's norm scales by
1 + weight in float32 and rounds last: the fused op in float32 with 1 + weight as its weight (made
once, not per call), then the rounding.

`install_fused_rms_norm(model)` swaps the class of each such module in place for a
subclass of its own (names, parameters and state dict unchanged); modules of any other
class keep their forward.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

# the classes whose forward is Llama's `weight * (x.float() * rsqrt(mean(x²) + eps)).to(dtype)`
_SAME_AS_LLAMA = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm", "Phi3RMSNorm")
# Gemma's: `(x.float() * rsqrt(mean(x²) + eps) * (1 + weight.float())).to(dtype)`
_GEMMA = ("Gemma3RMSNorm",)


def _fused_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    shape = (hidden_states.shape[-1],)
    if hidden_states.dtype == torch.float32:  # nothing is rounded between the norm and the weight
        return F.rms_norm(hidden_states, shape, self.weight, self.variance_epsilon)
    return F.rms_norm(hidden_states, shape, None, self.variance_epsilon) * self.weight


def _fused_gemma_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    normed = F.rms_norm(hidden_states.float(), (hidden_states.shape[-1],), _gemma_scale(self), self.eps)
    return normed if normed.dtype == hidden_states.dtype else normed.to(hidden_states.dtype)


def _gemma_scale(norm: nn.Module) -> torch.Tensor:
    """1 + weight in float32, made once per value of the weight (a frozen one, as under LoRA:
    a weight that is trained gets it formed in its graph each time)."""
    weight = norm.weight
    if (weight.requires_grad and torch.is_grad_enabled()) or weight.is_inference():  # (no version to key by)
        return 1.0 + weight.float()
    key = (weight._version, weight.data_ptr(), weight.dtype, weight.device)  # a value, a move or a cast
    made = getattr(norm, "_scale_of", None)
    if made is None or made[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a tensor a recorded graph may save
            made = norm._scale_of = (key, 1.0 + weight.float())
    return made[1]


@functools.cache
def _fused_class(original: type) -> type:
    name = f"Fused{original.__name__}"
    forward = _fused_gemma_forward if original.__name__ in _GEMMA else _fused_forward
    globals()[name] = fused = type(name, (original,), {"forward": forward, "__module__": __name__})
    return fused  # a module-level name, as pickle looks it up, in a process that installed it


def install_fused_rms_norm(model: nn.Module) -> int:
    """Switches every RMSNorm of a supported family to the fused op; returns how many."""
    count = 0
    for module in model.modules():
        name = type(module).__name__
        if (name in _SAME_AS_LLAMA and hasattr(module, "variance_epsilon")) or \
                (name in _GEMMA and hasattr(module, "eps")):
            module.__class__ = _fused_class(type(module))
            count += 1
    return count
