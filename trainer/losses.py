"""The losses: one implementation each, fed by both the reuse and the recompute path.

Shapes: N rows of logits over a vocabulary of V; token ids are int64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """logits (N, V), targets (N,) -> (N,) log p(target) under each row, the logits divided
    by `temperature` first (GRPO's sampling distribution, as TRL's trainer takes it)."""
    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    return logits.log_softmax(-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def weighted_nll(logits: torch.Tensor, targets: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """logits (N, V), targets (N,), weights (N,) -> sum of weights · −log p(target): the
    token cross-entropy every loss is built from. Rows are independent, so it can be
    computed over row chunks and summed (trainer/forward.py, `head_backward`)."""
    return -(token_logprobs(logits, targets) * weights).sum()


def cpt_weights(num_tokens: int, device=None) -> torch.Tensor:
    """CPT's per-target weights: the mean over the T − 1 scored tokens of a T-token prompt."""
    return torch.full((num_tokens - 1,), 1.0 / max(num_tokens - 1, 1), device=device)


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
             reference_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Sigmoid DPO loss (Rafailov et al., 2023, eq. 7), as TRL's `sigmoid` loss type.

    Each argument is the summed log-probability of a response given the prompt: scalars
    (or (B,) for a batch). Reference values come from the base model (adapter disabled).
    Its figures are TRL's: the implicit rewards β·(policy − reference) of each response,
    their margin, and whether the chosen one's is the larger (`rewards/accuracies`).
    """
    chosen, rejected = beta * (policy_chosen - reference_chosen), beta * (policy_rejected - reference_rejected)
    loss = -F.logsigmoid(chosen - rejected).mean()
    return loss, {"loss": loss.item(), "reward_margin": (chosen - rejected).mean().item(),
                  "reward_chosen": chosen.mean().item(), "reward_rejected": rejected.mean().item(),
                  "accuracy": (chosen > rejected).float().mean().item()}


def group_advantages(rewards: torch.Tensor, eps: float = 1e-4) -> torch.Tensor:
    """GRPO's advantages (Shao et al., 2024, §4.1.2, outcome supervision): each sample's
    reward normalised by its group's mean and standard deviation (unbiased, as TRL's
    GRPOTrainer computes it). rewards (G,) -> (G,), in float64: rewards that differ only
    past float32's precision (0.1 + 0.2 and 0.3) or lie past its range (1e39) would give
    all-zero or NaN advantages; all equal -> all zero. Rewards so large that their squares
    would overflow float64 (1e300) are divided by the largest first: the advantages do not
    depend on the rewards' scale but through `eps`, nothing beside such a spread."""
    rewards = rewards.double()
    largest = rewards.abs().max()
    if largest > 1e150:
        rewards = rewards / largest
    return (rewards - rewards.mean()) / (rewards.std() + eps)


def grpo_token_loss(logps: torch.Tensor, served_logps: torch.Tensor, advantage: float, weight: float,
                    clip_eps: float = 0.2, reference_logps: torch.Tensor | None = None,
                    beta: float = 0.0) -> torch.Tensor:
    """GRPO's clipped surrogate (Shao et al., 2024, eq. 3) over tokens of one sample,
    summed with `weight` each (1 / (G · |o_i|): the mean over a sample's tokens, then over
    the group), negated to be minimised.

    logps (N,): log π_θ of the sampled tokens (with grad); served_logps (N,): log π_old,
    the values decoding computed under the adapter version that served them; advantage:
    the sample's group-normalised reward. With beta > 0, the KL to the reference (base)
    model, estimated per token as exp(ref − logp) − (ref − logp) − 1 (the paper's eq. 4)."""
    ratio = torch.exp(logps - served_logps)
    surrogate = torch.minimum(ratio * advantage, ratio.clamp(1 - clip_eps, 1 + clip_eps) * advantage)
    per_token = -surrogate
    if beta and reference_logps is not None:
        log_ratio = reference_logps - logps
        per_token = per_token + beta * (torch.exp(log_ratio) - log_ratio - 1)
    return (per_token * weight).sum()
