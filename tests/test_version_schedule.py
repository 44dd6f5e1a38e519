"""Version-aware scheduling: entries recorded under one adapter version share an optimizer
step (up to `cohort_max_entries`), the oldest version still trainable on its recording goes
first, entries that train by recomputation wait for the recordings and share a step up to
`entries_per_step`, and a step over k entries moves the adapter as k steps of one would
(the learning rate scales with k; one AdamW update per `entries_per_step` entries)."""

import torch

from tests.test_stash import OTHERS, hold, make_trainer
from tests.test_training import PROMPT, label, serve
from trainer.optimizer import AdapterOptimizer


def test_entries_of_one_version_share_one_step_and_all_train_on_their_recordings():
    trainer = make_trainer(max_staleness=1, entries_per_step=4)
    for request_id in ("a", "b", "c"):  # a burst, all recorded under version 0
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 3}
    assert trainer.stats.staleness == {0: 3}


def test_a_backlog_of_one_versions_recordings_trains_in_one_step_on_them():
    """Labels faster than training: six entries recorded under version 0 with two per
    AdamW update. Steps of two would leave four of them stale (one version of delay
    allowed: two stashed, two recomputed); a cohort's step (up to cohort_max_entries)
    keeps every one on its recording and is applied as three AdamW updates."""
    trainer = make_trainer(max_staleness=1, entries_per_step=2, cohort_max_entries=32)
    updates = []
    step = trainer.optimizer.step
    trainer.optimizer.step = lambda **kw: updates.append(kw["updates"]) or step(**kw)
    for request_id in "abcdef":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1 and updates == [3]
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 6}


def test_cohort_max_entries_is_a_maximum():
    trainer = make_trainer(max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    for request_id in ("a", "b", "c"):
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
    trainer.train_until_idle()
    # a and b in one step (version 0), then c, one version stale, on its recording
    assert trainer.optimizer.version == 2
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 2, ("cpt", "stashed"): 1}


def test_entries_trained_by_recomputation_share_a_step_up_to_entries_per_step():
    trainer = make_trainer(mode="dpo", entries_per_step=2, record_fraction=0.0)  # label entries only
    for request_id in "abc":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
        label(trainer, request_id)
    trainer.train_until_idle()
    assert trainer.optimizer.version == 2  # a and b, then c: they do not go stale, smaller steps learn more
    assert trainer.stats.trained_entries == {("dpo", "recompute"): 3}


def test_the_oldest_trainable_version_goes_first():
    """v0's recording is one version stale, v1's current: training v1's first would push
    v0's past max_staleness=1, to recomputation."""
    trainer = make_trainer(max_staleness=1, entries_per_step=4)
    serve(trainer, "old")
    hold(trainer, "old")
    serve(trainer, "step", prompt=OTHERS[0])
    trainer.train_until_idle()  # version 1
    serve(trainer, "new", prompt=OTHERS[1])
    hold(trainer, "new")
    for request_id in ("new", "old"):  # "new" is first in line
        trainer.cache.attach_label(trainer.cache.get(request_id), None)
    taken = trainer.cache.take_ready(4, trainer.optimizer.version, 1)
    assert [e.completion_id for e in taken] == ["old"]
    trainer.cache.requeue(taken[0])
    trainer.train_until_idle()  # "old" (stashed) first; "new" joins its step, on its recording
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 2, ("cpt", "stashed"): 1}
    assert trainer.stats.stale_entries == 0 and trainer.optimizer.version == 2


def test_entries_without_a_usable_recording_wait_for_the_recorded_ones():
    trainer = make_trainer(max_staleness=0, entries_per_step=1)
    serve(trainer, "stale")
    hold(trainer, "stale")
    serve(trainer, "step", prompt=OTHERS[0])
    trainer.train_until_idle()  # version 1: "stale" lost its recording
    assert trainer.cache.get("stale").recording is None
    trainer.cache.attach_label(trainer.cache.get("stale"), None)
    serve(trainer, "fresh", prompt=OTHERS[1])
    trainer.train_until_idle()
    # oldest first would have trained "stale" first and made "fresh" stale too
    assert trainer.stats.trained_entries == {("cpt", "reuse"): 2, ("cpt", "recompute"): 1}


def test_a_step_over_k_entries_scales_the_learning_rate_by_k():
    def moved(entries: int, lr: float) -> torch.Tensor:
        param = torch.nn.Parameter(torch.ones(4))
        optimizer = AdapterOptimizer([param], learning_rate=lr, max_grad_norm=1e9)
        param.grad = torch.tensor([1.0, -2.0, 0.5, 3.0])
        assert optimizer.step(entries=entries)
        assert optimizer.optimizer.param_groups[0]["lr"] == lr  # restored after the step
        assert optimizer.version == 1
        return param.detach() - 1.0

    assert torch.allclose(moved(3, 1e-3), moved(1, 3e-3))
    assert not torch.allclose(moved(3, 1e-3), moved(1, 1e-3))

    def after_an_earlier_step(lr: float, steps: list[tuple[int, int]]) -> torch.Tensor:
        """AdamW with momentum from an earlier, different gradient, then `steps` of
        (entries, updates) on this gradient."""
        param = torch.nn.Parameter(torch.ones(4))
        optimizer = AdapterOptimizer([param], learning_rate=lr, max_grad_norm=1e9)
        param.grad = torch.tensor([-1.0, 1.0, 1.0, -2.0])
        optimizer.step()
        start = param.detach().clone()
        for entries, updates in steps:
            param.grad = torch.tensor([1.0, -2.0, 0.5, 3.0])
            optimizer.step(entries=entries, updates=updates)
        return param.detach() - start

    # six entries as two updates move the adapter as two steps of three would; one update
    # at six times the rate mostly repeats the earlier momentum
    two_updates = after_an_earlier_step(1e-3, [(6, 2)])
    assert torch.allclose(two_updates, after_an_earlier_step(1e-3, [(3, 1), (3, 1)]))
    assert not torch.allclose(two_updates, after_an_earlier_step(1e-3, [(6, 1)]), rtol=0.05)


def test_an_entry_labelled_while_a_job_runs_joins_it_before_the_step():
    trainer = make_trainer(mode="dpo", max_staleness=0, entries_per_step=4)
    serve(trainer, "a")
    serve(trainer, "b", prompt=OTHERS[0])
    label(trainer, "a")
    assert trainer.run_slice()  # the job on "a" starts
    label(trainer, "b")  # b's label arrives meanwhile
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1  # one step for both: b did not go stale waiting
    assert trainer.stats.trained_entries == {("dpo", "reuse"): 2}


def test_freed_memory_is_given_back_only_once_recording_has_paused(monkeypatch):
    """Trimming after every job made the next recording pay first-touch page faults (and
    so does a trim in a pause, unless the process holds more than its slack)."""
    clock, resident = [1000.0], [1 << 30]
    monkeypatch.setattr("trainer.maintenance.resident_anonymous_bytes", lambda: resident[0])
    trainer = make_trainer(max_staleness=1, entries_per_step=1)
    trainer.cache.clock = lambda: clock[0]
    trims = []
    monkeypatch.setattr("trainer.maintenance.return_freed_memory", lambda: trims.append(clock[0]) or True)
    serve(trainer, "a")
    trainer.train_until_idle()
    resident[0] += 2 * trainer.maintenance.trim_slack_bytes
    assert trims == []  # recorded a moment ago
    clock[0] += 11.0
    trainer.run_slice()
    assert trims == [clock[0]]


def test_a_prefill_that_would_go_stale_behind_the_backlog_is_not_recorded():
    """Two steps of two labelled recordings are ahead, one version of delay allowed: a
    fifth request would train two versions late and be recomputed whatever it recorded,
    so its prefill is served unrecorded and its label trains by recomputation."""
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    for request_id in "abcde":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
        label(trainer, request_id)
    assert trainer.cache.get("d").recording is not None and trainer.cache.get("e").recording is None
    assert trainer.stats.recorded == 4 and trainer.stats.not_recorded == 1
    trainer.train_until_idle()
    assert trainer.stats.trained_entries == {("dpo", "reuse"): 2, ("dpo", "stashed"): 2, ("dpo", "recompute"): 1}


def test_cpt_records_behind_any_backlog():
    """CPT has no label entry to fall back on: an unrecorded prefill would not train."""
    trainer = make_trainer(max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    for request_id in "abcde":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
    assert trainer.stats.recorded == 5


def test_a_backlog_of_an_older_version_counts_only_the_steps_its_window_leaves():
    """Four labelled recordings of version 0 wait at version 1 (one version of delay
    allowed, steps of two): one step trains two of them, the other two go stale and wait
    behind every usable recording. A request served now trains a step later, one version
    stale, on its recording: it is recorded."""
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    for request_id in "abcdef":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
        label(trainer, request_id)
    while trainer.optimizer.version == 0:
        trainer.run_slice()
    serve(trainer, "g", prompt=f"{PROMPT} (g)")
    assert trainer.cache.get("g").recording is not None
    label(trainer, "g")
    trainer.train_until_idle()
    assert trainer.stats.trained_entries == {("dpo", "reuse"): 2, ("dpo", "stashed"): 3, ("dpo", "recompute"): 2}


def test_with_stale_recordings_dropped_every_prefill_is_still_recorded():
    """`stale_policy = "drop"` drops a stale recording's entry where a label entry would be
    recomputed: the rule would change what trains, so it does not apply."""
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=2, cohort_max_entries=2, stale_policy="drop")
    for request_id in "abcde":
        serve(trainer, request_id, prompt=f"{PROMPT} ({request_id})")
        label(trainer, request_id)
    assert trainer.stats.recorded == 5
