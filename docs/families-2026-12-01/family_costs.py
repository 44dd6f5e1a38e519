"""What each family the engine serves costs per decoder layer, on the tiny models of
tests/tiny.py (hidden 64, 2 layers): the aten ops of a decode layer at 4 streams (layer 1:
layer 0 also builds the step's mask), and of one RMSNorm module, the family's own forward
against the engine's (engine/fused_norm.py), in float32 and bfloat16; and the bytes a
recorded prefill keeps per prompt token (SavedTensorTracker's count, through the engine).

    PYTHONPATH=. .venv/bin/python docs/families-2026-12-01/family_costs.py
"""

from __future__ import annotations

import torch

from bench.step_counts import AtenOps, decode_layer_ops
from engine.fused_norm import install_fused_rms_norm
from tests.conftest import make_engine
from tests.tiny import FAMILIES, tiny_model


def norm_ops(family: str, dtype: torch.dtype) -> tuple[int, int]:
    model = tiny_model(family, dtype=dtype)
    norm = next(m for m in model.modules() if type(m).__name__.endswith("RMSNorm"))
    x = torch.randn(1, 9, norm.weight.shape[0], dtype=dtype)
    counts = []
    for _ in range(2):
        counter = AtenOps()
        with torch.inference_mode():
            norm(x)  # what a norm makes once (Gemma's 1 + weight) is not counted
            with counter.counting():
                norm(x)
        counts.append(counter.total)
        install_fused_rms_norm(model)
    return counts[0], counts[1]


def main() -> None:
    print("| family | decode layer ops, 4 streams (layer 1) | one RMSNorm, own / engine's: float32; bfloat16 |")
    print("| --- | ---: | ---: |")
    for family in FAMILIES:
        engine = make_engine(family)
        layer = decode_layer_ops(engine, layer=1).total
        f32, bf16 = norm_ops(family, torch.float32), norm_ops(family, torch.bfloat16)
        print(f"| {family} | {layer} | {f32[0]} / {f32[1]}; {bf16[0]} / {bf16[1]} |")


if __name__ == "__main__":
    main()
