"""The losses on tiny tensors against values computed by hand (as torchtune's
test_dpo_loss.py): weighted cross-entropy for CPT, the sigmoid DPO loss, and their gradients."""

import math

import pytest
import torch

from trainer.losses import cpt_weights, dpo_loss, token_logprobs, weighted_nll


def test_token_logprobs_are_log_softmax_at_the_target():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [math.log(3.0), 0.0, 0.0, 0.0]])
    # row 0: uniform over 4 -> log(1/4); row 1: e^log3 / (3 + 3) = 1/2 for token 0
    values = token_logprobs(logits, torch.tensor([2, 0]))
    assert values.tolist() == pytest.approx([math.log(1 / 4), math.log(1 / 2)], abs=1e-6)


def test_cpt_loss_is_the_mean_next_token_cross_entropy():
    logits = torch.tensor([[0.0, 0.0, 0.0], [math.log(2.0), 0.0, 0.0], [1.0, 2.0, 3.0]], requires_grad=True)
    tokens = torch.tensor([0, 1, 0])
    # row 0 predicts token 1: p = 1/3; row 1 predicts token 0: p = 2/4; the last row predicts nothing
    weights = cpt_weights(len(tokens))
    assert weights.tolist() == [0.5, 0.5]
    loss = weighted_nll(logits[:-1], tokens[1:], weights)
    expected = -(math.log(1 / 3) + math.log(1 / 2)) / 2
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    loss.backward()
    # d(mean CE)/d logits = (softmax - onehot) / 2 on scored rows, 0 on the last
    assert logits.grad[0].tolist() == pytest.approx([1 / 6, -1 / 3, 1 / 6], abs=1e-6)
    assert logits.grad[1].tolist() == pytest.approx([-1 / 4, 1 / 8, 1 / 8], abs=1e-6)
    assert logits.grad[2].tolist() == [0.0, 0.0, 0.0]


def test_dpo_loss_matches_the_sigmoid_formula():
    policy_chosen = torch.tensor(-1.0, requires_grad=True)
    policy_rejected = torch.tensor(-3.0, requires_grad=True)
    reference_chosen, reference_rejected, beta = torch.tensor(-2.0), torch.tensor(-2.5), 0.1
    # margin = (-1 + 2) - (-3 + 2.5) = 1.5; loss = -log sigmoid(0.15) = log(1 + e^-0.15)
    loss, metrics = dpo_loss(policy_chosen, policy_rejected, reference_chosen, reference_rejected, beta)
    expected = math.log(1 + math.exp(-0.15))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert metrics["reward_margin"] == pytest.approx(0.15, abs=1e-6) and metrics["accuracy"] == 1.0
    loss.backward()
    # dL/d policy_chosen = -beta * sigmoid(-beta * margin); the rejected side has the opposite sign
    slope = beta / (1 + math.exp(0.15))
    assert policy_chosen.grad.item() == pytest.approx(-slope, abs=1e-7)
    assert policy_rejected.grad.item() == pytest.approx(slope, abs=1e-7)


def test_dpo_loss_at_zero_margin_is_log_two_and_averages_a_batch():
    zero = torch.zeros(3)
    loss, metrics = dpo_loss(zero, zero, zero, zero, beta=0.5)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6) and metrics["accuracy"] == 0.0
    batch, _ = dpo_loss(torch.tensor([1.0, -1.0]), torch.zeros(2), torch.zeros(2), torch.zeros(2), beta=1.0)
    assert batch.item() == pytest.approx((math.log(1 + math.exp(-1)) + math.log(1 + math.exp(1))) / 2, abs=1e-6)
