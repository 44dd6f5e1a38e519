"""The activation cache's budget: a configured number of bytes, or sized to the device at
start (half the free GPU memory; 2 GiB on the CPU), exported beside what it holds."""

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoConfig

from bench.report import read_metric
from tests.servers import tiny_app
from trainer.cache_budget import CPU_CACHE_BYTES, recorded_bytes_per_token, size_cache
from trainer.config import TrainConfig

LLAMA_8B = Path(__file__).resolve().parents[1] / "configs" / "models" / "llama-3.1-8b"


def test_the_8b_shape_records_megabytes_per_token_so_a_fixed_two_gib_holds_a_few_prompts():
    config = AutoConfig.from_pretrained(LLAMA_8B)
    per_token = recorded_bytes_per_token(config, torch.bfloat16)
    # 32 layers x 2 bytes x (6 x 4096 + 2 x 1024 + 2 x 14336), and the rotary tables (cos,
    # sin, the signed sin), the head's input and logits
    assert per_token == 32 * 2 * (6 * 4096 + 2 * 1024 + 2 * 14336) + 2 * (3 * 128 + 4096 + 128256)
    assert CPU_CACHE_BYTES // per_token < 600


def test_a_configured_budget_is_kept_and_zero_sizes_it_to_the_device():
    config = AutoConfig.from_pretrained(LLAMA_8B)
    free = 50 << 30
    on_gpu = size_cache(0, torch.device("cuda", 0), config, torch.bfloat16, free_bytes=lambda device: free)
    assert on_gpu.budget_bytes == free // 2 and "free on cuda:0" in on_gpu.source
    assert on_gpu.tokens == on_gpu.budget_bytes // recorded_bytes_per_token(config, torch.bfloat16)
    assert size_cache(0, torch.device("cpu"), config, torch.bfloat16).budget_bytes == CPU_CACHE_BYTES
    configured = size_cache(12345 << 10, torch.device("cuda", 0), config, torch.bfloat16,
                            free_bytes=lambda device: pytest.fail("a configured budget reads no device memory"))
    assert configured.budget_bytes == 12345 << 10 and configured.source == "train.cache_bytes"


def test_a_negative_budget_is_refused():
    with pytest.raises(ValueError, match="cache_bytes"):
        TrainConfig(mode="dpo", cache_bytes=-1)


@pytest.mark.parametrize(("configured", "expected"), [(0, CPU_CACHE_BYTES), (123456, 123456)])
def test_the_server_exports_its_budget_beside_what_the_cache_holds(configured, expected):
    app = tiny_app(train=TrainConfig(mode="dpo", lora_rank=4, cache_bytes=configured))
    with TestClient(app) as client:
        text = client.get("/metrics").text
    assert read_metric(text, "alchemist:activation_cache_budget_bytes") == expected
    assert read_metric(text, "alchemist:activation_cache_bytes") == 0
