"""What the replicas' rounds carry (trainer/replicated.py): a replica's contribution to
the next round, and the results every replica applies, in the same order, between jobs."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass

import torch

from trainer.adapter_store import AdapterSnapshot


@dataclass
class Contribution:
    """A finished job's gradients, flattened in the parameters' order."""

    grads: torch.Tensor
    entries: int
    finite: bool
    # (CUDA) recorded on the device thread's stream once `grads` is written
    ready: object = None
    # the rollbacks this replica had applied when its job ran (`ReplicaSync.rollbacks_applied`)
    rollbacks: int = 0


@dataclass
class CombinedStep:
    """A round's optimizer step: every replica's gradients summed."""

    grads: torch.Tensor
    entries: int
    # every replica's loss was finite
    finite: bool
    # this replica's waiting job is in it
    mine: bool
    # (CUDA) recorded on the rounds' stream once `grads` holds the sum
    done: object = None


@dataclass
class ReplicatedRollback:
    """A saved version every replica loads at the same point of the sequence."""

    snapshot: AdapterSnapshot
    # rank 0's caller waits for the new version number
    done: concurrent.futures.Future | None = None


class RollbackSuperseded(RuntimeError):
    """A later rollback asked before this one reached the replicas: it is the one applied."""


@dataclass
class ReplicatedVerdict:
    """Rank 0's eval gate verdict on the candidate every replica holds (trainer/eval_gate.py):
    its scores, why it failed (empty: promoted), and whether it was a baseline scoring."""

    scores: object
    failures: tuple[str, ...]
    baseline: bool


@dataclass(frozen=True)
class LeftOut:
    """This replica's contribution came to a round after a rollback it was not computed
    under (its job ran on the weights the rollback replaced): it is left out of the sum,
    and its job's entries train again, as one server abandons a job a rollback interrupts."""

    entries: int
