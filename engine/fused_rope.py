"""RoPE in eight ops per decoder layer where the model runs ten, each product the model's own.

The families the engine serves rotate the query and the key each as
`x·cos + rotate_half(x)·sin` with `rotate_half(x) = cat(−x₂, x₁)`: mul, neg, cat, mul,
add, twice per decoder layer, in every step. Since `rotate_half(x)·sin = roll(x, D/2)·ŝ`
with `ŝ = cat(−sin₁, sin₂)` — negation is exact, so each product is the same number —
the engine rotates each as mul, roll, mul, add. `ŝ` is built once per step beside cos and
sin (`RotaryTables`, from `SignedRotary`), not once per layer. The results are the
model's own to the bit (`tests/test_fused_rope.py`), forward and backward. The query and
the key stay in storages of their own: a recording keeps each layer's K for as long as it
lives, and a K that shared its storage with the query would keep the query too.

`install_fused_rope(model)` swaps the class of each attention module of a supported
family for a subclass whose forward is the family's own (projections, RoPE, the cache's
update, the registered attention function with the family's sliding window, the output
projection) with this RoPE; a module of any other class keeps its forward.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward


class RotaryTables(tuple):
    """(cos, sin), as the model's rotary embedding returns them, with `signed_sin` (ŝ)."""

    signed_sin: torch.Tensor

    def of_layer(self, index: int) -> "RotaryTables":
        """The tables decoder layer `index` rotates with: these, for every layer."""
        return self

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (*self, self.signed_sin)


class LayerTables:
    """RotaryTables by kind of decoder layer, for a model whose kinds rotate with bases of
    their own (Gemma 3: its sliding-window layers' and its full-attention layers')."""

    def __init__(self, by_kind: dict[str, RotaryTables], layer_kinds: list[str]):
        self.by_kind, self.layer_kinds = by_kind, layer_kinds

    def of_layer(self, index: int) -> RotaryTables:
        return self.by_kind[self.layer_kinds[index]]

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return tuple(t for tables in self.by_kind.values() for t in tables.tensors())


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """ŝ = cat(−sin₁, sin₂) over the last dimension's halves."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


class SignedRotary:
    """The model's rotary embedding module, returning RotaryTables (LayerTables where the
    module makes one per kind of layer, `layer_kinds` naming each decoder layer's)."""

    def __init__(self, rotary: nn.Module, layer_kinds: list[str] | None = None):
        self.rotary = rotary
        by_kind = "layer_type" in inspect.signature(rotary.forward).parameters
        self.layer_kinds = list(layer_kinds) if by_kind and layer_kinds else None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> RotaryTables | LayerTables:
        if self.layer_kinds is None:
            return _signed(*self.rotary(x, position_ids))
        kinds = dict.fromkeys(self.layer_kinds)
        return LayerTables({kind: _signed(*self.rotary(x, position_ids, kind)) for kind in kinds}, self.layer_kinds)


def _signed(cos: torch.Tensor, sin: torch.Tensor) -> RotaryTables:
    tables = RotaryTables((cos, sin))
    tables.signed_sin = signed_sin(sin)
    return tables


def rotate_query_and_key(query: torch.Tensor, key: torch.Tensor, position_embeddings) -> tuple[torch.Tensor, ...]:
    """query (B, H, T, D), key (B, KVH, T, D) rotated by (cos, sin) (B, T, D), as the
    family's `apply_rotary_pos_emb` rotates them."""
    cos, sin = position_embeddings
    signed = getattr(position_embeddings, "signed_sin", None)
    if signed is None:  # tables from the model's own rotary embedding (its `generate`)
        signed = signed_sin(sin)
    cos, signed = cos.unsqueeze(1), signed.unsqueeze(1)
    return _rotate(query, cos, signed), _rotate(key, cos, signed)


def _rotate(x: torch.Tensor, cos: torch.Tensor, signed: torch.Tensor) -> torch.Tensor:
    rotary_dim = cos.shape[-1]  # Phi-3's partial rotary: the dimensions past it pass unrotated
    if rotary_dim < x.shape[-1]:
        return torch.cat([_rotate(x[..., :rotary_dim], cos, signed), x[..., rotary_dim:]], dim=-1)
    return x * cos + x.roll(rotary_dim // 2, dims=-1) * signed


def _projections(module: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    if hasattr(module, "qkv_proj"):  # Phi-3: one projection, split
        qkv = module.qkv_proj(hidden_states)
        query_size = module.config.num_attention_heads * module.head_dim
        key_size = module.num_key_value_heads * module.head_dim
        return qkv[..., :query_size], qkv[..., query_size:query_size + key_size], qkv[..., query_size + key_size:]
    return module.q_proj(hidden_states), module.k_proj(hidden_states), module.v_proj(hidden_states)


def _window_kwargs(module: nn.Module) -> dict:
    """The sliding window the family's own forward passes to the attention function:
    Qwen2's, Qwen3's and Gemma 3's their layer's, Mistral and Phi-3 the config's, Llama none."""
    if module.window_from == "layer":
        return {"sliding_window": module.sliding_window}
    if module.window_from == "config":
        return {"sliding_window": getattr(module.config, "sliding_window", None)}
    return {}


def _fused_forward(self, hidden_states: torch.Tensor, position_embeddings=None, attention_mask=None, cache=None,
                   past_key_values=None, **kwargs):
    cache = cache if cache is not None else past_key_values
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    query, key, value = (t.view(hidden_shape) for t in _projections(self, hidden_states))
    if self.norms_heads:  # Qwen3, Gemma 3: an RMSNorm over each head's query and key, before RoPE
        query, key = self.q_norm(query), self.k_norm(key)
    query, key = rotate_query_and_key(query.transpose(1, 2), key.transpose(1, 2), position_embeddings)
    value = value.transpose(1, 2)
    if cache is not None:
        key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
    output, weights = attention(self, query, key, value, attention_mask,
                                dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling,
                                **_window_kwargs(self), **kwargs)
    output = output.reshape(*input_shape, -1).contiguous()
    return self.o_proj(output), weights


# the attention classes whose forward is Llama's but for where its sliding window comes
# from (Phi-3 also splits one qkv projection; Qwen3 and Gemma 3 normalise each head's query and key)
_WINDOW_FROM = {"LlamaAttention": None, "MistralAttention": "config", "Qwen2Attention": "layer",
                "Qwen3Attention": "layer", "Gemma3Attention": "layer", "Phi3Attention": "config"}
_NORMS_HEADS = ("Qwen3Attention", "Gemma3Attention")


@functools.cache
def _fused_class(original: type) -> type:
    name = f"Fused{original.__name__}"
    globals()[name] = fused = type(name, (original,), {"forward": _fused_forward, "__module__": __name__,
                                                      "window_from": _WINDOW_FROM[original.__name__],
                                                      "norms_heads": original.__name__ in _NORMS_HEADS})
    return fused  # a module-level name, as pickle looks it up, in a process that installed it


def install_fused_rope(model: nn.Module) -> int:
    """Switches every attention module of a supported family to this RoPE; returns how many."""
    count = 0
    for module in model.modules():
        if type(module).__name__ in _WINDOW_FROM:
            module.__class__ = _fused_class(type(module))
            count += 1
    return count
