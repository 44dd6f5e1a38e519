"""The LoRA adapter (PEFT) attached in place to the served model.

The runner keeps references to the model's decoder layers; PEFT replaces their target
linear layers in place, so serving and training both see base + adapter from then on.
Dropout is 0: the reuse and recompute paths must compute the same function.

Serving goes through every adapted layer at every decode step. `LeanLoraLinear` serves
without autograd in one of two ways, both computing `x (W + s B A)^T`:
  - merged: one oneDNN GEMM with a packed copy of `W + s B A` (CPU). The copy is current
    only while the base and LoRA weights have the version counters it was built from, so
    an optimizer step invalidates it by itself; the trainer rebuilds copies in idle slices
    (`merge_stale`). This makes serving in training mode as fast as without an adapter.
  - from the serving copy (trainer/serving_copy.py): the LoRA weights in the model's
    dtype, fused per shared input, refreshed in place when the adapter changes — the
    GPU's path, and the CPU's while its merged copy is stale;
  - lean: `base(x) + s (x A^T) B^T` in three ops, with the live weights (no serving copy).
With autograd on a model whose dtype is not the adapter's (bfloat16 on the GPU), the LoRA
math runs in the model's dtype from the group's training copy (trainer/training_copy.py).
A step may mix merged and lean layers: both stand for the same, current adapter. While
the eval gate scores a candidate (trainer/eval_gate.py), serving is pinned to the merged
copies of the promoted version, whatever the live weights. With
autograd (a recorded prefill, a training forward) and a current merged copy, the forward
is the same single GEMM and `_MergedLoraFunction` forms the LoRA products in backward;
otherwise, and with several adapters, PEFT's own forward runs. With the adapters disabled
(the base model: DPO's reference) the base layer runs alone, as PEFT's forward would
run it, without that forward's checks on every adapted layer.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Callable

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import Linear as LoraLinear, LoraLayer

from engine.direct_apply import direct_apply
from engine.gated_mlp import act_and_mul_again, act_and_mul_inputs
from engine.packed_linear import packed_linear_available
from engine.recording import stale_tensor_error
from trainer.config import TrainConfig
from trainer.serving_copy import SharedInputGroup, serve_from_copy
from trainer.training_copy import train_from_copy

# every linear layer of the decoder, as QLoRA recommends and PEFT's "all-linear" does
# (Phi-3 fuses q/k/v and gate/up). Against attention projections only: measured with
# examples/learn_a_fact.py in BENCHMARKS.md, "Training: CPT".
_LLAMA_LIKE = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DEFAULT_TARGETS = {
    "llama": _LLAMA_LIKE,
    "mistral": _LLAMA_LIKE,
    "qwen2": _LLAMA_LIKE,
    "qwen3": _LLAMA_LIKE,
    "gemma3_text": _LLAMA_LIKE,
    "phi3": ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"),
}


class _MergedLoraFunction(torch.autograd.Function):
    """`x (W + s B A)^T` through the merged packed weight — one GEMM, as serving runs it —
    with gradients to the input and to A and B. The LoRA products (x A^T, g B) are formed
    in backward, which runs in a training slice, not in the forward that a recorded
    prefill runs on the serving path. Saves only x, or, for the down projection, the gate
    and up x is the product of (engine/gated_mlp.py). A, B and the base weight are held on
    the node with their version counters, as the training copies' node holds its weights: backward
    takes a version's stashed copy for a weight an optimizer step changed since
    (`stale_resolver`, trainer/stash.py) and refuses one without, as autograd would; so a
    recorded prefill's saved-tensor hooks (engine/recording.py) see activations only, and
    a shape recorded before runs without them (engine/saved_bytes_memo.py)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer: "LeanLoraLinear") -> torch.Tensor:
        ctx.layer = layer
        weight = layer._merged_from[0]  # the base weight the pack was built from: this layer's (records_merged)
        ctx.weights = (a, b, weight)
        ctx.versions = (a._version, b._version, weight._version)
        factors = act_and_mul_inputs(x)  # x = act(gate) * up: saved already, x is formed again
        ctx.x_again = factors[2] if factors is not None else None  # the activation, or None: x is saved
        ctx.save_for_backward(*(factors[:2] if factors is not None else (x,)))
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(flat, layer._merged_pack, layer._merged_bias, "none", [], "")
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        inputs = ctx.saved_tensors
        x = act_and_mul_again(*inputs, ctx.x_again) if ctx.x_again else inputs[0]
        layer = ctx.layer
        weight, scale = ctx.weights[2], layer.scaling[layer.active_adapters[0]]
        if weight._version != ctx.versions[2]:
            raise RuntimeError("a frozen weight was modified in place between forward and backward")
        a, b = (layer.weight_at(w, version) for w, version in zip(ctx.weights[:2], ctx.versions))
        g = grad.reshape(-1, grad.shape[-1])  # (N, out)
        flat = x.reshape(-1, x.shape[-1])  # (N, in)
        g_b = g @ b  # (N, r)
        grad_x = torch.addmm(g @ weight, g_b, a, alpha=scale).view_as(x) if ctx.needs_input_grad[0] else None
        grad_a = (g_b.t() @ flat).mul_(scale) if ctx.needs_input_grad[1] else None
        grad_b = (g.t() @ (flat @ a.t())).mul_(scale) if ctx.needs_input_grad[2] else None
        return grad_x, grad_a, grad_b, None


_merged_lora = direct_apply(_MergedLoraFunction)


class LeanLoraLinear(LoraLinear):
    _merged_pack: torch.Tensor | None = None
    # the (base, A, B) weights the merged pack was built from, and their versions then
    _merged_from: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    _merged_key: tuple[int, int, int] | None = None
    # the base layer's bias (frozen), held with the pack: `self.base_layer.bias` is two
    # `nn.Module.__getattr__` calls on every adapted layer of every step
    _merged_bias: torch.Tensor | None = None
    # an older version's LoRA weights are swapped in (trainer/stash.py): the merged copy,
    # built from the live ones, does not stand for them
    weights_swapped: bool = False
    _serving_pinned: bool = False
    # the serving copy (trainer/serving_copy.py) this layer serves from, and its place in it
    serving_group: SharedInputGroup | None = None
    serving_index: int = 0
    # (a LoRA weight, its version counter then) -> its values then, or None (WeightStash.resolve)
    stale_resolver: Callable[[torch.Tensor, int], torch.Tensor | None] | None = None

    @property
    def serving_pinned(self) -> bool:
        """The eval gate holds serving on the promoted version (trainer/eval_gate.py): serving
        keeps the merged copy and the serving copy while the live LoRA weights are a
        candidate; released, the serving copy follows the live weights again."""
        return self._serving_pinned

    @serving_pinned.setter
    def serving_pinned(self, pinned: bool) -> None:
        released = self._serving_pinned and not pinned
        self._serving_pinned = pinned
        if released and self.serving_group is not None:
            self.serving_group.refresh()

    def serving_masters(self) -> tuple[torch.Tensor, torch.Tensor, float]:
        """The live LoRA weights (A, B) and scale, as the serving copy is made of them."""
        return self._weights()[1:]

    def weight_at(self, weight: torch.Tensor, version: int) -> torch.Tensor:
        """`weight` (a LoRA weight of this layer) as it was at version counter `version`:
        itself if unchanged since, else its stashed copy; raises as autograd would if there
        is none."""
        if weight._version == version:
            return weight
        stashed = self.stale_resolver(weight, version) if self.stale_resolver is not None else None
        if stashed is None:
            raise stale_tensor_error(weight, version)
        return stashed

    def records_merged(self, dtype: torch.dtype) -> bool:
        """Whether a forward under autograd of an input in `dtype` runs `_MergedLoraFunction`:
        the merged copy current and in that dtype, built from the very weights this layer
        holds (a weight replaced by another tensor, not changed in place, is not what it
        stands for), adapters on. It runs on every adapted layer of every recorded forward:
        the weights are read from the modules' own dictionaries (PEFT's `active_adapters`
        and `nn.Module.__getattr__` cost a Python call per read)."""
        pack = self._merged_pack
        if pack is None or pack.dtype != dtype or self._disable_adapters or self.weights_swapped:
            return False
        w, a, b = self._merged_from
        if (w._version, a._version, b._version) != self._merged_key:  # merged_is_current(), inline: a call per layer
            return False
        name = self._active_adapter
        name = name if isinstance(name, str) else name[0]
        return (a is self._modules["lora_A"]._modules[name]._parameters["weight"]
                and b is self._modules["lora_B"]._modules[name]._parameters["weight"]
                and w is self._modules["base_layer"]._parameters["weight"])

    def plain_adapter(self) -> bool:
        """One active adapter, not merged into the base weight by PEFT, without a variant
        (DoRA): the adapter `attach_lora` makes. Read from PEFT's attributes, not its
        properties, which cost a few Python calls each on every adapted layer of every
        forward under autograd."""
        active = self._active_adapter
        if not isinstance(active, str):
            if len(active) != 1:
                return False
            active = active[0]
        return not self.merged_adapters and active not in self.lora_variant

    def _weights(self):
        name = self.active_adapters[0]
        return self.base_layer.weight, self.lora_A[name].weight, self.lora_B[name].weight, self.scaling[name]

    def can_merge(self) -> bool:
        """A float32 base weight on a CPU that packs it: `W + s B A` rounded to bfloat16 or
        float16 would lose an update smaller than W's precision (and PEFT's float32 A and B
        are not in W's dtype), so a lower-precision model serves its adapter unmerged."""
        weight = self.base_layer.weight
        return (weight.dtype == torch.float32 and packed_linear_available(weight.device, weight.dtype)
                and len(self.active_adapters) == 1)

    def merged_is_current(self) -> bool:
        if self._merged_pack is None:
            return False
        w, a, b = self._merged_from
        return (w._version, a._version, b._version) == self._merged_key

    @torch.no_grad()
    def build_merged(self) -> None:
        w, a, b, scale = self._weights()
        key = (w._version, a._version, b._version)
        self._merged_pack = torch.ops.mkldnn._reorder_linear_weight(torch.addmm(w, b, a, alpha=scale), 8)
        self._merged_from, self._merged_key = (w, a, b), key
        object.__setattr__(self, "_merged_bias", self.base_layer.bias)  # a plain attribute, not a second parameter

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        # the hot paths (serving, and recording, in training mode) read plain attributes only, then one GEMM
        if not args and not kwargs:
            if self._disable_adapters:
                if not self.merged_adapters:
                    return self.base_layer(x)  # the base model (DPO's reference): all PEFT's forward would run
            elif not torch.is_grad_enabled():
                pack = self._merged_pack
                if (pack is not None and not self.weights_swapped and x.dtype == pack.dtype
                        and (self._serving_pinned or self.merged_is_current())):
                    flat = x.reshape(-1, x.shape[-1])
                    out = torch.ops.mkldnn._linear_pointwise(flat, pack, self._merged_bias, "none", [], "")
                    return out.view(*x.shape[:-1], out.shape[-1])
                if self.serving_group is not None and not self.weights_swapped:
                    return serve_from_copy(self, x)
            else:
                out = train_from_copy(self, x)  # before the merged path: a group's members all take it
                if out is not None:
                    return out
                if self.records_merged(x.dtype):
                    _, a, b = self._merged_from  # this layer's own, as records_merged checked
                    return _merged_lora(x, a, b, self)
        adapters = self.active_adapters
        if (args or kwargs or torch.is_grad_enabled() or self.disable_adapters or self.merged
                or len(adapters) != 1 or adapters[0] in self.lora_variant or adapters[0] not in self.lora_A):
            return super().forward(x, *args, **kwargs)
        name = adapters[0]
        a, b = self.lora_A[name].weight, self.lora_B[name].weight  # (r, in), (out, r)
        result = self.base_layer(x)
        flat = x.reshape(-1, x.shape[-1])
        if a.dtype != flat.dtype:  # float32 adapter on a bfloat16/float16 model: peft's casts
            delta = (flat.to(a.dtype) @ a.t()) @ b.t()
            return result + (delta * self.scaling[name]).to(result.dtype).view(result.shape)
        out = torch.addmm(result.reshape(-1, result.shape[-1]), flat @ a.t(), b.t(), alpha=self.scaling[name])
        return out.view(result.shape)


@contextlib.contextmanager
def peft_deprecation_quieted():
    """Without the FutureWarning PEFT's own call of a name transformers 5 deprecated prints
    at every start (`is_gradient_checkpointing`: not ours to change)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        yield


def peft_model_of(model, lora: LoraConfig) -> PeftModel:
    """`get_peft_model`, quietly (`peft_deprecation_quieted`)."""
    with peft_deprecation_quieted():
        return get_peft_model(model, lora)


def attach_lora(model, config: TrainConfig, init_lora_weights: bool | str = True) -> PeftModel:
    """Wraps `model` (modified in place) with a fresh LoRA adapter; base weights frozen."""
    targets = list(config.target_modules) or list(DEFAULT_TARGETS[model.config.model_type])
    names = [name for name, _ in model.named_modules()]
    unknown = [target for target in targets  # matched as PEFT matches a name: whole, or a dotted suffix
               if not any(name == target or name.endswith("." + target) for name in names)]
    if unknown:  # PEFT drops a name that matches nothing while another matches: an adapter without it
        linear = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                  if isinstance(module, torch.nn.Linear)}
        raise ValueError(f"train.target_modules: {unknown} name no module of this model; its linear layers are "
                         f"{sorted(linear)}")
    lora = LoraConfig(r=config.lora_rank, lora_alpha=config.lora_alpha, target_modules=targets, lora_dropout=0.0,
                      bias="none", task_type="CAUSAL_LM", init_lora_weights=init_lora_weights)
    device = next(model.parameters()).device
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # every generator it seeds
        torch.manual_seed(config.seed)
        peft_model = peft_model_of(model, lora)
    peft_model.eval()  # no dropout anywhere; gradients still flow
    outside = [name for name, module in peft_model.named_modules()
               if isinstance(module, LoraLayer) and ".layers." not in name]
    if outside:  # the engine holds the head and embeddings it was built with: they would serve unadapted
        raise ValueError(f"train.target_modules: only the decoder layers' linear layers can be adapted, not "
                         f"{outside[0].removeprefix('base_model.model.')}")
    for module in peft_model.modules():
        if type(module) is LoraLinear:
            module.__class__ = LeanLoraLinear
    return peft_model


class adapters_disabled:
    """Context manager: the base model, adapters off. PEFT's `disable_adapter()` walks the
    whole model and flips `requires_grad` on every adapter parameter; entered once per
    training slice (reference log-probs) that costs more than the slice, so this flips
    only the adapted layers' flag — as a plain attribute (`object.__setattr__`): a
    module's own `__setattr__` first asks whether the value is a parameter, a buffer or a
    module, which on every adapted layer twice per slice is most of the flip's cost."""

    def __init__(self, peft_model: PeftModel):
        layers = getattr(peft_model, "_alchemist_lora_layers", None)
        if layers is None:
            layers = [m for m in peft_model.modules() if isinstance(m, LoraLinear)]
            peft_model._alchemist_lora_layers = layers
        self.layers = layers

    def __enter__(self):
        self.previous = [layer._disable_adapters for layer in self.layers]
        for layer in self.layers:
            object.__setattr__(layer, "_disable_adapters", True)
        return self

    def __exit__(self, *exc):
        for layer, previous in zip(self.layers, self.previous):
            object.__setattr__(layer, "_disable_adapters", previous)


def records_through_merged(layers: list[LeanLoraLinear], dtype: torch.dtype) -> bool:
    """Whether a recorded forward (of hidden states in `dtype`, the model's) now takes every
    one of `layers` through `_MergedLoraFunction` (its merged copy current, its own weights
    in place, adapters on), so that the recording saves activations only
    (engine/saved_bytes_memo.py)."""
    return bool(layers) and all([layer.records_merged(dtype) for layer in layers])


def merge_all(peft_model: PeftModel) -> None:
    """Rebuilds every stale merged copy now (at start or after a resume: nobody waits)."""
    while merge_stale(peft_model, budget_s=1.0):
        pass


def merge_stale(peft_model: PeftModel, budget_s: float) -> int:
    """Rebuilds stale merged copies until `budget_s` has passed (about a slice, between jobs);
    returns how many were rebuilt (0: all current, or merging not possible here)."""
    import time

    started, rebuilt = time.perf_counter(), 0
    for module in peft_model.modules():
        if isinstance(module, LeanLoraLinear) and module.can_merge() and not module.merged_is_current():
            module.build_merged()
            rebuilt += 1
            if time.perf_counter() - started >= budget_s:
                break
    return rebuilt


def lora_parameters(peft_model: PeftModel) -> list[torch.nn.Parameter]:
    return [p for name, p in peft_model.named_parameters() if "lora_" in name and p.requires_grad]


def lora_gradients(peft_model: PeftModel) -> dict[str, torch.Tensor]:
    return {name: p.grad.detach().clone() for name, p in peft_model.named_parameters()
            if "lora_" in name and p.grad is not None}
