"""The losses: one implementation each, fed by both the reuse and the recompute path.

Shapes: N rows of logits over a vocabulary of V; token ids are int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits (N, V), targets (N,) -> (N,) log p(target) under each row."""
    return logits.float().log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def cpt_loss(logits: torch.Tensor, token_ids: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    """Continual pre-training: mean next-token cross-entropy over a prompt.

    logits (T, V): the model's output at every prompt position; token_ids (T,). Row t
    predicts token t + 1, so T - 1 tokens are scored.
    """
    loss = F.cross_entropy(logits[:-1].float(), token_ids[1:])
    return loss, {"loss": loss.item(), "tokens": int(token_ids.numel() - 1)}


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO loss (Rafailov et al., 2023, eq. 7), as TRL's `sigmoid` loss type.

    Each argument is the summed log-probability of a response given the prompt: scalars
    (or (B,) for a batch). Reference values come from the base model (adapter disabled).
    """
    margin = (policy_chosen - reference_chosen) - (policy_rejected - reference_rejected)
    loss = -F.logsigmoid(beta * margin).mean()
    return loss, {"loss": loss.item(), "reward_margin": (beta * margin).mean().item(),
                  "accuracy": (margin > 0).float().mean().item()}
