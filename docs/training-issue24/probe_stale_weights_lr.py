"""Stale recordings trained with their version's LoRA weights ("stashed") or today's
("live") against strict recomputation and cohorts, per learning rate, on the tests' tiny
Llama: a made-up fact taught in bursts (tests/test_stash.burst_gain), four entries per
AdamW update. strict: max_staleness 0, steps of 4; cohort: max_staleness 1, a burst in
one step; stashed_8 / live_8: max_staleness 8, steps of 4, stale weights stashed / live.

    .venv/bin/python docs/training-issue24/probe_stale_weights_lr.py
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.test_stash import burst_gain, make_trainer  # noqa: E402

CONDITIONS = (("strict", dict(max_staleness=0, cohort_max_entries=4)),
              ("cohort", dict(max_staleness=1, cohort_max_entries=32)),
              ("stashed_8", dict(max_staleness=8, cohort_max_entries=4, stale_weights="stashed")),
              ("live_8", dict(max_staleness=8, cohort_max_entries=4, stale_weights="live")))

for lr in (1e-4, 3e-4, 1e-3, 3e-3):
    for bursts, burst in ((1, 12), (2, 8)):
        gains = {}
        for name, options in CONDITIONS:
            trainer = make_trainer(learning_rate=lr, entries_per_step=4, **options)
            gains[name] = burst_gain(trainer, bursts, burst)
        print(f"lr {lr:g}, {bursts} burst(s) of {burst}: "
              + ", ".join(f"{n} {g:.2f} nats ({g / gains['strict']:.3f}x)" for n, g in gains.items()), flush=True)
