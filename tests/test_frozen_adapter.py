"""A saved adapter served frozen: `--adapter-dir` with training off serves the newest good
version (or `--adapter-version N`) merged into the weights; `--lora-modules name=DIR`
serves a PEFT directory made elsewhere; /v1/models and /v1/adapters say which."""

import copy

import pytest
import torch
from fastapi.testclient import TestClient

from tests.servers import TINY_NAME, tiny_app
from tests.test_adapter_lifecycle import TRAIN, complete, serve_and_train
from trainer.config import AdapterConfig, TrainConfig
from trainer.frozen import merge_frozen_adapter


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """An adapter directory with versions 0 (untrained), 2 and 3, and what each served."""
    root = tmp_path_factory.mktemp("adapter")
    adapter = AdapterConfig(dir=str(root), save_every=2, keep=10)
    with TestClient(tiny_app(train=TRAIN, adapter=adapter)) as client:
        base = complete(client)
        serve_and_train(client, [f"prompt number {i} about cats" for i in range(3)])
        final = complete(client)
    assert base != final  # training changed what is served
    return root, base, final


def test_training_off_serves_the_newest_version_frozen(trained):
    root, base, final = trained
    in_progress = root / ".tmp-another-process-saving"  # a trainer elsewhere writing a version
    in_progress.mkdir()
    with TestClient(tiny_app(adapter=AdapterConfig(dir=str(root)))) as client:
        assert in_progress.is_dir()  # a frozen server only reads the directory
        assert client.app.state.alchemist.training is None
        assert complete(client) == final
        card = client.get(f"/v1/models/{TINY_NAME}").json()
        assert card["adapter"] == {"version": 3, "path": str(root / "v00000003"), "frozen": True}
        status = client.get("/v1/adapters").json()
        assert status["version"] == 3 and status["frozen"] and status["mode"] == "off"
        r = client.post("/v1/feedback", json={"id": "x", "chosen": "y"})
        assert r.status_code == 400  # frozen: nothing trains
        r = client.post("/v1/adapters/rollback", json={"version": 0})  # (an outside pass: "there is no adapter")
        assert r.status_code == 400 and "serves adapter version 3 frozen" in r.json()["error"]["message"], r.text


def test_adapter_version_picks_an_older_one(trained):
    root, base, _ = trained
    with TestClient(tiny_app(adapter=AdapterConfig(dir=str(root), version=0))) as client:
        assert complete(client) == base  # version 0 is the untrained (zero) adapter
        assert client.get("/v1/adapters").json()["version"] == 0


def test_lora_modules_serves_a_peft_directory_under_its_name(trained):
    root, _, final = trained
    with TestClient(tiny_app(adapter=AdapterConfig(lora_module=f"cats={root / 'v00000003'}"))) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "cats"
        r = client.post("/v1/completions", json={"model": "cats", "prompt": "the quick brown fox", "max_tokens": 8,
                                                 "temperature": 0})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == final
        assert client.get("/v1/adapters").json()["name"] == "cats"


def test_bad_frozen_adapters_are_clear_startup_errors(tmp_path):
    with pytest.raises(ValueError, match="no saved adapter version loads"):
        tiny_app(adapter=AdapterConfig(dir=str(tmp_path)))
    with pytest.raises(ValueError, match="no such directory"):
        tiny_app(adapter=AdapterConfig(dir=str(tmp_path / "missing")))
    with pytest.raises(ValueError, match="no PEFT adapter there"):
        tiny_app(adapter=AdapterConfig(lora_module=f"x={tmp_path}"))
    with pytest.raises(ValueError, match="name=DIR"):
        AdapterConfig(lora_module="nodir")
    with pytest.raises(ValueError, match="training off"):
        tiny_app(train=TrainConfig(mode="dpo", lora_rank=4), adapter=AdapterConfig(lora_module=f"x={tmp_path}"))


def test_an_adapter_on_a_tied_head_changes_the_head_alone(tmp_path):
    """A PEFT adapter on `lm_head` of a model that ties it to the input embeddings (an outside
    pass): merged into the shared weight, it changed the embeddings too, and the served
    log-probs were not PEFT's. The adapted layer gets a weight of its own before merging."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True)).eval()
    assert model.lm_head.weight is model.get_input_embeddings().weight
    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                              target_modules=["q_proj", "lm_head"]))
    adapted.save_pretrained(tmp_path)
    ids = torch.tensor([[1, 5, 7, 11, 13]])
    with torch.no_grad():
        expected = adapted(ids).logits
        merged, served = merge_frozen_adapter(copy.deepcopy(model), AdapterConfig(lora_module=f"x={tmp_path}"))
        torch.testing.assert_close(merged(ids).logits, expected)
    assert served.name == "x"
    assert torch.equal(merged.get_input_embeddings().weight, model.get_input_embeddings().weight)
