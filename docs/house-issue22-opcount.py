"""Aten ops dispatched per engine decode step on a tiny Llama with 8 greedy streams (the
CPU's proxy for a GPU's kernel launches), for BENCHMARKS.md's issue 22 section.

Run from a tree's root: `PYTHONPATH=. .venv/bin/python docs/house-issue22-opcount.py`
(the tree before issue 22 builds its engine with `LLMEngine(model, tokenizer, config)`).
"""

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_config
from tests.tiny import tiny_model, tiny_tokenizer


class OpCount(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def main() -> None:
    torch.manual_seed(0)
    model, tokenizer, config = tiny_model("llama"), tiny_tokenizer(), make_config()
    build = getattr(LLMEngine, "for_model", LLMEngine)
    engine = build(model, tokenizer, config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i in range(8):
        engine.add_request(f"r{i}", encode("Hello there, how are you doing today?"), params)
    for _ in range(3):  # the prefills
        engine.step()
    counts = []
    for _ in range(10):
        with OpCount() as count:
            engine.step()
        counts.append(sum(count.ops.values()))
    print("aten ops per decode step at 8 streams:", counts)


if __name__ == "__main__":
    main()
