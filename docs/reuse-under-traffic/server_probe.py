"""Runs `alchemist serve` with each prefill step timed (recorded or plain), its minor page faults and
glibc heap use, one JSON line per step (PROBE_LOG). How `server-prefill-steps.json` was measured:
  PROBE_LOG=on.jsonl .venv/bin/python docs/reuse-under-traffic/server_probe.py --port 8001 --train-mode dpo &
  .venv/bin/python docs/reuse-under-traffic/drive.py http://127.0.0.1:8001 60 1   # 0.25 req/s, feedback on every answer"""
import json, os, sys, time, gc, resource
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
import torch
from engine import model_runner
from trainer.adapter import LeanLoraLinear

import ctypes
class _MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena","ordblks","smblks","hblks","hblkhd","usmblks","fsmblks","uordblks","fordblks","keepcost")]
_libc = ctypes.CDLL("libc.so.6"); _libc.mallinfo2.restype = _MI
def _mi():
    m = _libc.mallinfo2(); return {"arena": m.arena >> 20, "mmap": m.hblkhd >> 20, "used": m.uordblks >> 20, "free": m.fordblks >> 20}
LOG = open(os.environ.get("PROBE_LOG", "/tmp/probe/steps.jsonl"), "w")
orig_rec, orig_exec = model_runner.ModelRunner._execute_recorded, model_runner.ModelRunner._execute
_model = {}

def _merged_share(runner):
    mods = _model.get("mods")
    if mods is None:
        mods = _model["mods"] = [m for m in runner.model.modules() if isinstance(m, LeanLoraLinear)]
    if not mods:
        return None
    return sum(m.merged_is_current() for m in mods) / len(mods)

def timed(orig, kind):
    def run(self, step):
        merged = _merged_share(self)
        gcs = gc.get_stats()[2]["collections"] if kind else 0
        m0 = _mi()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0 = time.perf_counter(); c0 = time.process_time()
        out = orig(self, step)
        t1 = time.perf_counter(); c1 = time.process_time()
        LOG.write(json.dumps({"t": t0, "kind": kind, "s": t1 - t0, "cpu": c1 - c0, "tokens": step.num_tokens,
                              "batch": len(step.scheduled), "prompt": step.scheduled[0].num_new_tokens,
                              "merged": merged, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0, "m0": m0, "m1": _mi()}) + "\n"); LOG.flush()
        return out
    return run

model_runner.ModelRunner._execute_recorded = timed(orig_rec, "recorded")
model_runner.ModelRunner._execute = timed(orig_exec, "plain")
orig_pre = model_runner.ModelRunner._record_prefill
model_runner.ModelRunner._record_prefill = timed(orig_pre, "record_part")
from engine import malloc_tuning
from trainer import trainer as trainer_mod
_orig_trim = trainer_mod.return_freed_memory
def _trim():
    LOG.write(json.dumps({"t": time.perf_counter(), "kind": "trim"}) + "\n"); return _orig_trim()
trainer_mod.return_freed_memory = _trim
_orig_release = malloc_tuning.HeapWarmer.release
def _release(self):
    LOG.write(json.dumps({"t": time.perf_counter(), "kind": "release", "held": self.held_bytes, "target": self.target}) + "\n")
    return _orig_release(self)
malloc_tuning.HeapWarmer.release = _release
_orig_grow = malloc_tuning.HeapWarmer.grow
def _grow(self):
    r = _orig_grow(self)
    LOG.write(json.dumps({"t": time.perf_counter(), "kind": "grow", "held": self.held_bytes, "target": self.target, "r": r}) + "\n")
    return r
malloc_tuning.HeapWarmer.grow = _grow
_orig_has = trainer_mod.Trainer.has_work
def _has(self):
    r = _orig_has(self)
    if not r: LOG.write(json.dumps({"t": time.perf_counter(), "kind": "nowork", "w": self.warmer is not None and self.warmer.wants_to_grow()}) + "\n")
    return r
trainer_mod.Trainer.has_work = _has
from server.cli import main
sys.exit(main(["serve", *sys.argv[1:]]))
