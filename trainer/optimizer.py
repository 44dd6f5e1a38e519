"""AdamW over the LoRA parameters, with clipping, non-finite skips and adapter versions.

Every optimizer step bumps the adapter version; a step whose loss or gradients are not
finite is skipped (gradients discarded, version unchanged) and counted.
"""

from __future__ import annotations

import copy
import math

import torch


class AdapterOptimizer:
    def __init__(self, params: list[torch.nn.Parameter], learning_rate: float, max_grad_norm: float):
        self.params = params
        self.optimizer = torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0)
        self.max_grad_norm = max_grad_norm
        # bumped by every applied step
        self.version = 0
        self.skipped_steps = 0

    def step(self, loss_is_finite: bool = True) -> bool:
        """Applies the accumulated gradients; returns False (and counts it) if skipped."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).item()
        if not loss_is_finite or not math.isfinite(grad_norm):
            self.skipped_steps += 1
            self.zero_grad()
            return False
        self.optimizer.step()
        self.zero_grad()
        self.version += 1
        return True

    def state_dict(self) -> dict:
        """A copy of AdamW's state (moments, step counts), independent of later steps."""
        return copy.deepcopy(self.optimizer.state_dict())

    def load_state_dict(self, state: dict, version: int) -> None:
        """Restores AdamW's state and sets the version; the configured learning rate wins
        over the saved one."""
        learning_rates = [group["lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, learning_rates):
            group["lr"] = lr
        self.zero_grad()
        self.version = version

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
