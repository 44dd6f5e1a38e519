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
        # the entries these weights were trained on since version 0, every replica's
        # (restored with a saved version)
        self.entries_in_weights = 0
        self.skipped_steps = 0

    def step(self, loss_is_finite: bool = True, entries: int = 1, updates: int = 1) -> bool:
        """Applies the accumulated gradients of `entries` entries as `updates` AdamW
        updates of them, at `entries / updates` times the configured learning rate each;
        returns False (and counts it) if skipped. The rate scales with the entries (the
        linear scaling rule): AdamW moves each parameter by about the learning rate per
        update whatever the gradient's size, so a step over k entries at the plain rate
        would teach about 1/k of what k steps of one entry teach. Several updates let a
        large step move the adapter as the smaller steps it stands for would: AdamW's
        moments take in the gradient at every update (its first moment takes a tenth of
        a new gradient per update), where one update at the whole rate mostly repeats the
        momentum of the steps before it."""
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).item()
        if not loss_is_finite or not math.isfinite(grad_norm):
            self.skipped_steps += 1
            self.zero_grad()
            return False
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for group in self.optimizer.param_groups:
            group["lr"] = group["lr"] * entries / updates
        try:
            for _ in range(updates):
                self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, rates):
                group["lr"] = lr
        self.zero_grad()
        self.version += 1
        self.entries_in_weights += entries
        return True

    def state_dict(self) -> dict:
        """A copy of AdamW's state (moments, step counts), independent of later steps."""
        return copy.deepcopy(self.optimizer.state_dict())

    def load_state_dict(self, state: dict, version: int, entries_in_weights: int = 0) -> None:
        """Restores AdamW's state and sets the version and the entries trained; the
        configured learning rate wins over the saved one."""
        learning_rates = [group["lr"] for group in self.optimizer.param_groups]
        self.optimizer.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, learning_rates):
            group["lr"] = lr
        self.zero_grad()
        self.version = version
        self.entries_in_weights = entries_in_weights

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
