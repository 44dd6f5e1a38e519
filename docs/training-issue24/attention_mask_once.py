"""An attention group's mask made once per step as SDPA's additive mask, against the
boolean mask SDPA converts in every layer (the path before), side by side in one process
in alternating rounds on the embedded model; each figure is the boolean path's median
step time over the additive one's.

- `--decodes STREAMS:CONTEXT …`: decode-only steps (every layer reads the decodes' mask);
- `--chunked TOKENS:CHUNK …`: a prompt of TOKENS prefilled in chunks of CHUNK tokens (the
  first chunk runs the causal kernel, every later one reads a mask), the whole prefill.

Run from the repository root:

    .venv/bin/python docs/training-issue24/attention_mask_once.py --decodes 8:300 3:600 --chunked 1000:256 --json …
"""

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench.traces import synthetic_tokens  # noqa: E402
from engine.kv_cache import AttentionGroup  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.model_loader import load  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from serving_step_layouts import clear, compare, decode_seconds  # noqa: E402
from server.config import AlchemistConfig  # noqa: E402

_ADDITIVE = AttentionGroup.mask


def _boolean(self, sliding_window=None, dtype=None):
    """The path before: the boolean mask, made once per step, converted by SDPA in every layer."""
    if sliding_window not in self._masks:
        self._masks[sliding_window] = self.allowed(sliding_window)
    return self._masks[sliding_window]


PATHS = {"boolean": _boolean, "additive": _ADDITIVE}


def chunked_prefill_seconds(engine: LLMEngine, prompt: list[int], tag: str) -> float:
    engine.add_request(tag, prompt, SamplingParams(max_tokens=1, temperature=0.0))
    started = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decodes", nargs="*", default=["8:300", "3:600"], metavar="STREAMS:CONTEXT")
    parser.add_argument("--chunked", nargs="*", default=["1000:256"], metavar="TOKENS:CHUNK")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json")
    args = parser.parse_args()
    config = AlchemistConfig()
    model, tokenizer, _ = load(config.model)
    report = {"threads": torch.get_num_threads(), "rounds": args.rounds, "decode": [], "chunked": []}
    engine = LLMEngine.for_model(model, tokenizer, config)
    for spec in args.decodes:
        streams, context = (int(part) for part in spec.split(":"))

        def measure(path: str, r: int) -> float:
            AttentionGroup.mask = PATHS[path]
            prompts = [synthetic_tokens(tokenizer, context + 3 * i, r * 100 + i) for i in range(streams)]
            return decode_seconds(engine, prompts, f"decode-{streams}-{context}-{r}-{path}")

        case = {"streams": streams, "context": context, **compare(measure, list(PATHS), args.rounds)}
        report["decode"].append(case)
        print(f"decode {streams} streams at {context} tokens: {case['median_ms']} "
              f"(boolean over additive x{case['plain_over']['additive']:.3f})", flush=True)
    for spec in args.chunked:
        tokens, chunk = (int(part) for part in spec.split(":"))
        chunking = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler,
                                                                           max_num_batched_tokens=chunk))
        chunked = LLMEngine.for_model(model, tokenizer, chunking)

        def measure(path: str, r: int) -> float:
            AttentionGroup.mask = PATHS[path]
            return chunked_prefill_seconds(chunked, synthetic_tokens(tokenizer, tokens, r), f"chunked-{r}-{path}")

        case = {"tokens": tokens, "chunk": chunk, **compare(measure, list(PATHS), args.rounds)}
        report["chunked"].append(case)
        clear(chunked)
        print(f"prefill of {tokens} tokens in chunks of {chunk}: {case['median_ms']} "
              f"(boolean over additive x{case['plain_over']['additive']:.3f})", flush=True)
    AttentionGroup.mask = _ADDITIVE
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
