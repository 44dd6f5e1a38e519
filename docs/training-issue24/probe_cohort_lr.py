"""Cohorts against strict recomputation on the tests' tiny Llama, per learning rate: a
made-up fact taught in bursts (tests/test_stash.burst_gain), four entries per AdamW update.
strict: max_staleness 0, steps of 4; steps_of_4: max_staleness 1, steps of 4 (the default
before cohorts); cohort: max_staleness 1, a burst in one step (the default).

    .venv/bin/python docs/training-issue24/probe_cohort_lr.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.test_stash import burst_gain, make_trainer  # noqa: E402

for lr in (1e-4, 3e-4, 1e-3, 3e-3):
    for bursts, burst in ((1, 12), (2, 8)):
        gains = {}
        for name, max_staleness, cohort in (("strict", 0, 4), ("steps_of_4", 1, 4), ("cohort", 1, 32)):
            trainer = make_trainer(max_staleness=max_staleness, learning_rate=lr, entries_per_step=4,
                                   cohort_max_entries=cohort)
            gains[name] = burst_gain(trainer, bursts, burst)
        print(f"lr {lr:g}, {bursts} burst(s) of {burst}: "
              + ", ".join(f"{n} {g:.2f} nats ({g / gains['strict']:.3f}x)" for n, g in gains.items()), flush=True)
