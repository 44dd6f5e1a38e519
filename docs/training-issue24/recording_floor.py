"""What recording costs a prefill beyond keeping its activations: on the embedded model
(the CPU's serving path, DPO mode, the server's defaults), a 100-token prompt prefilled
three ways in turn, round by round in one process:

- plain: served, nothing kept;
- kept: served without autograd, every linear layer's output (q, k, v, o, gate, up,
  down) held until the round ends, through forward hooks — about what a recording keeps,
  in bytes, without a graph (its bytes per token are reported);
- recorded: the recorded prefill (autograd's graph and saved tensors), labelled and
  trained before the next round, as in `bench recording --cases trained`.

Reported: the median first-token time of each, and kept / plain, recorded / plain. The
first ratio is what holding that much memory costs a prefill on this machine (fresh
pages, colder caches); the second less the first is autograd's own share. Run from the
repository root:

    PYTHONPATH=. .venv/bin/python docs/training-issue24/recording_floor.py [--rounds 12] [--json FILE]
"""

import argparse
import json
import statistics

import torch

from bench.recording import first_token_seconds, embedded_training_engine
from bench.traces import synthetic_tokens
from engine.malloc_tuning import keep_freed_memory
from server.config import AlchemistConfig
from trainer.feedback import FeedbackLabel

WAYS = ("plain", "kept", "recorded")
TOKENS = 100


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--json", default="")
    args = parser.parse_args()
    keep_freed_memory()  # as the server does
    engine, trainer, tokenizer = embedded_training_engine(AlchemistConfig())
    kept: list[torch.Tensor] = []
    holding = [False]

    def hold(module, inputs, output):
        if holding[0]:
            kept.append(output)

    linears = [m for name, m in trainer.peft_model.named_modules()
               if name.endswith(("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
               and hasattr(m, "base_layer")]
    for module in linears:
        module.register_forward_hook(hold)
    seconds = {way: [] for way in WAYS}
    kept_bytes = []
    for round_index in range(args.rounds + 2):  # the first two rounds warm up
        order = WAYS if round_index % 2 else tuple(reversed(WAYS))
        for way in order:
            request_id = f"{way}-{round_index}"
            prompt = synthetic_tokens(tokenizer, TOKENS, round_index)
            holding[0] = way == "kept"
            took, _ = first_token_seconds(engine, request_id, prompt, way == "recorded")
            holding[0] = False
            if way == "kept":
                kept_bytes.append(sum(t.untyped_storage().nbytes() for t in kept))
                kept.clear()
            if way == "recorded":
                trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
            trainer.train_until_idle()
            if round_index >= 2:
                seconds[way].append(took)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    result = {"rounds": args.rounds, "tokens": TOKENS,
              "kept_kib_per_token": round(statistics.median(kept_bytes) / TOKENS / 1024, 1),
              **{f"{way}_ms": round(1000 * median[way], 1) for way in WAYS},
              "kept_over_plain": round(median["kept"] / median["plain"], 3),
              "recorded_over_plain": round(median["recorded"] / median["plain"], 3),
              "seconds": seconds}
    print(json.dumps({k: v for k, v in result.items() if k != "seconds"}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
