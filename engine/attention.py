"""Varlen attention over the paged KV cache, plugged into transformers' attention modules.

The model's own attention modules (Llama, Mistral, Phi-3, Qwen2, Qwen3, Gemma 3; their forward swapped
for the family's own with a cheaper RoPE, engine/fused_rope.py) project Q/K/V, apply
RoPE and call the cache's `update()` (our `StepKV`) and then the registered attention
function. Registering one function under the name "alchemist" lets the engine pass its
`AttentionMetadata` as the attention mask; called with anything else (Hugging Face's own
`generate`, the trainer's plain forward) it is exactly SDPA, so the same model object
serves both.
"""

from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from engine.kv_cache import AttentionMetadata, RecordedStepKV, gather_rows
from engine.paged_decode import paged_decode_attention

ATTENTION_NAME = "alchemist"


def cache_keyword(layer) -> str:
    """The name a decoder layer's forward takes the cache by: transformers renamed
    `past_key_values` to `cache` (the old name warns, and goes in a later release)."""
    return "cache" if "cache" in inspect.signature(type(layer).forward).parameters else "past_key_values"


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """query: (1, H, T, D) packed; key/value: the pools (slots, KVH, D) from StepKV.update
    (or a shared-prefix forward's own packed rows, AttentionMetadata.shared_prefix), or a
    forward's own (1, KVH, S, D). Returns (1, T, H, D) as transformers' attention
    functions do: one SDPA call per group of the metadata, or for a decode group with a
    `paged` reading of the pool, one FlexAttention call. In a recorded step with other
    sequences' decodes riding along (`RecordedStepKV`), group 0 is the recorded prompt,
    on its own K/V, and the others read the pool."""
    if not isinstance(attention_mask, AttentionMetadata):
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    meta = attention_mask
    heads, head_dim = query.shape[1], query.shape[3]
    packed = query[0].transpose(0, 1)  # (T, H, D)
    riding = isinstance(key, RecordedStepKV)  # a recorded prompt (group 0) with others' decodes
    if riding:
        (own_key, key), (own_value, value) = key, value
    pooled = key.dim() == 3
    outputs = []
    window = kwargs.get("sliding_window")
    for g, group in enumerate(meta.groups):
        # in a recorded step, another sequence's rows get no gradient: nothing of their attention is saved
        rows = packed.detach() if riding and g > 0 else packed
        queries = gather_rows(rows, group.query_index).transpose(1, 2)  # (b, H, q, D)
        if riding and g == 0:
            keys, values = own_key, own_value
        elif pooled and group.paged is not None:  # decode rows read the pool in place (engine/paged_decode.py)
            out = paged_decode_attention(queries, key, value, group.paged, scaling, window)
            outputs.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
            continue
        elif pooled:
            keys, values = gather_rows(key, group.key_slots).transpose(1, 2), \
                gather_rows(value, group.key_slots).transpose(1, 2)  # (b, KVH, S, D)
        else:
            keys, values = key, value
        causal = group.runs_causal(window)
        mask = None if causal else group.mask(window, queries.dtype)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                             is_causal=causal, scale=scaling,
                                             enable_gqa=keys.shape[1] != heads)  # (b, H, q, D)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
    out = gather_rows(outputs[0] if len(outputs) == 1 else torch.cat(outputs), meta.output_index)
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
