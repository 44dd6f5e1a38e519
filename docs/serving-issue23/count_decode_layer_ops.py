"""Aten ops of one decoder layer (layer 0) in a decode step of 4 greedy streams, frozen
serving on a tiny Llama, float32 and bfloat16, as tests/test_serving_copy.py counts them.
Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/serving-issue23/count_decode_layer_ops.py
"""

import torch

from bench.step_counts import decode_layer_ops
from engine.llm_engine import LLMEngine
from tests.conftest import make_config
from tests.tiny import tiny_model, tiny_tokenizer


def main() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        engine = LLMEngine.for_model(tiny_model("llama", dtype=dtype), tiny_tokenizer(), make_config())
        counter = decode_layer_ops(engine)
        print(f"{str(dtype):15s} {counter.total} ops: {dict(counter.ops)}")


if __name__ == "__main__":
    main()
