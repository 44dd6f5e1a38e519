"""What the device does between serving steps in a server under the trace: an experiment's
instruments, loaded into every Python process started with this directory on PYTHONPATH
(`sitecustomize`), `alchemist bench colocate`'s servers included. Nothing is patched
unless asked:

  - `ALCHEMIST_EXP_GAPS=1`: every 10 s, each server appends to
    /tmp/exp/gaps-PID.jsonl the seconds between serving steps while requests ran, each
    step kind's count and seconds, the device items run meanwhile (by name), why a chain
    of steps broke, and the heap warming's bytes, page faults and seconds between steps
    and in idle gaps; the garbage collector's passes and seconds by generation, those
    inside a serving step apart; and the decode steps' median, mean and 90th percentile (all
    since the server started: a warm-up trace's steps included);
  - `ALCHEMIST_EXP_NO_STEP_WARM=1`: the heap is warmed in idle gaps only, never between
    serving steps (an ablation).

    mkdir -p /tmp/exp
    PYTHONPATH=docs/training-issue24/step_gaps ALCHEMIST_EXP_GAPS=1 \
        .venv/bin/alchemist bench colocate --rate 0.25 --seconds 240 --rounds 1 --compare training
"""
import os
if os.environ.get("ALCHEMIST_EXP_GAPS") == "1":
    import collections, json, threading, time
    import engine.async_engine as ae
    cls = next(v for v in vars(ae).values() if isinstance(v, type) and hasattr(v, "_engine_item"))
    stats = collections.defaultdict(float)
    state = {"last_end": None, "in_step": False, "gc_started": None}
    decode_steps = []
    original_item = cls._engine_item
    original_run = cls.run
    original_follows = cls._next_step_follows

    def engine_item(self, messages):
        started = time.perf_counter()
        if state["last_end"] is not None and self.engine.has_unfinished():
            stats["gap_s"] += started - state["last_end"]
            stats["gaps"] += 1
        state["in_step"] = True
        try:
            out = original_item(self, messages)
        finally:
            state["in_step"] = False
        end = time.perf_counter()
        kind = out[2].kind if out[2] is not None and hasattr(out[2], "kind") else "none"
        stats[f"step_{kind}_s"] += end - started
        stats[f"step_{kind}_n"] += 1
        if kind == "decode":
            decode_steps.append(end - started)
        state["last_end"] = end if self.engine.has_unfinished() else None
        return out

    async def run(self, fn, *args):
        name = getattr(fn, "__qualname__", getattr(fn, "__name__", repr(fn)))
        def timed(*a):
            busy = self.engine.has_unfinished()
            t = time.perf_counter()
            try:
                return fn(*a)
            finally:
                if busy:
                    stats[f"item_{name}_s"] += time.perf_counter() - t
                    stats[f"item_{name}_n"] += 1
        return await original_run(self, timed, *args)

    def follows(self, s):
        result = original_follows(self, s)
        if not result and s is not None and s.num_scheduled_tokens and self.engine.has_unfinished():
            waiting = self._items_submitted - self._items_cancelled - self._items_begun
            reason = "items" if waiting else ("inbox" if self._inbox else "hook")
            stats[f"break_{reason}"] += 1
        return result

    cls._engine_item, cls.run, cls._next_step_follows = engine_item, run, follows

    import gc

    def on_gc(phase, info):
        if phase == "start":
            state["gc_started"] = time.perf_counter()
        elif state["gc_started"] is not None:
            where = "in_step" if state["in_step"] else "outside"
            stats[f"gc{info['generation']}_{where}_s"] += time.perf_counter() - state["gc_started"]
            stats[f"gc{info['generation']}_{where}_n"] += 1

    gc.callbacks.append(on_gc)

    def decode_percentiles():
        steps = sorted(decode_steps)
        if not steps:
            return {}
        return {"decode_p50_s": steps[len(steps) // 2], "decode_p90_s": steps[int(len(steps) * 0.9)],
                "decode_mean_s": sum(steps) / len(steps)}

    def dump():
        began = time.monotonic()
        while True:
            time.sleep(10)
            stats.update(decode_percentiles())
            with open(f"/tmp/exp/gaps-{os.getpid()}.jsonl", "a") as f:
                f.write(json.dumps({"t": round(time.monotonic() - began), **stats}) + "\n")

    threading.Thread(target=dump, daemon=True).start()
    print("EXPERIMENT: gaps", flush=True)

if os.environ.get("ALCHEMIST_EXP_GAPS") == "1":
    import trainer.maintenance as tm
    from engine.malloc_tuning import minor_page_faults
    original_warm = tm.Maintenance.warm_heap
    original_trim = tm.Maintenance._return_freed_memory

    def warm_heap(self, budget_s=0.0):
        held, faults, t = self.warm_heap_bytes, minor_page_faults(), time.perf_counter()
        result = original_warm(self, budget_s)
        key = "between" if budget_s else "idle"
        stats[f"warm_{key}_bytes"] += self.warm_heap_bytes - held
        stats[f"warm_{key}_faults"] += minor_page_faults() - faults
        stats[f"warm_{key}_s"] += time.perf_counter() - t
        stats[f"warm_{key}_calls"] += 1
        stats["warm_target"] = self.warmer.target if self.warmer else 0
        stats["warm_piece"] = self.warmer.piece_bytes if self.warmer else 0
        return result

    def trim(self, *a, **k):
        stats["trims"] += 1
        return original_trim(self, *a, **k)

    tm.Maintenance.warm_heap, tm.Maintenance._return_freed_memory = warm_heap, trim
