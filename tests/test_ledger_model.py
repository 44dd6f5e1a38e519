"""The feedback ledger against a reference model of its lineage rules, on random sequences
of serving, labels, steps, saves, rollbacks (saved, failing, killed), the gate's
rejections, deletions, releases and restarts (tests/ledger_model.py). The seeds are fixed:
the same sequences every run."""

import random
import shutil

import pytest

from tests.ledger_model import COVER, MIXES, generate, shrink

SEEDS = 150


@pytest.mark.parametrize("mix", MIXES)
def test_every_labels_fate_follows_the_weights_that_hold_it(tmp_path, mix):
    for seed in range(SEEDS):
        rng = random.Random(seed)
        root = tmp_path / str(seed)
        root.mkdir()
        ops, failure, _ = generate(rng, rng.randint(10, 40), root, mix=mix)
        shutil.rmtree(root, ignore_errors=True)
        if failure is not None:
            pytest.fail(f"seed {seed} ({mix}): {failure}; shrunk: {shrink(ops, failure.kind)}")


def test_the_random_sequences_reach_the_rules_that_matter(tmp_path):
    """The sequences exercise what the defects were found in (a test that never reaches
    them could not fail)."""
    COVER.clear()
    for seed in range(60):
        rng = random.Random(seed)
        root = tmp_path / str(seed)
        root.mkdir()
        generate(rng, rng.randint(10, 40), root, mix="unsaved")
    reached = set(COVER)
    for rule in ("restart re-applies carried rollback", "resume: given back by a lost rollback -> quarantined",
                 "copy: dropped(deleted) held again -> trained", "reapply older"):
        assert rule in reached, sorted(reached)
