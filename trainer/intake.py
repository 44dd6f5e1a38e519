"""Where labels come in: `POST /v1/feedback` and the reward function hand each label to
`FeedbackIntake`, which attaches it to its entry (trainer/feedback.py's `attach_label`)
and counts the outcomes that `alchemist:feedback_total` reports. Call it on a worker
thread: a label's texts are tokenized here.
"""

from __future__ import annotations

from collections.abc import Iterable

from trainer.cache import ActivationCache
from trainer.feedback import FeedbackLabel, FeedbackOutcome, FeedbackResult, ResponseText, attach_label
from trainer.ledger import Ledger
from trainer.methods import TrainingMethod
from trainer.status import TrainingStats
from trainer.turn_end import chat_turn_end, label_end


class FeedbackIntake:
    """Where labels come in (`POST /v1/feedback`, the reward function): attaches each to
    its entry and counts the outcomes. Call it on a worker thread."""

    def __init__(self, method: TrainingMethod, cache: ActivationCache, stats: TrainingStats, tokenizer,
                 max_model_len: int, ledger: Ledger | None = None, end_token_ids: Iterable[int] = ()):
        """`ledger`: the feedback ledger, where a label is committed before it is accepted;
        `end_token_ids`: the tokens that end the model's responses (the engine's)."""
        self.ledger = ledger
        self.end_token_ids = frozenset(end_token_ids)
        self.turn_end = chat_turn_end(tokenizer)  # what a chat's label ends with where its answer gave no end
        self.method = method
        self.cache = cache
        self.stats = stats
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def submit(self, request: FeedbackLabel) -> FeedbackResult:
        """Attaches a label (a preference, or a group's rewards) to a completion's entry."""
        if not self.method.uses_feedback:
            result = FeedbackResult(FeedbackOutcome.INVALID, f"feedback is used by preference and group training; "
                                    f"this server trains in {self.method.name!r} mode (start it with --train-mode "
                                    "dpo or grpo)", None, "feedback_not_used")
        else:
            texts = ResponseText(self._response_ids, self._served_text, self._label_end)
            result = attach_label(self.cache, request, texts, self.max_model_len, self.method.label_kind, self.ledger)
        self.count(result, request.rewards if result.accepted else None, request.source == "api")
        return result

    def count(self, result: FeedbackResult, rewards: list[float] | None = None, request: bool = True) -> None:
        """Counts a feedback request's outcome (`alchemist:feedback_total`; not `request`:
        the reward function's label, which no client sent), and an accepted group's
        `rewards`. The server also counts here a body refused before it reached `submit`
        (malformed JSON, a wrong type, an unknown field: INVALID)."""
        with self.stats.lock:
            key = result.outcome.value
            if request:
                self.stats.feedback[key] = self.stats.feedback.get(key, 0) + 1
            if rewards is not None:
                self.stats.rewarded_groups += 1
                self.stats.rewards_received += len(rewards)
                self.stats.reward_sum += sum(rewards)
                self.stats.last_group_mean_reward = sum(r / len(rewards) for r in rewards)  # no overflow at 1e308
                self.stats.zero_advantage_groups += result.skipped

    def _served_text(self, ids: list[int]) -> str:
        """The text the client read: a character cut at the end (by `max_tokens`) is not sent."""
        return self.tokenizer.decode(ids, skip_special_tokens=True).rstrip("\ufffd")

    def _response_ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _label_end(self, served: list[int] | None, prompt_ids: list[int]) -> list[int]:
        return label_end(served, prompt_ids, self.end_token_ids, self.turn_end, self.tokenizer.eos_token_id)
