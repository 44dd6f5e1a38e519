"""Start-up objects out of the garbage collector's full passes.

A full (generation 2) collection of Python's cyclic garbage collector visits every object
that is tracked, and a server that has loaded a model, its tokenizer, the transformers and
PEFT modules and the trainer holds hundreds of thousands of them. Such a pass runs on
whichever thread allocates when it comes due; on the device thread, inside a serving step
or a training slice, every request waits for it (`docs/training-issue24/gc_pauses.py`
measures the pauses; BENCHMARKS.md, "Garbage collection pauses"). `gc.freeze()` moves the
objects alive at start-up to a permanent generation that collections skip, as vLLM does
once its engine is built; they are still freed by reference counting, but a reference
cycle among them is never collected.
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Collects what start-up left behind, then freezes every object alive; returns how
    many objects are frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()
