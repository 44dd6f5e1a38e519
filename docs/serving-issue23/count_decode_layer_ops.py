"""Aten ops of one decoder layer (layer 0) in a decode step of 4 greedy streams, frozen
serving on a tiny Llama, float32 and bfloat16, as tests/test_serving_copy.py counts them.
Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/serving-issue23/count_decode_layer_ops.py
"""

import torch

from bench.step_counts import AtenOps
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import make_config
from tests.tiny import tiny_model, tiny_tokenizer


def layer_ops(engine: LLMEngine) -> AtenOps:
    for i in range(4):
        engine.add_request(f"r{i}", [5 + i, 7, 9], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    engine.step()
    counter, run_layer = AtenOps(), engine.runner.run_layer

    def counted(index, *args, **kwargs):
        if index != 0:
            return run_layer(index, *args, **kwargs)
        with counter.counting():
            return run_layer(index, *args, **kwargs)

    engine.runner.run_layer = counted
    engine.step()
    return counter


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        counter = layer_ops(LLMEngine.for_model(tiny_model("llama", dtype=dtype), tiny_tokenizer(), make_config()))
        print(f"{str(dtype):15s} {counter.total} ops: {dict(counter.ops)}")


if __name__ == "__main__":
    main()
