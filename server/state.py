"""What the routes share: the async engine, the tokenizer, the served model's name and
limits, the metrics, and the trainer (None when training is off)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from engine.async_engine import AsyncEngine
from server.metrics import ServingMetrics
from server.tool_calls import TOOL_CALL_OPEN


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
    # `<tool_call>` as one special token (Qwen's), or None where the tokenizer spells it in text
    tool_call_token: int | None = field(init=False)

    def __post_init__(self) -> None:
        added = getattr(self.tokenizer, "get_added_vocab", dict)()
        self.tool_call_token = added.get(TOOL_CALL_OPEN)

    def token_text(self, token_id: int) -> str:
        """A token as shown in logprobs (decoded once, then cached)."""
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text
