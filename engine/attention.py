"""Varlen attention over the paged KV cache, plugged into transformers' attention modules.

The model's own attention modules (Llama, Mistral, Phi-3, Qwen2) project Q/K/V, apply
RoPE and call `past_key_values.update()` (our `StepKV`) and then the registered attention
function. Registering one function under the name "alchemist" lets the engine pass its
`AttentionMetadata` as the attention mask; called with anything else (Hugging Face's own
`generate`, the trainer's plain forward) it is exactly SDPA, so the same model object
serves both.
"""

from __future__ import annotations

import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.kv_cache import AttentionMetadata

ATTENTION_NAME = "alchemist"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: (1, H, T, D) packed; key/value: (B, KVH, S, D) from StepKV.update.
    Returns (1, T, H, D) as transformers' attention functions do."""
    if not isinstance(attention_mask, AttentionMetadata):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    meta = attention_mask
    batch, q_max = meta.query_index.shape
    heads, head_dim = query.shape[1], query.shape[3]
    packed = query[0].transpose(0, 1)  # (T, H, D)
    padded = packed[meta.query_index].transpose(1, 2)  # (B, H, Qmax, D)
    out = F.scaled_dot_product_attention(
        padded, key, value, attn_mask=meta.mask(kwargs.get("sliding_window")),
        scale=scaling, enable_gqa=key.shape[1] != heads,
    )  # (B, H, Qmax, D)
    out = out.transpose(1, 2).reshape(batch * q_max, heads, head_dim)[meta.output_index]
    return out.unsqueeze(0), None


def register_attention() -> None:
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTENTION_NAME, sdpa_mask)


def use_engine_attention(model) -> None:
    """Route the model's attention through `paged_attention_forward`."""
    register_attention()
    model.config._attn_implementation = ATTENTION_NAME
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = ATTENTION_NAME
