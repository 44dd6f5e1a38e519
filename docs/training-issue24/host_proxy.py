"""The model the host-cost scripts run (recorded_prefill_host.py, dpo_job_host.py): a tiny
Llama in bfloat16 (hidden 16, so that compute is negligible) with as many decoder layers
as Llama-3.1-8B (32), LoRA on every linear, DPO mode with the LoRA math in the model's
dtype — the GPU's code path (serving and training copies), where the host is what a GPU
waits for."""

import torch

from server.build import build_training_engine
from tests.conftest import make_config
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.config import TrainConfig


def host_proxy_engine():
    """(engine, trainer), single-threaded and seeded."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model("llama", dtype=torch.bfloat16, num_layers=32, hidden_size=16)
    return build_training_engine(model, tiny_tokenizer(), make_config(),
                                 TrainConfig(mode="dpo", lora_rank=8, lora_compute_dtype="model"),
                                 init_lora_weights=False)
