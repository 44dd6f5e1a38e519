"""Loading local Hugging Face model directories of each family, and clear errors."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch

from engine.config import ModelConfig
from engine.model_loader import (EMBEDDED_MODEL_NAME, embedded_model_dir, load, load_model, resolve_device,
                                 resolve_dtype)
from fastapi.testclient import TestClient

from tests.servers import TINY_NAME, tiny_app
from tests.tiny import tiny_model, tiny_tokenizer


@pytest.mark.parametrize("family", ["llama", "phi3", "qwen3", "gemma3_text"])
def test_loads_a_local_model_directory(tmp_path, family):
    model = tiny_model(family)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    loaded, tokenizer, name = load_model(str(tmp_path), "float32", "cpu")
    assert name == tmp_path.name and tokenizer.eos_token == "<|im_end|>"
    x = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        assert torch.allclose(loaded(x).logits, model(x).logits, atol=1e-5)


def test_a_model_directory_without_its_tokenizer_or_with_one_too_large_or_too_short_positions_is_refused(tmp_path):
    """Another model's tokenizer (the embedded one, which only a config-only directory of
    random weights may borrow) would give ids past its embedding or the wrong text; a
    context past its positions, wrong outputs. vLLM refuses both at start."""
    model = tiny_model("llama")
    model.save_pretrained(tmp_path)  # no tokenizer beside the weights
    with pytest.raises(FileNotFoundError, match="holds no tokenizer: pass its tokenizer with --tokenizer"):
        load_model(str(tmp_path), "float32", "cpu")
    small = tmp_path / "small-vocab"
    # the model's own config, with fewer tokens than the tokenizer has
    model.config.vocab_size = len(tiny_tokenizer()) - 1
    model.config.save_pretrained(small)
    with pytest.raises(ValueError, match="more than the model's vocabulary"):
        load_model(str(small), "float32", "cpu", tokenizer=str(embedded_model_dir()), load_format="dummy")
    tiny_tokenizer().save_pretrained(tmp_path)
    positions = model.config.max_position_embeddings
    with pytest.raises(ValueError, match="longer than the model's positions"):
        load(ModelConfig(model=str(tmp_path), device="cpu", dtype="float32", max_model_len=positions + 1))


def _with_added_token(special: bool):
    tokenizer = copy.deepcopy(tiny_tokenizer())
    if special:
        tokenizer.add_special_tokens({"additional_special_tokens": ["<image_soft_token>"]})
    else:
        tokenizer.add_tokens(["<image_soft_token>"])
    return tokenizer


def test_an_added_special_token_past_the_vocabulary_is_taken_and_a_prompt_holding_it_refused(tmp_path):
    """Gemma 3's tokenizer carries its image models' `<image_soft_token>` one past the text
    models' vocabulary: the model loads, and only a prompt that holds it is a 400."""
    model = tiny_model("gemma3_text")
    model.save_pretrained(tmp_path)
    _with_added_token(special=True).save_pretrained(tmp_path)
    loaded, tokenizer, _ = load_model(str(tmp_path), "float32", "cpu")
    assert len(tokenizer) == loaded.config.vocab_size + 1
    with TestClient(tiny_app("gemma3_text", model=loaded, tokenizer=tokenizer)) as client:
        def chat(text, **extra):
            return client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 3, **extra,
                                                            "messages": [{"role": "user", "content": text}]})
        assert chat("Hello").status_code == 200
        assert chat("Hello", response_format={"type": "json_object"}).status_code == 200
        refused = chat("Look: <image_soft_token>")
        assert refused.status_code == 400 and "'<image_soft_token>', id 400" in refused.json()["error"]["message"]
        for grammar in ("start: <[400]>", "start: <image_soft_token>"):  # a first token the model cannot write
            refused = chat("Hello", guided_grammar=grammar)
            assert refused.status_code == 400 and "none the model can write" in refused.json()["error"]["message"]
    _with_added_token(special=False).save_pretrained(tmp_path)  # a plain token past it is text the model cannot read
    with pytest.raises(ValueError, match="'<image_soft_token>' past it"):
        load_model(str(tmp_path), "float32", "cpu")


@pytest.mark.parametrize("setting", [{"final_logit_softcapping": 30.0}, {"attn_logit_softcapping": 50.0},
                                     {"use_bidirectional_attention": True}])
def test_a_setting_the_engine_does_not_apply_is_refused(tmp_path, setting):
    """Gemma 2's soft-capping and EmbeddingGemma's bidirectional attention, on Gemma 3's family."""
    model = tiny_model("gemma3_text")
    for name, value in setting.items():
        setattr(model.config, name, value)
    model.save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=f"{next(iter(setting))} is not supported"):
        load_model(str(tmp_path), "float32", "cpu")


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
                         dtype="float32", device="cpu", max_model_len=512)
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


@pytest.fixture
def tiny_gguf(monkeypatch, tmp_path):
    """The embedded model's conversion, with a tiny model standing in for the GGUF's
    (the real conversion takes tens of seconds), into a cache of its own."""
    import transformers

    monkeypatch.setattr("engine.model_loader._embedded_gguf_dir", lambda: tmp_path / "gguf")
    monkeypatch.setenv("ALCHEMIST_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: tiny_model("llama"))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tiny_tokenizer())
    return tmp_path / "cache" / "models" / EMBEDDED_MODEL_NAME


def test_a_cached_model_directory_without_its_config_is_converted_again(tiny_gguf):
    tiny_gguf.mkdir(parents=True)
    (tiny_gguf / "tokenizer.json").write_text("{}")  # what a replica of rank 1 once left there
    assert embedded_model_dir() == tiny_gguf
    assert (tiny_gguf / "config.json").exists() and list(tiny_gguf.glob("*.safetensors"))
    assert load_model(str(tiny_gguf), "float32", "cpu")[0].config.num_hidden_layers == 2


def test_processes_starting_together_convert_the_embedded_model_once(tiny_gguf, monkeypatch):
    import threading

    import transformers

    conversions, convert = [], transformers.AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained",
                        lambda *args, **kwargs: conversions.append(1) or convert(*args, **kwargs))
    found = []
    starts = [threading.Thread(target=lambda: found.append(embedded_model_dir())) for _ in range(3)]
    for start in starts:
        start.start()
    for start in starts:
        start.join()
    assert found == [tiny_gguf] * 3 and len(conversions) == 1


def test_a_conversion_that_writes_no_model_is_refused_and_leaves_no_directory(tiny_gguf, monkeypatch):
    import transformers

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", lambda self, *a, **k: None)  # rank ≠ 0
    with pytest.raises(RuntimeError, match="no config or weights"):
        embedded_model_dir()
    assert not tiny_gguf.exists() and [p.name for p in tiny_gguf.parent.iterdir()] == [f".{EMBEDDED_MODEL_NAME}.lock"]


def test_a_replica_converts_the_embedded_model_before_it_joins_its_group(monkeypatch):
    import server.replicas
    import server.serve
    from server.cli import main

    calls = []
    monkeypatch.setattr("engine.model_loader.embedded_model_dir", lambda: calls.append("convert"))
    monkeypatch.setattr(server.replicas, "die_with_parent", lambda: calls.append("die with the agent"))
    monkeypatch.setattr(server.replicas, "join_group", lambda replica, device: calls.append("join"))
    monkeypatch.setattr(server.serve, "run_replica", lambda config, replica: calls.append("serve"))
    for name, value in {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", "--device", "cpu", "--data-parallel-size", "2"]) == 0
    assert calls == ["die with the agent", "convert", "join", "serve"]
