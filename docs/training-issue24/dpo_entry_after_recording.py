"""One DPO entry at a time on the embedded model: a 100-token prompt served recorded (its
shape measured once, then recorded without saved-tensor hooks where the memo applies),
labelled at once, and trained (`train_until_idle`); reported: the median time of the
recorded prefill step and of the entry's training over 12 rounds (2 warm-up). Run from the
root of each tree to compare (a git worktree of the tree before), alternating:

    TREE=$PWD .venv/bin/python docs/training-issue24/dpo_entry_after_recording.py
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.environ.get("TREE", os.getcwd()))

from bench.recording import embedded_training_engine  # noqa: E402
from bench.traces import synthetic_tokens  # noqa: E402
from engine.malloc_tuning import keep_freed_memory  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from server.config import AlchemistConfig  # noqa: E402
from trainer.feedback import FeedbackLabel  # noqa: E402


def main() -> None:
    keep_freed_memory()
    engine, trainer, tokenizer = embedded_training_engine(AlchemistConfig())
    train_s, prefill_s = [], []
    for i in range(14):
        request_id = f"r{i}"
        prompt = synthetic_tokens(tokenizer, 100, i)
        engine.add_request(request_id, prompt, SamplingParams(max_tokens=8, temperature=0.0), train=True)
        started = time.perf_counter()
        engine.step()
        prefill = time.perf_counter() - started
        while engine.has_unfinished():
            engine.step()
        trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
        started = time.perf_counter()
        trainer.train_until_idle()
        if i >= 2:
            train_s.append(time.perf_counter() - started)
            prefill_s.append(prefill)
    print(f"{os.environ.get('TREE', os.getcwd())}: training median {statistics.median(train_s) * 1e3:.0f} ms, "
          f"recorded prefill median {statistics.median(prefill_s) * 1e3:.0f} ms, "
          f"trained {dict(trainer.stats.trained_entries)}")


if __name__ == "__main__":
    main()
