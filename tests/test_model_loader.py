"""Loading local Hugging Face model directories of each family, and clear errors."""

import pytest
import torch

from engine.model_loader import load_model, resolve_device, resolve_dtype
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
