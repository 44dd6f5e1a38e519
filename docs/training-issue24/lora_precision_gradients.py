"""The LoRA gradient on a bfloat16 model against the float32 model's with the same weights:
from the training copies (LoRA math in bfloat16) and from PEFT's float32 adapter. The
largest relative difference over the LoRA tensors, a tiny model of each family, 24
tokens. Run from the repository root:

    .venv/bin/python docs/training-issue24/lora_precision_gradients.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.test_training import relative_difference  # noqa: E402
from tests.test_training_copy import adapted, gradients_on  # noqa: E402

for family in ("llama", "mistral", "qwen2", "phi3"):
    ids = torch.randint(3, 200, (1, 24), generator=torch.Generator().manual_seed(0))
    truth = gradients_on(*adapted(family, torch.float32, True)[:2], ids)
    copies = gradients_on(*adapted(family, torch.bfloat16, True)[:2], ids)
    peft = gradients_on(*adapted(family, torch.bfloat16, False)[:2], ids)
    print(f"{family}: bfloat16 copies {relative_difference(copies, truth):.3f}, "
          f"PEFT float32 adapter {relative_difference(peft, truth):.3f}, "
          f"copies against PEFT {relative_difference(copies, peft):.3f}")
