"""How many bytes a recorded layer holds and a serving step needs (the offloading map).

Bytes are a deterministic function of token counts (paper §4.3.1): a recorded layer of
T prompt tokens saves `per_token * T + per_token_sq * T^2` bytes (the T^2 term is the
attention probabilities where attention saves them); a serving step of S tokens in B
sequences needs its transient activations, attention scores and logits. `MemoryModel`
starts from the model config (`analytic`) and is calibrated by measuring recordings on
the actual device (`calibrate`, run by `alchemist profile` and at start).

`OffloadingMap` is the paper's table: for cached tokens C, serving tokens S and batch B,
rounded up to 500-token and 5-sequence steps, the layers that must be freed for the
step to fit. At run time the engine asks it for the serving step's bytes; the cached
side is what the offloader's accounting measures, which is exact.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

TOKEN_STEP, BATCH_STEP = 500, 5


def round_up(value: int, step: int) -> int:
    return max(step, -(-value // step) * step)


@dataclass
class MemoryModel:
    num_layers: int
    # recorded activation bytes per layer
    per_token: float
    per_token_sq: float
    # a serving step's transient bytes: per token, per (token x key) attention score, per sampled row
    step_per_token: float
    step_per_score: float
    step_per_row: float
    max_model_len: int
    # measured / analytic recorded bytes (1.0 until calibrated)
    calibration: float = 1.0
    # bytes per recorded token that are never freed: each layer's input, output and K/V,
    # and the logits (all rows for CPT: the vocabulary per token, an upper bound for DPO)
    kept_per_token: float = 0.0
    # of which once per recording, not per layer: the rotary tables, the head segment
    head_per_token: float = 0.0
    # bytes per token of a prompt's beginning read from the prefix cache that its recording
    # keeps: each layer's keys and values, within the whole prompt's (0: not known, as in a
    # profile written before: a recorded token's `kept_per_token`)
    kept_per_cached_token: float = 0.0

    @classmethod
    def analytic(cls, config, dtype_bytes: int, max_model_len: int) -> "MemoryModel":
        hidden, inter = config.hidden_size, config.intermediate_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or hidden // heads  # Qwen3's heads are wider
        queries, kv = heads * head_dim, getattr(config, "num_key_value_heads", heads) * head_dim
        # saved per token by one decoder layer under LoRA training: the two norms' inputs and
        # outputs, q/k/v and attention output, the MLP's gate and up (engine/gated_mlp.py forms
        # silu(gate) and the product again in backward), and the LoRA input of each adapted
        # linear (shared with the above where they are the same tensor). Gemma 3 normalises each
        # sublayer's output too: two norms more
        norms = 4 if config.model_type == "gemma3_text" else 2
        per_token = dtype_bytes * (2 * norms * hidden + 2 * queries + 2 * kv + 2 * inter)
        step_per_token = dtype_bytes * (4 * hidden + 2 * kv + 3 * inter)
        # once per recording: the rotary tables (cos, sin and the signed sin of
        # engine/fused_rope.py), the head's input and the logits
        head = dtype_bytes * (3 * head_dim + hidden + config.vocab_size)
        kept = dtype_bytes * config.num_hidden_layers * (2 * hidden + 2 * kv) + head
        kept_cached = dtype_bytes * config.num_hidden_layers * 2 * kv
        return cls(config.num_hidden_layers, float(per_token), 0.0, float(step_per_token),
                   float(4 * heads), float(4 * config.vocab_size), max_model_len, kept_per_token=float(kept),
                   head_per_token=float(head), kept_per_cached_token=float(kept_cached))

    def recording_in_flight_bytes(self, rows: int) -> int:
        """What a recorded prefill of `rows` tokens adds at most before the offloader can
        free its layers: one layer, that layer's kept tensors, and the once-per-recording
        tensors (`rows`: the prompt's and any riding decodes', whose attention saves nothing)."""
        layer = self.layer_bytes(rows)
        kept_per_layer = (self.kept_per_token - self.head_per_token) / max(self.num_layers, 1)
        return int(layer + (kept_per_layer + self.head_per_token) * rows)

    def layer_bytes(self, tokens: int) -> int:
        return int(self.per_token * tokens + self.per_token_sq * tokens * tokens)

    def recording_bytes(self, tokens: int) -> int:
        return self.num_layers * self.layer_bytes(tokens)

    def serving_bytes(self, tokens: int, batch: int) -> int:
        keys = min(self.max_model_len, max(tokens, 1))
        return int(self.step_per_token * tokens + self.step_per_score * tokens * keys + self.step_per_row * batch)

    def calibrate(self, measured: dict[int, int]) -> None:
        """Fits per_token and per_token_sq to measured per-layer bytes {tokens: bytes}."""
        points = sorted(measured.items())
        analytic = sum(self.layer_bytes(t) for t, _ in points)
        if len(points) >= 2:
            (t1, b1), (t2, b2) = points[0], points[-1]
            sq = max(0.0, (b2 / t2 - b1 / t1) / (t2 - t1))
            self.per_token_sq = sq
            self.per_token = max(b / t - sq * t for t, b in points)
        else:
            t, b = points[0]
            self.per_token = b / t
        self.calibration = sum(b for _, b in points) / max(analytic, 1)


@dataclass
class OffloadingMap:
    """Layers to free for (cached tokens, serving tokens, batch), on a rounded-up grid."""

    model: MemoryModel
    # bytes the cached activations and a serving step may use together on the device
    budget_bytes: int
    token_step: int = TOKEN_STEP
    batch_step: int = BATCH_STEP
    # (serving tokens, batch) on the grid -> bytes; filled lazily
    _serving: dict[tuple[int, int], int] = field(default_factory=dict)

    def serving_bytes(self, tokens: int, batch: int) -> int:
        key = (round_up(tokens, self.token_step), round_up(batch, self.batch_step))
        if key not in self._serving:
            self._serving[key] = self.model.serving_bytes(*key)
        return self._serving[key]

    def allowed_cached_bytes(self, tokens: int, batch: int) -> int:
        """Bytes of cached activations that may stay on the device during such a step."""
        return max(0, self.budget_bytes - self.serving_bytes(tokens, batch))

    def layers_to_free(self, cached_tokens: int, tokens: int, batch: int) -> int:
        """The paper's query: layers (of a recording of `cached_tokens`) to free; more
        than num_layers means it does not fit even on its own: offload it while recording."""
        cached = round_up(cached_tokens, self.token_step)
        excess = self.model.recording_bytes(cached) - self.allowed_cached_bytes(tokens, batch)
        return 0 if excess <= 0 else math.ceil(excess / max(self.model.layer_bytes(cached), 1))

    def table(self, max_cached_tokens: int, max_tokens: int, max_batch: int) -> list[dict]:
        rows = []
        for cached in range(self.token_step, round_up(max_cached_tokens, self.token_step) + 1, self.token_step):
            for tokens in range(self.token_step, round_up(max_tokens, self.token_step) + 1, self.token_step):
                for batch in range(self.batch_step, round_up(max_batch, self.batch_step) + 1, self.batch_step):
                    rows.append({"cached_tokens": cached, "serving_tokens": tokens, "batch": batch,
                                 "serving_bytes": self.serving_bytes(tokens, batch),
                                 "layers_to_free": self.layers_to_free(cached, tokens, batch)})
        return rows
