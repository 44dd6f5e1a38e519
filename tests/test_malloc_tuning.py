"""Host allocator settings: freed memory kept for reuse, and given back to the OS on
demand (glibc; no-ops returning False elsewhere)."""

import platform

import pytest
import torch

from engine.malloc_tuning import keep_freed_memory, return_freed_memory
from trainer.entries import EntryState


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def clocked_trainer(monkeypatch, record_trims: bool = False):
    """(trainer, now, resident, trims): a DPO trainer (one entry per step) on a clock the
    test moves (`now[0]`), reading the resident memory the test sets (`resident[0]`);
    with `record_trims` its trims are recorded in `trims` (their times) rather than made."""
    from tests.test_stash import make_trainer
    now, resident, trims = [100.0], [1 << 30], []
    if record_trims:
        monkeypatch.setattr("trainer.maintenance.return_freed_memory", lambda: trims.append(now[0]) or True)
    monkeypatch.setattr("trainer.maintenance.resident_anonymous_bytes", lambda: resident[0])
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=1)
    trainer.cache.clock = lambda: now[0]
    return trainer, now, resident, trims


def test_return_freed_memory_gives_fragmented_pages_back_even_when_kept():
    if platform.libc_ver()[0] != "glibc":
        assert return_freed_memory() is False and keep_freed_memory() is False
        return
    assert keep_freed_memory() is True  # as the server runs: freed blocks stay in the heap
    # many mid-sized tensors (below the mmap threshold, so from the heap), every other
    # one kept: the freed ones are holes glibc does not return by itself
    tensors = [torch.ones(64 << 10) for _ in range(2000)]  # 2000 x 256 KiB = 500 MiB
    del tensors[::2]
    before = rss_bytes()
    assert return_freed_memory() is True
    assert before - rss_bytes() > 100 << 20


def test_heap_warmer_holds_pages_up_to_its_target_and_releases_them_before_a_recording():
    from engine.malloc_tuning import HeapWarmer, keep_freed_memory
    from tests.test_stash import make_trainer
    from tests.test_training import serve
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer = make_trainer()
    warmer = trainer.maintenance.warmer
    assert warmer is not None and warmer.target == 0 and not trainer.has_work()
    serve(trainer, "a")
    saved_sizes = trainer.cache.get("a").recording.saved_sizes
    assert warmer.target == sum(saved_sizes) > 0  # sized to the largest recording,
    assert warmer.piece_bytes == max(saved_sizes)  # in pieces of its largest tensor
    # the pages come before the job: under traffic an idle slice rarely finds no job waiting
    assert trainer.run_slice() and warmer.held_bytes > 0
    assert trainer.cache.get("a").state is EntryState.READY
    trainer.train_until_idle()
    assert warmer.held_bytes >= warmer.target and not warmer.wants_to_grow()
    assert trainer.status().warm_heap_bytes == warmer.held_bytes  # alchemist:warm_heap_bytes
    assert trainer.cache.get("a") is None or trainer.cache.get("a").state is not EntryState.READY
    serve(trainer, "b")  # the recording is admitted: the warm pages are freed for it
    assert warmer.held_bytes == 0
    assert not HeapWarmer(max_bytes=0).grow()  # nothing to hold


def faults_of_recordings_on_a_thread() -> tuple[list[int], int]:
    """Three recordings' worth of tensors written on a second thread onto a heap warmed for
    them (`HeapWarmer.fit`, as the recorder sizes it), the third after freed memory was
    given back to the OS (a quiet period): the page faults of each, and the pages each
    writes. The sizes are those of a 100-token recording of the embedded model
    (docs/training-issue24/warm_heap_pieces.py)."""
    import threading

    from engine.malloc_tuning import HeapWarmer, minor_page_faults
    sizes = (57600, 100, 57600, 12800, 12800, 200, 10000, 19200, 57600, 19200, 900, 57600,
             57600, 57600, 100, 57600, 153600, 153600, 153600, 153600)  # a recorded layer's, in floats
    layers = 30
    faults = []

    def recordings():
        warmer = HeapWarmer()
        warmer.fit([4 * size for _ in range(layers) for size in sizes])
        for index in range(3):
            if index == 2:  # a quiet period
                warmer.release()
                return_freed_memory()
            while warmer.grow():
                pass
            warmer.release()
            before = minor_page_faults()
            recording = [torch.empty(size).fill_(1.0) for _ in range(layers) for size in sizes]
            faults.append(minor_page_faults() - before)
            del recording

    keep_freed_memory()
    thread = threading.Thread(target=recordings)
    thread.start()
    thread.join()
    return faults, layers * sum(sizes) * 4 // 4096


def test_a_heap_warmed_on_the_device_thread_keeps_recordings_off_fresh_pages():
    """The device thread allocates from a glibc arena of its own: recordings there must land
    on the warmed pages, one after another and after a trim (in 16 MiB pieces a fifth and
    then half of them did not). In a fresh interpreter: a thread started here could be
    given the arena of one that an earlier test ended, with its history."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if not keep_freed_memory():
        pytest.skip("not glibc")
    code = ("import json; from tests.test_malloc_tuning import faults_of_recordings_on_a_thread as f; "
            "print(json.dumps(f()))")
    out = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], check=True,
                         capture_output=True, text=True).stdout
    faults, pages = json.loads(out.strip().splitlines()[-1])
    assert len(faults) == 3 and max(faults[:2]) < pages // 20 and faults[2] < pages // 10, (faults, pages)


def test_the_heap_is_warmed_again_between_the_slices_of_a_job():
    """Under a backlog the trainer goes from job to job: the pages for the next recording
    are faulted in between a job's slices, not in that recording's prefill."""
    from tests.test_stash import make_trainer
    from tests.test_training import serve
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer = make_trainer()
    warmer = trainer.maintenance.warmer
    serve(trainer, "a")
    while not trainer.trainer.in_job():
        assert trainer.run_slice()
    serve(trainer, "b")  # recorded while a's job is in progress: the warm pages went to it
    assert warmer.held_bytes == 0 and warmer.wants_to_grow()
    assert trainer.run_slice() and trainer.trainer.in_job()
    assert warmer.held_bytes > 0  # the job waited for one slice of warming
    while warmer.wants_to_grow():
        assert trainer.run_slice() and trainer.trainer.in_job()
    trainer.train_until_idle()
    assert all(trainer.cache.get(rid) is None or trainer.cache.get(rid).state is not EntryState.READY
               for rid in ("a", "b"))


def test_pages_warmed_while_an_admitted_recording_waits_go_to_it():
    """A recording admitted but not yet scheduled (its KV blocks not free) lets the heap be
    warmed again between serving steps; those pages are freed for it when it runs."""
    from tests.conftest import encode
    from tests.test_stash import make_trainer
    from tests.test_training import serve
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer = make_trainer()
    warmer, recorder, prompt = trainer.maintenance.warmer, trainer.recorder, encode("Hello there")
    serve(trainer, "a")  # sets the warm heap's target
    spec = recorder.admit("b", prompt)
    assert spec is not None
    assert trainer.maintenance.warm_heap() and warmer.held_bytes > 0  # warmed while it waits
    assert recorder.confirm("b", prompt, spec) is spec and warmer.held_bytes == 0


def test_a_pause_s_trim_gives_memory_back_then_warms_the_heap_again_until_the_server_is_idle(monkeypatch):
    """A pause in recording after which the process holds more than its slack beyond
    what it started with (a burst's recordings, trained and freed): the trim releases the
    warm heap and gives freed memory back; then the heap is warmed again, so that the
    recording that ends the pause lands on warm pages (a trim's freed chunks fault again,
    BENCHMARKS.md, "A pause measured against the traffic's gaps"). An idle server gives it all back
    and warms nothing for a recording that has not come."""
    from tests.test_training import label, serve
    from trainer.maintenance import IDLE_TRIM_S, TRIM_QUIET_S
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer, now, resident, _ = clocked_trainer(monkeypatch)
    warmer = trainer.maintenance.warmer
    held_at_trims = []
    monkeypatch.setattr("trainer.maintenance.return_freed_memory", lambda: held_at_trims.append(warmer.held_bytes))
    serve(trainer, "a")
    label(trainer, "a")
    trainer.train_until_idle()
    assert warmer.held_bytes >= warmer.target > 0  # warm while prefills are being recorded
    now[0] += TRIM_QUIET_S  # no recording since: a pause
    resident[0] += 2 * trainer.maintenance.trim_slack_bytes + warmer.held_bytes
    assert trainer.has_work()
    trainer.train_until_idle()
    assert held_at_trims == [0]  # the warm heap went back with the freed memory
    assert warmer.held_bytes >= warmer.target and not trainer.has_work()  # and was warmed again
    warmer.target *= 4  # a larger recording seen: through a pause the heap is warmed only as much as the slack
    assert trainer.maintenance.warming_due()
    trainer.maintenance.trim_slack_bytes = warmer.held_bytes
    assert warmer.wants_to_grow() and not trainer.maintenance.warming_due()
    warmer.target //= 4
    now[0] += IDLE_TRIM_S  # the server has gone idle
    trainer.train_until_idle()
    assert held_at_trims == [0, 0] and warmer.held_bytes == 0 and not trainer.has_work()
    serve(trainer, "b")
    assert trainer.has_work() and warmer.wants_to_grow()


def test_jobs_that_end_while_recording_is_paused_give_their_memory_back(monkeypatch):
    """A drain trains the last labels after the traffic: the jobs free their own buffers,
    given back once they exceed a pause's slack, or once the server has gone idle."""
    from tests.test_training import label, serve
    from trainer.maintenance import IDLE_TRIM_S, TRIM_QUIET_S
    trainer, now, resident, trims = clocked_trainer(monkeypatch, record_trims=True)
    slack = trainer.maintenance.trim_slack_bytes
    serve(trainer, "a")
    serve(trainer, "b", prompt="Another question entirely")
    serve(trainer, "c", prompt="A third question")
    label(trainer, "a")
    trainer.train_until_idle()
    assert trims == []  # recorded a moment ago: freed memory is kept for the next recording
    resident[0] += 2 * slack  # the recordings' memory, freed
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()
    assert len(trims) == 1
    label(trainer, "b")  # a label that comes after the traffic
    trainer.train_until_idle()
    assert len(trims) == 1  # not after every job: at most one trim per quiet period
    now[0] += TRIM_QUIET_S
    resident[0] += slack // 2  # what the job left in the heap
    trainer.run_slice()  # an idle poll
    assert len(trims) == 1 and not trainer.has_work()  # within a pause's slack: kept for the next recording
    resident[0] += slack
    trainer.run_slice()
    assert len(trims) == 2
    trainer.train_until_idle()  # the heap warmed again for the recording that ends the pause
    assert len(trims) == 2 and not trainer.has_work()
    label(trainer, "c")
    trainer.train_until_idle()
    now[0] += IDLE_TRIM_S
    trainer.run_slice()  # the server has gone idle: whatever the jobs freed goes back
    assert len(trims) == 3 and not trainer.has_work()


def test_a_pause_in_traffic_keeps_the_warm_heap_and_what_the_heap_holds_within_its_slack(monkeypatch):
    """Recordings on the host: a pause that frees less than the slack keeps the heap as it
    is, warm heap included, so that the recording after it lands on warm pages (a trim
    makes it fault whatever the warm heap holds: BENCHMARKS.md, "A pause in traffic");
    the server gone idle gives the warm heap and the freed memory back."""
    from tests.test_training import label, serve
    from trainer.maintenance import IDLE_TRIM_S, TRIM_QUIET_S
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer, now, resident, _ = clocked_trainer(monkeypatch)
    warmer = trainer.maintenance.warmer
    serve(trainer, "a")
    label(trainer, "a")
    resident[0] += 2 * trainer.maintenance.trim_slack_bytes  # a burst's memory, freed
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()  # the first pause: a trim, and what the process holds after it
    trims = trainer.stats.memory_trims
    assert trims == 1
    serve(trainer, "b")
    label(trainer, "b")
    trainer.train_until_idle()
    assert warmer.held_bytes >= warmer.target > 0
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()
    assert trainer.stats.memory_trims == trims and warmer.held_bytes >= warmer.target  # kept through the pause
    now[0] += IDLE_TRIM_S
    trainer.train_until_idle()
    assert trainer.stats.memory_trims == trims + 1 and warmer.held_bytes == 0
    assert not trainer.has_work()


def test_page_faults_count_memory_written_for_the_first_time():
    import torch

    from engine.malloc_tuning import minor_page_faults

    before = minor_page_faults()
    torch.ones(16 << 20)  # 64 MiB, above glibc's mmap threshold: mapped fresh, then written
    assert minor_page_faults() - before >= 16  # 4 KiB pages, or 2 MiB ones where huge pages are on


def test_what_the_server_holds_before_its_first_recording_is_no_pause_s_to_give_back(monkeypatch):
    """Memory the server takes between its start and its first recording (the engine, the
    first forwards) is not freed memory: the slack counts from what it holds then."""
    from tests.test_training import label, serve
    from trainer.maintenance import TRIM_QUIET_S
    if not keep_freed_memory():
        pytest.skip("not glibc")
    trainer, now, resident, _ = clocked_trainer(monkeypatch)
    resident[0] += 4 * trainer.maintenance.trim_slack_bytes  # start-up, after the trainer was built
    trainer.train_until_idle()  # idle polls before any recording
    serve(trainer, "a")
    label(trainer, "a")
    trainer.train_until_idle()
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()
    assert trainer.stats.memory_trims == 0


def test_with_no_slack_every_pause_gives_memory_and_the_warm_heap_back(monkeypatch):
    """`train.trim_slack_mib = 0`: the behaviour before the slack (`bench colocate --compare trim`'s baseline)."""
    from tests.test_stash import make_trainer
    from tests.test_training import label, serve
    from trainer.maintenance import TRIM_QUIET_S
    if not keep_freed_memory():
        pytest.skip("not glibc")
    now = [100.0]
    monkeypatch.setattr("trainer.maintenance.resident_anonymous_bytes", lambda: 1 << 30)  # nothing grows
    trainer = make_trainer(mode="dpo", max_staleness=1, entries_per_step=1)
    trainer.maintenance.trim_slack_bytes = 0
    trainer.cache.clock = lambda: now[0]
    warmer = trainer.maintenance.warmer
    for request_id in "ab":
        serve(trainer, request_id, prompt=f"A question ({request_id})")
        label(trainer, request_id)
        trainer.train_until_idle()
        assert warmer.held_bytes > 0
        trims = trainer.stats.memory_trims
        now[0] += TRIM_QUIET_S
        trainer.train_until_idle()
        assert trainer.stats.memory_trims == trims + 1 and warmer.held_bytes == 0


def test_memory_is_given_back_as_soon_as_the_cache_has_drained(monkeypatch):
    """A drain's last job frees its memory after the pause's trim: it goes back as soon
    as the cache is empty, not a quiet period after that trim (`bench soak` read RSS 3 s
    after the drain)."""
    from tests.test_training import label, serve
    from trainer.maintenance import TRIM_QUIET_S
    trainer, now, resident, trims = clocked_trainer(monkeypatch, record_trims=True)
    slack = trainer.maintenance.trim_slack_bytes
    serve(trainer, "a")
    serve(trainer, "b", prompt="Another question entirely")
    label(trainer, "a")
    trainer.train_until_idle()
    resident[0] += 2 * slack
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()
    assert len(trims) == 1 and len(trainer.cache) == 1
    label(trainer, "b")  # the drain's last label
    now[0] += 1.0
    resident[0] += 2 * slack  # what its job and its recording freed
    trainer.train_until_idle()
    assert len(trainer.cache) == 0 and trims == [now[0] - 1.0, now[0]]


def test_a_pause_is_longer_than_the_traffic_s_own_gaps(monkeypatch):
    """Requests every 4 s: a 10 s gap (one in twelve at 0.25 requests per second) is not a
    pause, whose trim would make the next recording fault; five mean gaps are."""
    from tests.test_training import label, serve
    from trainer.maintenance import IDLE_TRIM_S, PAUSE_GAPS, TRIM_QUIET_S
    trainer, now, resident, trims = clocked_trainer(monkeypatch, record_trims=True)
    for i in range(4):
        serve(trainer, f"r{i}", prompt=f"Question number {i}")
        label(trainer, f"r{i}")
        trainer.train_until_idle()
        now[0] += 4.0
    now[0] -= 4.0
    assert trainer.maintenance.pause_seconds() == PAUSE_GAPS * 4.0 > TRIM_QUIET_S
    resident[0] += 2 * trainer.maintenance.trim_slack_bytes  # the jobs' memory, freed
    now[0] += TRIM_QUIET_S
    trainer.train_until_idle()
    assert trims == []
    now[0] += PAUSE_GAPS * 4.0 - TRIM_QUIET_S
    trainer.train_until_idle()
    assert trims == [now[0]]
    now[0] += IDLE_TRIM_S  # the server went idle: that gap is not the traffic's
    serve(trainer, "after-idle", prompt="A question after a while")
    assert trainer.maintenance.pause_seconds() == PAUSE_GAPS * 4.0
    trainer.maintenance.trim_slack_bytes = 0  # no slack: every 10 s pause trims, as before it
    assert trainer.maintenance.pause_seconds() == TRIM_QUIET_S
