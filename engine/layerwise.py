"""The served model, layer by layer: the interface the engine's runner offers to work that
runs the model outside a serving step — training forwards and backwards
(trainer/forward.py) and the offloader's recomputation of a freed layer.

`ModelRunner` (engine/model_runner.py) implements it. Attention metadata for packed
sequences has one builder, `AttentionMetadata.packed` (engine/kv_cache.py), reached here
through `attention_metadata`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.fused_rope import LayerTables, RotaryTables
from engine.kv_cache import AttentionMetadata


class LayerwiseModel(Protocol):
    device: torch.device
    # the model's parts: token embedding (1, T) -> (1, T, hidden); final norm; LM head
    # (rows, hidden) -> (rows, V); rotary embedding (hidden, position_ids) -> RotaryTables, or
    # LayerTables (each layer's by `of_layer`)
    embed: torch.nn.Module
    norm: torch.nn.Module
    lm_head: torch.nn.Module
    rotary: torch.nn.Module
    # the decoder layers (`run_layer` runs one)
    layers: torch.nn.ModuleList

    def attention_metadata(self, lengths: list[int], starts: list[int]) -> AttentionMetadata:
        """B sequences packed along one axis, sequence b's queries at positions
        starts[b] .. starts[b] + lengths[b] - 1, attending to positions 0 .. that end."""
        ...

    def shared_prefix_metadata(self, prefix_len: int, suffix_lengths: list[int]) -> AttentionMetadata:
        """A prompt (positions 0 .. prefix_len - 1) and suffixes that each continue it,
        packed along one axis in that order: AttentionMetadata.shared_prefix."""
        ...

    def run_layer(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata,
                  past, position_embeddings: RotaryTables | LayerTables) -> torch.Tensor:
        """Decoder layer `index` on (1, T, hidden)."""
        ...
