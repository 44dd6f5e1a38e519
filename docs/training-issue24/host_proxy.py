"""The model the host-cost scripts run (recorded_prefill_host.py, dpo_job_host.py): a tiny
Llama in bfloat16 (hidden 16, so that compute is negligible) with as many decoder layers
as Llama-3.1-8B (32), LoRA on every linear, DPO mode with the LoRA math in the model's
dtype — the GPU's code path (serving and training copies), where the host is what a GPU
waits for. In float32 the same model takes the CPU's path instead (merged weights, each
adapted layer's recorded forward through `_MergedLoraFunction`)."""

import cProfile
import time

import torch

from engine.sampling_params import SamplingParams
from server.build import build_training_engine
from tests.conftest import make_config
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.config import TrainConfig


def host_proxy_engine(dtype: torch.dtype = torch.bfloat16):
    """(engine, trainer), single-threaded and seeded."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = tiny_model("llama", dtype=dtype, num_layers=32, hidden_size=16)
    return build_training_engine(model, tiny_tokenizer(), make_config(),
                                 TrainConfig(mode="dpo", lora_rank=8, lora_compute_dtype="model"),
                                 init_lora_weights=False)


def timed_prefill(engine, ids: list[int], request_id: str, recorded: bool, max_tokens: int = 1,
                  profile: cProfile.Profile | None = None) -> float:
    """Serves `ids` greedily (recorded for training or not) and returns its prefill step's
    seconds, that step alone under `profile` when one is given."""
    engine.add_request(request_id, ids, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
                       train=recorded)
    if profile is not None:
        profile.enable()
    started = time.perf_counter()
    engine.step()
    seconds = time.perf_counter() - started
    if profile is not None:
        profile.disable()
    while engine.has_unfinished():
        engine.step()
    return seconds
