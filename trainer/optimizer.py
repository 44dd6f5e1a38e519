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

    def step(self, loss_is_finite: bool = True, entries: int = 1) -> bool:
        """Applies the accumulated gradients of `entries` entries; returns False (and
        counts it) if skipped. The step's learning rate is `entries` times the configured
        one (the linear scaling rule): AdamW moves each parameter by about the learning
        rate per step whatever the gradient's size, so a step over k entries at the plain
        rate would teach about 1/k of what k steps of one entry teach."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).item()
        if not loss_is_finite or not math.isfinite(grad_norm):
            self.skipped_steps += 1
            self.zero_grad()
            return False
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * entries
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, rates):
                group["lr"] = lr
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
