"""Add your own training method: continual pre-training on the user's words only.

The built-in CPT trains on every prompt token, including the chat template and the
system prompt, which the model already knows. This method subclasses the cache entry
(to carry a mask of the user's tokens, computed once when the prefill is recorded) and
the training method (to weight the loss's tokens). Both of alchemist's paths use the same loss:
`reuse_job` from the recorded prefill, `recompute_job` from a full forward.

Run it offline on the embedded model (or --model DIR, a ChatML-template model):

    .venv/bin/python examples/custom_method.py

In a server: `build_training(runner, tokenizer, max_model_len, config.train, method=UserTurnCPT(tokenizer))`
(server/build.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.recording import RecordedPrefill  # noqa: E402
from trainer.entries import CacheEntry  # noqa: E402
from trainer.methods import CPTMethod, TrainContext  # noqa: E402


@dataclass(eq=False)
class UserTurnEntry(CacheEntry):
    # True for prompt tokens inside a user turn
    user_mask: list[bool] = field(default_factory=list)


def user_turn_mask(tokenizer, token_ids: list[int]) -> list[bool]:
    """Marks the tokens of user turns in a ChatML prompt (<|im_start|>user ... <|im_end|>)."""
    start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    user = tokenizer("user", add_special_tokens=False)["input_ids"]
    mask, inside, i = [False] * len(token_ids), False, 0
    while i < len(token_ids):
        if token_ids[i] == start and token_ids[i + 1:i + 1 + len(user)] == user:
            inside, i = True, i + 1 + len(user) + 1  # skip the role and its newline
            continue
        if token_ids[i] == end:
            inside = False
        mask[i] = inside
        i += 1
    return mask


class UserTurnCPT(CPTMethod):
    name = "user-cpt"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def make_entry(self, completion_id: str, recording: RecordedPrefill) -> UserTurnEntry:
        prompt = list(recording.prompt_token_ids)
        return UserTurnEntry(completion_id, prompt, recording, recording.adapter_version, recording.saved_bytes,
                             user_mask=user_turn_mask(self.tokenizer, prompt))

    def token_weights(self, entry: UserTurnEntry, ctx: TrainContext) -> torch.Tensor:
        """Cross-entropy of the next token, averaged over targets inside user turns only
        (the loss is the weighted sum of the targets' cross-entropies)."""
        mask = torch.tensor(entry.user_mask[1:], dtype=torch.float32, device=ctx.runner.device)
        return mask / mask.sum().clamp_min(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="", help="local model directory (default: embedded)")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()

    from engine.model_loader import load_model
    from engine.sampling_params import SamplingParams
    from server.build import build_training_engine
    from server.config import load_config
    from trainer.config import TrainConfig

    config = load_config()
    model, tokenizer, _ = load_model(args.model)
    engine, trainer = build_training_engine(model, tokenizer, config, TrainConfig(mode="cpt", learning_rate=3e-4),
                                            method=UserTurnCPT(tokenizer))
    fact = "My cat is called Bartholomew Whiskerton and he is seven years old."
    text = tokenizer.apply_chat_template([{"role": "user", "content": fact}], add_generation_prompt=True,
                                         tokenize=False)
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    entry_mask = user_turn_mask(tokenizer, prompt)
    print(f"prompt: {len(prompt)} tokens, {sum(entry_mask)} of them the user's")
    for step in range(args.steps):
        engine.add_request(f"r{step}", prompt, SamplingParams(max_tokens=4), train=True)
        while engine.has_unfinished():
            engine.step()
        trainer.train_until_idle()
        print(f"step {step + 1}: adapter version {trainer.optimizer.version}, "
              f"user-turn loss {trainer.stats.last_loss:.3f}")


if __name__ == "__main__":
    main()
