"""The activation cache's index (trainer/cache_index.py): what serving asks per request —
entries by state, label entries, room for a recording, how late a recording would train —
agrees with a scan of every entry through any sequence of the cache's transitions, and is
answered without scanning the entries waiting for labels."""

import gc
import random
import weakref
from collections import OrderedDict

from tests.test_stash import make_trainer
from tests.test_training import PROMPT, serve
from trainer.cache_index import lag_behind
from trainer.entries import TERMINAL, EntryState, PreferenceLabel

LIVE_STATES = [s for s in EntryState if s not in TERMINAL]


def scanned(cache, trained: int, serving: int, max_staleness: int, cohort_limit: int) -> dict:
    """The answers, from every entry."""
    entries = cache.entries()
    giving_way = [e for e in entries if e.recording is not None and e.state is not EntryState.TRAINING
                  and (cache.full_policy == "evict_oldest" or e.state is EntryState.WAITING_LABEL)]
    ready: dict[int, int] = {}
    for e in entries:
        usable = 0 <= trained - e.adapter_version <= max_staleness
        if e.recording is not None and e.state is EntryState.READY and usable:
            ready[e.adapter_version] = ready.get(e.adapter_version, 0) + 1
    running = [e for e in entries if e.state is EntryState.TRAINING]
    return {
        "counts": {s: sum(e.state is s for e in entries) for s in LIVE_STATES},
        "label_entries": sum(e.recording is None for e in entries),
        "giving_way": sum(e.nbytes for e in giving_way),
        "versions": {e.adapter_version for e in entries if e.recording is not None
                     and e.state is not EntryState.TRAINING},
        "lag": lag_behind(ready, running, trained, serving, max_staleness, cohort_limit),
    }


def indexed(cache, trained: int, serving: int, max_staleness: int, cohort_limit: int) -> dict:
    return {
        "counts": {s: cache.count(s) for s in LIVE_STATES},
        "label_entries": cache.label_entries,
        "giving_way": sum(e.nbytes for e in cache._giving_way()),
        "versions": cache.recorded_versions(),
        "lag": cache.lag_of_next_recording(trained, serving, max_staleness, cohort_limit),
    }


def scanned_take(entries, limit: int, version: int, max_staleness: int, cohort_limit: int) -> list[str]:
    """The ids `take_ready` should take, from every entry in admission order."""
    ready = [e for e in entries if e.state is EntryState.READY]
    usable = [e for e in ready if e.recording is not None and 0 <= version - e.adapter_version <= max_staleness]
    if usable:
        oldest = min(e.adapter_version for e in usable)
        ready, limit = [e for e in usable if e.adapter_version == oldest], cohort_limit
    return [e.completion_id for e in ready[:limit]]


def scanned_expiry(entries, now: float) -> set[str]:
    return {e.completion_id for e in entries if e.state is EntryState.WAITING_LABEL
            and e.label_deadline is not None and now > e.label_deadline}


def add_label_entry(cache, method, completion_id: str, version: int, rng) -> None:
    """An answer served without its activations, waiting for its label until a deadline."""
    cache.add(method.make_label_entry(completion_id, [3, 4, 5], version))
    cache.response_finished(completion_id, {0: [6, 7]}, aborted=rng.random() < 0.1,
                            label_deadline=cache.clock() + rng.uniform(0, 400))


def test_the_index_agrees_with_a_scan_through_every_transition():
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    cache, method = trainer.cache, trainer.method
    clock = [0.0]
    cache.clock = lambda: clock[0]
    rng = random.Random(0)
    for i in range(8):
        serve(trainer, f"r{i}", prompt=f"{PROMPT} ({i})")  # recorded, waiting for a label
    # room for about three recordings: later ones make room, or are kept without activations
    cache.budget_bytes = 3 * max(e.nbytes for e in cache.entries())
    cache.full_policy = "unlabelled_give_way"
    for i in range(20):
        add_label_entry(cache, method, f"l{i}", rng.randint(0, 2), rng)
    label = PreferenceLabel([5, 6], [7, 8])
    operations = ["label", "label", "take", "requeue", "end", "strip", "withdraw", "stale", "expire", "add",
                  "record"]
    for step in range(300):
        entries = cache.entries()
        operation = rng.choice(operations)
        entry = rng.choice(entries) if entries else None
        if operation == "label" and entry is not None:
            cache.attach_label(entry, label)
        elif operation == "take":
            question = (rng.randint(1, 3), rng.randint(0, 3), rng.randint(0, 2), rng.randint(1, 2))
            expected = scanned_take(entries, *question)
            assert [e.completion_id for e in cache.take_ready(*question)] == expected, step
        elif operation == "requeue" and entry is not None:
            cache.requeue(entry)
        elif operation == "end" and entry is not None and entry.state is EntryState.TRAINING:
            cache.end(entry, EntryState.TRAINED, version=1, path="reuse")
        elif operation == "strip" and entry is not None:
            cache.free_activations(entry)
        elif operation == "withdraw" and entry is not None:
            cache.withdraw(entry.completion_id)
        elif operation == "stale":
            cache.release_stale(rng.randint(0, 3), rng.randint(0, 1))
        elif operation == "expire":
            clock[0] += rng.uniform(0, 150)
            expected = scanned_expiry(entries, clock[0])
            assert {e.completion_id for e in cache.expire()} == expected, step
        elif operation == "add":
            add_label_entry(cache, method, f"n{step}", rng.randint(0, 3), rng)
        elif operation == "record":
            serve(trainer, f"s{step}", prompt=f"{PROMPT} [{step}]")
            cache.response_finished(f"s{step}", {0: [6, 7]}, aborted=False,
                                    label_deadline=clock[0] + rng.uniform(0, 400))
        question = (rng.randint(0, 3), rng.randint(0, 3), rng.randint(0, 2), rng.randint(1, 3))
        assert indexed(cache, *question) == scanned(cache, *question), (step, operation)
    assert cache.ended_counts["trained"] > 0 and cache.count(EntryState.TRAINING) + cache.count(EntryState.READY) > 0
    assert cache.ended_counts["expired"] > 0 and cache.released_bytes > 0


class _NoScans(OrderedDict):
    def values(self):
        raise AssertionError("scanned every entry")

    items = __iter__ = values


def test_serving_asks_without_scanning_the_entries_waiting_for_labels():
    """Thousands of answers waiting for labels (label entries) must not slow each admission."""
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=2, cohort_max_entries=2)
    serve(trainer, "recorded")
    for i in range(5000):
        trainer.cache.add(trainer.method.make_label_entry(f"l{i}", [3, 4, 5], 0))
    cache = trainer.cache
    cache._entries = _NoScans(cache._entries)
    assert cache.count(EntryState.WAITING_LABEL) == 5001 and cache.label_entries == 5000
    assert cache.has_room_for(1 << 20) and cache.lag_of_next_recording(0, 0, 1, 2) == 0
    trainer.has_work()  # the arbiter asks this between serving steps
    # and the trainer, at every slice and optimizer step
    assert cache.expire() == [] and cache.take_ready(4, 0, 1, 2) == []


def test_answers_expire_in_deadline_order_without_scanning_and_a_labelled_one_never():
    trainer = make_trainer(mode="dpo")
    cache, method = trainer.cache, trainer.method
    clock = [0.0]
    cache.clock = lambda: clock[0]
    for i, deadline in enumerate((30.0, 10.0, 20.0)):
        cache.add(method.make_label_entry(f"a{i}", [3, 4, 5], 0))
        cache.response_finished(f"a{i}", {0: [6]}, aborted=False, label_deadline=deadline)
    assert cache.attach_label(cache.get("a2"), PreferenceLabel([5, 6], [7, 8]))
    cache._entries = _NoScans(cache._entries)
    clock[0] = 25.0
    assert [e.completion_id for e in cache.expire()] == ["a1"]  # a2 was labelled before its deadline
    clock[0] = 31.0
    assert [e.completion_id for e in cache.expire()] == ["a0"]
    assert cache.count(EntryState.READY) == 1 and cache.ended_counts["expired"] == 2


def test_the_same_entry_added_twice_stays_as_it_was_and_an_ended_one_is_refused():
    trainer = make_trainer(mode="dpo", max_label_entries=1)  # a second label entry would be refused
    cache = trainer.cache
    entry = trainer.method.make_label_entry("once", [3, 4, 5], 0)
    assert cache.add(entry) and cache.add(entry)
    assert cache.get("once") is entry and entry.state is EntryState.WAITING_LABEL
    assert cache.count(EntryState.WAITING_LABEL) == 1 and cache.ended_counts["dropped"] == 0
    assert cache.withdraw("once") and not cache.add(entry)
    assert cache.get("once") is None and len(cache) == 0 and cache.label_entries == 0


def test_answers_ended_before_their_deadline_are_not_kept_by_it():
    """The deadlines hold ids, not entries: an answer labelled, trained or withdrawn long
    before its label timeout frees its tokens at once, and the heap stays bounded."""
    trainer = make_trainer(mode="dpo")
    cache, method = trainer.cache, trainer.method
    entries = []
    for i in range(3000):
        cache.add(method.make_label_entry(f"a{i}", [3, 4, 5] * 100, 0))
        cache.response_finished(f"a{i}", {0: [6]}, aborted=False, label_deadline=1e9)
        entries.append(weakref.ref(cache.get(f"a{i}")))
        assert cache.withdraw(f"a{i}")
    gc.collect()
    assert all(ref() is None for ref in entries)
    assert len(cache._index._deadlines) <= 1025
