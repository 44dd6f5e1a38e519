"""Loading local Hugging Face model directories of each family, and clear errors."""

import dataclasses
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model_loader import load, load_model, resolve_device, resolve_dtype
from tests.tiny import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_loads_a_local_model_directory(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer, name = load_model(str(tmp_path), "float32", "cpu")
    assert name == tmp_path.name and tokenizer.eos_token == "<|im_end|>"
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-5)


def test_missing_directory_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a local Hugging Face model directory"):
        load_model(str(tmp_path / "nope"))


def test_dtype_and_device_resolution():
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be one of"):
        resolve_dtype("int3", torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA is not available"):
            resolve_device("cuda")


def test_dummy_load_format_builds_random_weights_from_a_config_only_directory(tmp_path):
    """`--load-format dummy`: the shape of the config, seeded random weights (two loads
    agree, so benchmark copies are one model), the tokenizer from `--tokenizer`."""
    tiny_model("llama").config.save_pretrained(tmp_path / "shape")
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    config = ModelConfig(model=str(tmp_path / "shape"), tokenizer=str(tmp_path / "tok"), load_format="dummy",
                         dtype="float32", device="cpu")
    first, tokenizer, name = load(config)
    second, _, _ = load(config)
    assert name == "shape" and tokenizer.eos_token == "<|im_end|>"
    assert first.config.num_hidden_layers == 2 and first.config.hidden_size == 64
    for a, b in zip(first.parameters(), second.parameters()):
        assert torch.equal(a, b)
    with pytest.raises(FileNotFoundError, match="not a local tokenizer directory"):
        load(dataclasses.replace(config, tokenizer=str(tmp_path / "nope")))
    with pytest.raises(ValueError, match="load_format must be one of"):
        ModelConfig(load_format="pt")


def test_the_paper_model_shape_is_llama_3_1_8b():
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(Path(__file__).parent.parent / "configs" / "models" / "llama-3.1-8b")
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_config(config)
    assert 8.0e9 < sum(p.numel() for p in model.parameters()) < 8.1e9
