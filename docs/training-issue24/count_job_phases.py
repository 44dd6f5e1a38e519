"""Aten ops per decoder layer of the DPO jobs, by phase: the base reference's forward, the
forward with grad, and each backward (the responses' or the separate trainer's batch; the
recorded prompt's, which takes its K/V gradients from the responses). Same jobs, model and
per-layer unit as `count_job_ops.py` (the job on 4 layers less the job on 2, halved); the
phases are told apart by which of `trainer.forward`'s functions is running. Run from the
repository root:

    .venv/bin/python docs/training-issue24/count_job_phases.py
"""

import contextlib
import sys
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import trainer.dpo as dpo  # noqa: E402
import trainer.forward as forward  # noqa: E402
from bench.step_counts import AtenOps  # noqa: E402
from count_job_ops import counted_jobs  # noqa: E402

PATHS = {"reuse": "reuse_job", "separate trainer": "baseline_job", "server's recompute": "recompute_job"}
current_phase = ["other"]


class PhaseOps:
    """Aten ops (views apart, as `AtenOps` counts them) by the phase running."""

    def __init__(self):
        self.ops: Counter = Counter()

    @contextlib.contextmanager
    def counting(self):
        counter, view_rule = self, AtenOps()

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                before = view_rule.views
                with view_rule.counting():
                    out = func(*args, **(kwargs or {}))
                if view_rule.views == before:
                    counter.ops[current_phase[0]] += 1
                return out

        with Mode():
            yield self


def in_phase(name: str, generator):
    """Runs `generator` with `name` as the phase around each of its steps."""
    while True:
        previous, current_phase[0] = current_phase[0], name
        try:
            item = next(generator)
        except StopIteration as stop:
            return stop.value
        finally:
            current_phase[0] = previous
        yield item


def tag_phases() -> None:
    forward_segments, backward_layer = forward.forward_segments, forward.backward_layer

    def tagged_forward(runner, token_lists, starts=None, prefix=None, with_grad=True, shared_prefix=False):
        name = "forward with grad" if with_grad else "reference forward"
        return (yield from in_phase(name, forward_segments(runner, token_lists, starts, prefix, with_grad,
                                                           shared_prefix)))

    def tagged_backward(segments, index, grad, kv_grads=None, residency=None):
        previous = current_phase[0]
        prompt = kv_grads is not None and kv_grads[0] is not None
        current_phase[0] = "prompt's backward" if prompt else "backward"
        try:
            return backward_layer(segments, index, grad, kv_grads, residency)
        finally:
            current_phase[0] = previous

    dpo.forward_segments = tagged_forward
    forward.backward_layer = tagged_backward


def main() -> None:
    tag_phases()
    phases = ["reference forward", "forward with grad", "backward", "prompt's backward"]
    print("| model, LoRA math | job | " + " | ".join(phases) + " | per layer |")
    print("| --- | --- |" + " ---: |" * (len(phases) + 1))
    for dtype, name in ((torch.bfloat16, "bfloat16, bfloat16 copies"), (torch.float32, "float32")):
        shallow = counted_jobs("dpo", dtype, "model", 2, PATHS, PhaseOps)
        deep = counted_jobs("dpo", dtype, "model", 4, PATHS, PhaseOps)
        for path in PATHS:
            per_layer = {p: (deep[path].ops[p] - shallow[path].ops[p]) / 2 for p in phases}
            cells = " | ".join(f"{per_layer[p]:.0f}" if per_layer[p] else "–" for p in phases)
            print(f"| {name} | {path} | {cells} | {sum(per_layer.values()):.0f} |")


if __name__ == "__main__":
    main()
