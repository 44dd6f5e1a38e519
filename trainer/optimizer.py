"""AdamW over the LoRA parameters, with clipping, non-finite skips and adapter versions.

Every optimizer step bumps the adapter version; a step whose loss or gradients are not
finite is skipped (gradients discarded, version unchanged) and counted.

AdamW runs its fused kernel (`fused=True`, as TRL's `adamw_torch_fused`) wherever torch has
one for the parameters' device: one kernel for every LoRA tensor instead of several ops per
tensor (one of them a host read), so the step that ends a job is a short slice for a request
to wait behind. Its updates are the plain implementation's (tests/test_optimizer.py).
"""

from __future__ import annotations

import copy
import math
from typing import Callable

import torch


# AdamW's settings that choose its implementation, not its arithmetic
_IMPLEMENTATION = ("fused", "foreach", "capturable")
# devices with a fused AdamW kernel in every torch the project supports (pyproject.toml)
_FUSED_DEVICES = ("cpu", "cuda")


def adamw(params: list[torch.nn.Parameter], learning_rate: float, fused: bool = True) -> torch.optim.AdamW:
    """AdamW without weight decay; fused where the parameters' device has the kernel
    (`fused=False`, or no kernel: torch's default implementation). Torch checks a fused
    AdamW's devices only at its first step, so they are checked here."""
    fused = fused and all(p.device.type in _FUSED_DEVICES and p.is_floating_point() for p in params)
    return torch.optim.AdamW(params, lr=learning_rate, weight_decay=0.0, **({"fused": True} if fused else {}))


class AdapterOptimizer:
    def __init__(self, params: list[torch.nn.Parameter], learning_rate: float, max_grad_norm: float,
                 fused: bool = True, given: Callable[[int], None] | None = None):
        """`given`: told of each version number before the weights take it (the adapter
        directory's VersionMark, in the process that saves versions)."""
        self.params = params
        self.optimizer = adamw(params, learning_rate, fused)
        self.max_grad_norm = max_grad_norm
        self._given = given
        self._version = 0
        # the entries these weights were trained on since version 0, every replica's
        # (restored with a saved version)
        self.entries_in_weights = 0
        self.skipped_steps = 0

    @property
    def version(self) -> int:
        """The adapter's version: bumped by every applied step, set by a restore or a rollback."""
        return self._version

    @version.setter
    def version(self, version: int) -> None:
        if self._given is not None and version != self._version:
            self._given(version)
        self._version = version

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
        # the fused kernel writes the parameters without moving their version counters, on
        # which the serving copies, the merged weights and a recording's stale check rely
        for param in self.params:  # (one at a time: a list is not taken by every supported torch)
            torch.autograd.graph.increment_version(param)
        self.zero_grad()
        self.version += 1
        self.entries_in_weights += entries
        return True

    def state_dict(self) -> dict:
        """A copy of AdamW's state (moments, step counts), independent of later steps."""
        return copy.deepcopy(self.optimizer.state_dict())

    def load_state_dict(self, state: dict, version: int, entries_in_weights: int = 0) -> None:
        """Restores AdamW's state and sets the version and the entries trained; the
        configured learning rate and implementation (fused or not) win over the saved ones.
        Torch places each saved step count by the implementation the state names (a fused
        kernel reads it on the parameters' device), so the state names the live one first."""
        learning_rates = [group["lr"] for group in self.optimizer.param_groups]
        implementation = {key: self.optimizer.defaults[key] for key in _IMPLEMENTATION}
        state = {**state, "param_groups": [{**group, **implementation} for group in state["param_groups"]]}
        self.optimizer.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, learning_rates):
            group["lr"] = lr
        self.zero_grad()
        self.version = version
        self.entries_in_weights = entries_in_weights

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
