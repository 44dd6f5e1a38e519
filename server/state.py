"""What the routes share: the async engine, the tokenizer, the served model's name and
limits, the metrics, and the trainer (None when training is off)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from server.metrics import ServingMetrics


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: object
    model_name: str
    max_model_len: int
    metrics: ServingMetrics
    # the online trainer, when training is on
    trainer: object | None = None
    # the saved adapter served frozen, when training is off (trainer/frozen.py)
    served_adapter: object | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _token_text: dict[int, str] = field(default_factory=dict)

    def token_text(self, token_id: int) -> str:
        """A token as shown in logprobs (decoded once, then cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
