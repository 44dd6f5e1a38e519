"""What a recorded prefill alone holds, by storage, on the embedded model (DPO mode, the
server's defaults, 100-token prompts): the bytes autograd saved (what a recording is
counted as), the bytes of its layers' key and value rows held beside them (kept for the
suffixes' attention, not saved by any node), their sum per prompt token, and the
padding and copy ops of the step. With `--gpu-buckets` the recorded attention's key
length is rounded up as a GPU's is (half-octave buckets; engine/step_inputs.py). Run from
the repository root, in this tree and in a worktree of an older one (that tree first on
PYTHONPATH) to compare:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/recording_kv_bytes.py [--gpu-buckets] [--json FILE]
"""

import argparse
import json

from bench.recording import embedded_training_engine
from bench.step_counts import AtenOps
from bench.traces import synthetic_tokens
from engine.recording import SavedTensorTracker
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepBuckets
from server.config import AlchemistConfig

TOKENS = 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpu-buckets", action="store_true")
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    config = AlchemistConfig()
    engine, trainer, tokenizer = embedded_training_engine(config)
    if args.gpu_buckets:
        engine.runner.training_buckets = StepBuckets(config.cache.block_size, half_octaves=True,
                                                     max_len=config.model.max_model_len)
    tracker = engine.runner.record_tracker = SavedTensorTracker()  # the hooks on every recording
    results = []
    for i in range(2):  # the second: every copy and cache built
        request_id = f"kv-bytes-{i}"
        engine.add_request(request_id, synthetic_tokens(tokenizer, TOKENS, i),
                           SamplingParams(temperature=0.0, max_tokens=1), train=True)
        saved_before = dict(tracker._storages)  # white-box: storage -> (references, bytes)
        counter = AtenOps()
        with counter.counting():
            engine.step()
        while engine.has_unfinished():
            engine.step()
        segments = trainer.cache.get(request_id).recording.segments
        saved = {key: entry[1] for key, entry in tracker._storages.items() if key not in saved_before}
        beside = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                  for s in segments for t in (s.key, s.value) if t.untyped_storage().data_ptr() not in saved}
        results.append({"saved_bytes": sum(saved.values()), "kv_beside_saved_bytes": sum(beside.values()),
                        "held_kib_per_token": round((sum(saved.values()) + sum(beside.values())) / TOKENS / 1024, 1),
                        "constant_pad_nd_ops": counter.ops["constant_pad_nd"], "clone_ops": counter.ops["clone"],
                        "aten_ops": counter.total})
    print(json.dumps(results[-1], indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu_buckets": args.gpu_buckets, "prompt_tokens": TOKENS, **results[-1]}, f, indent=1)


if __name__ == "__main__":
    main()
