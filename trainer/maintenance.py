"""The device's housekeeping around training jobs: label expiry, merged serving weights,
returning freed memory, and warming the heap for the next recording.

The arbiter (trainer/arbiter.py) triggers all of it, on the device thread:
  - in a gap, the item it runs (`OnlineTraining.run_slice`) first calls `expire()`, and
    between jobs `run_item()`: one bounded piece of the work that makes serving faster or
    the next recording cheaper, before the next job starts; during a job, `warm_heap()`,
    the part of it that cannot wait for the job's end;
  - after serving steps, `expire()` once `expiry_due()` — label timeouts come due under
    steady traffic too, when no gap comes — `rebuild_merged(budget_s)` while merged
    weights are stale, and then `warm_heap(budget_s)` while recordings come faster than
    idle gaps (and through a pause, as much as the trim slack).
The adapter's lifecycle marks merged weights stale when the adapter changes
(`invalidate_merged`) and rebuilds them all at a resume (`merge_all`). Both count a new
generation of the weights serving runs with (`serving_generation`): the engine's prefix
cache forgets the K/V computed under the last one. (While the eval gate pins serving,
serving changes only when it releases the pin, in the same device item as one of them.)
"""

from __future__ import annotations

import time

from engine.malloc_tuning import HeapWarmer, resident_anonymous_bytes, return_freed_memory
from trainer.adapter import merge_all, merge_stale
from trainer.serving_copy import SharedInputGroup, refresh_serving_copies
from trainer.cache import ActivationCache
from trainer.status import TrainingStats

# an idle item returns freed memory to the OS (and the warm heap) once no prefill has been
# recorded for a pause (`TRIM_QUIET_S`, or `Maintenance.pause_seconds`), and again, at most
# as often, while jobs free more: a server without traffic should hold only what it started
# with (`alchemist bench soak`, memory after the drain). But a recording into pages just
# given back pays first-touch page faults, whatever warm heap was held through the trim
# (BENCHMARKS.md, "A pause in traffic"), so where recordings are host memory a pause shorter
# than `IDLE_TRIM_S` gives memory back only when the process holds more than its slack
# (`train.trim_slack_mib`) beyond what it held after the last trim (or before its first
# recording), outside live recordings and the warm heap: after a drain, not between two
# requests. After such a trim the warm heap is grown again, as much as the slack: the
# recording that ends the pause lands on warm pages (BENCHMARKS.md, "A pause measured
# against the traffic's gaps, and the heap warmed again after a trim")
TRIM_QUIET_S = 10.0
IDLE_TRIM_S = 300.0
# where a slack is kept, a pause is also longer than the traffic's own gaps: this many
# times the mean gap between the latest recordings (trainer/cache.py keeps their times; at
# most `PAUSE_MAX_S`; gaps where the server went idle left out), which a Poisson trace's gaps
# exceed once in e**5: a 10 s gap at 0.25 requests per second is not a pause. Bursts of
# more than `PAUSE_GAPS` requests each make the mean gap shorter than the pauses between
# them, which then trim as a fixed 10 s pause would
PAUSE_GAPS = 5.0
PAUSE_MAX_S = 60.0
# how often serving steps check label timeouts
EXPIRY_EVERY_S = 0.5
# how long an idle item may rebuild merged weights (about one training slice)
MERGE_ITEM_S = 0.01


class Maintenance:
    def __init__(self, cache: ActivationCache, peft_model, merged_serving: bool, stats: TrainingStats,
                 warmer: HeapWarmer | None = None, serving_copies: list[SharedInputGroup] = (),
                 trim_slack_bytes: int = 256 << 20):
        """`merged_serving`: serving runs on LoRA merged into the base weights, rebuilt
        after every change of the adapter; `warmer`: pre-faulted heap for the next
        recording (engine.malloc_tuning.HeapWarmer), None where it does not help;
        `serving_copies`: the adapter's serving copy, refreshed at every change at once;
        `trim_slack_bytes`: freed memory a pause in recording keeps (`pause_seconds`)."""
        self.cache = cache
        self.peft_model = peft_model
        self.merged_serving = merged_serving
        self.serving_copies = list(serving_copies)
        self.stats = stats
        self.warmer = warmer
        self.trim_slack_bytes = trim_slack_bytes
        self._merge_pending = False
        # a new number each time the weights serving runs with may have changed (EngineHooks.weights_generation)
        self.serving_generation = 0
        self._freeing_work_at_last_trim = (0, 0)
        self._last_trim = float("-inf")
        # resident bytes outside live recordings and the warm heap after the last trim, or
        # before the first recording (None where they cannot be read)
        self._held_after_trim = self._held_outside_recordings()
        self._last_expiry = float("-inf")

    @property
    def warm_heap_bytes(self) -> int:
        """Heap held pre-faulted for the next recording."""
        return self.warmer.held_bytes if self.warmer is not None else 0

    # -- merged serving weights -------------------------------------------------------

    def merge_all(self) -> None:
        """Rebuilds every stale merged serving weight and the serving copy now (at start,
        nobody waits)."""
        if self.merged_serving:
            merge_all(self.peft_model)
        refresh_serving_copies(self.serving_copies)
        self._merge_pending = False
        self.serving_generation += 1

    def invalidate_merged(self) -> None:
        """The adapter changed: the serving copy follows it now (a few small copies),
        merged serving weights are rebuilt in the next items."""
        refresh_serving_copies(self.serving_copies)
        self._merge_pending = self.merged_serving
        self.serving_generation += 1

    def merged_stale(self) -> bool:
        """A cheap check, safe on the asyncio loop."""
        return self._merge_pending

    def rebuild_merged(self, budget_s: float) -> bool:
        """Rebuilds stale merged serving weights for about `budget_s`; False when they
        are all current."""
        if self._merge_pending and merge_stale(self.peft_model, budget_s):
            return True
        self._merge_pending = False
        return False

    # -- label expiry -----------------------------------------------------------------

    def expiry_due(self) -> bool:
        """Whether `expire` should run after this serving step (a cheap check)."""
        return self.cache.clock() - self._last_expiry >= EXPIRY_EVERY_S or self.cache.has_pending_release()

    def expire(self) -> None:
        """Ends entries past their label timeout and frees recordings ended elsewhere."""
        self._last_expiry = self.cache.clock()
        self.cache.expire()

    # -- idle items before a job ------------------------------------------------------

    def has_work(self) -> bool:
        return (self._merge_pending or self.cache.has_pending_release() or self._memory_due()
                or self.warming_due())

    def run_item(self) -> bool:
        """One bounded item of housekeeping (between jobs); False if none was due."""
        if self.rebuild_merged(MERGE_ITEM_S):
            return True  # serving speed first: merged weights are rebuilt before the next job
        if self._memory_due():  # recording has paused: RSS follows the live activations
            self._return_freed_memory()
            return True
        return self.warm_heap()

    def warming_due(self) -> bool:
        """Pages are warmed for the next recording while prefills are being recorded, and
        where a pause keeps a slack, through the pause until the server has gone idle, as
        much as the slack: the recording that ends it lands on them, after a trim too,
        whose freed chunks the warming faults back in (a cheap check)."""
        if self.warmer is None or not self.warmer.wants_to_grow():
            return False
        if not self._recording_paused():
            return True
        return self.warm_heap_bytes < self.trim_slack_bytes and not self._quiet_for(IDLE_TRIM_S)

    def warm_heap(self, budget_s: float = 0.0) -> bool:
        """Faults in heap pages for the next recording (engine/malloc_tuning.py) for about
        `budget_s`, at least one `HeapWarmer.grow`; False if it was warm enough. Wherever the device
        has a moment: between jobs, between a job's slices, and between serving steps.
        Recordings come in bursts, with requests running and jobs in progress; one made
        before the heap is warm again lands on fresh pages and pays their faults in its
        prefill, which requests wait for (`alchemist:serving_step_page_faults_total`;
        BENCHMARKS.md, "Recorded prefills on fresh pages")."""
        started = time.perf_counter()
        grew = False
        while self.warming_due() and self.warmer.grow():
            grew = True
            if time.perf_counter() - started >= budget_s:
                break
        return grew

    def _recording_paused(self) -> bool:
        return self._quiet_for(self.pause_seconds())

    def pause_seconds(self) -> float:
        """How long without a recording makes a pause: `TRIM_QUIET_S`, or where a slack is
        kept, `PAUSE_GAPS` times the traffic's recent mean gap if that is longer."""
        if self.warmer is None or self.trim_slack_bytes == 0:
            return TRIM_QUIET_S
        times = tuple(self.cache.recorded_at)  # one copy: the device thread appends to it
        gaps = [b - a for a, b in zip(times, times[1:]) if b - a < IDLE_TRIM_S]  # -inf's gap is not finite
        if not gaps:
            return TRIM_QUIET_S
        return min(PAUSE_MAX_S, max(TRIM_QUIET_S, PAUSE_GAPS * sum(gaps) / len(gaps)))

    def _quiet_for(self, seconds: float) -> bool:
        return self.cache.clock() - self.cache.recorded_at[-1] >= seconds

    def _memory_due(self) -> bool:
        """Recording has paused and memory was freed since it was last given back (at
        most once per quiet period), more than a pause's slack of it where one is kept;
        or the heap is held warm for a recording that has not come, where no slack is kept
        or the server has gone idle. Under traffic freed memory is kept: the next recording
        reuses it without page faults."""
        pause = self.pause_seconds()
        if not self._quiet_for(pause):
            return False
        # at most one trim per quiet period for the jobs' frees (labels recomputed while
        # requests are served unrecorded, a full cache, must not pay one after every job),
        # and one as soon as the cache has drained: no job is left to free more
        freed = (self._freeing_work() != self._freeing_work_at_last_trim
                 and (len(self.cache) == 0 or self.cache.clock() - self._last_trim >= pause))
        if self.warmer is None or self.trim_slack_bytes == 0:  # recordings on an accelerator, or no slack kept
            return freed or self.warm_heap_bytes > 0
        if self.cache.recorded_at[-1] == float("-inf"):
            self._held_after_trim = self._held_outside_recordings()
        if self._quiet_for(IDLE_TRIM_S):
            return freed or self.warm_heap_bytes > 0
        if not freed:
            return False  # before reading /proc: the slo policy asks between serving steps
        held = self._held_outside_recordings()
        if held is None or self._held_after_trim is None:  # what the process holds cannot be read
            return True
        return held - self._held_after_trim > self.trim_slack_bytes

    def _held_outside_recordings(self) -> int | None:
        """Resident bytes (not backed by files) outside live recordings and the warm heap."""
        resident = resident_anonymous_bytes()
        return None if resident is None else resident - self.cache.bytes - self.warm_heap_bytes

    def _freeing_work(self) -> tuple[int, int]:
        """What frees memory into the heap: activations released, and jobs ended (a job's
        own buffers: responses' graphs, logits, gradients)."""
        return self.cache.released_bytes, sum(self.stats.trained_entries.values()) + self.stats.failed_jobs

    def _return_freed_memory(self) -> None:
        """Frees the warm heap and gives freed memory back to the OS (engine/malloc_tuning.py):
        a server without recordings keeps only what its live activations need."""
        if self.warmer is not None:
            self.warmer.release()
        self._freeing_work_at_last_trim = self._freeing_work()
        self._last_trim = self.cache.clock()
        if return_freed_memory():
            self._held_after_trim = self._held_outside_recordings()
            with self.stats.lock:
                self.stats.memory_trims += 1
