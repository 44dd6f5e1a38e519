"""Sampling defaults from the model's generation config (vLLM's `--generation-config`): a
request that leaves a sampling field out gets the model's value, one that sends it keeps
its own; `vllm` gives OpenAI's defaults; the embedded model gets its model card's."""

import dataclasses
import json

import pytest
from fastapi.testclient import TestClient

from server.cli import build_parser, config_from_args
from server.generation_config import EMBEDDED_RECOMMENDED, sampling_defaults
from server.serve import build_server
from tests.conftest import make_config
from tests.servers import TINY_NAME
from tests.tiny import tiny_model, tiny_tokenizer

CHAT = {"model": TINY_NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2}
COMPLETION = {"model": TINY_NAME, "prompt": "Hi", "max_tokens": 2}


def model_with_generation_config(**fields):
    model = tiny_model()
    for name, value in fields.items():
        setattr(model.generation_config, name, value)
    return model


def app_for(model, generation_config: str = "auto"):
    config = make_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, generation_config=generation_config))
    return build_server(config, model=model, tokenizer=tiny_tokenizer(), model_name=TINY_NAME)


def served_params(app, client, path: str, body: dict):
    """The SamplingParams the engine was handed for one request."""
    engine = app.state.alchemist.engine
    seen = []
    make_request = engine.make_request

    def spy(request_id, prompt_ids, params, *args, **kwargs):
        seen.append(params)
        return make_request(request_id, prompt_ids, params, *args, **kwargs)

    engine.make_request = spy
    try:
        r = client.post(path, json=body)
    finally:
        engine.make_request = make_request
    assert r.status_code == 200, r.text
    return seen[-1]


@pytest.fixture(scope="module")
def served():
    app = app_for(model_with_generation_config(temperature=0.3, top_p=0.8, top_k=20))
    with TestClient(app) as client:
        yield app, client


def test_a_request_without_sampling_fields_gets_the_models_defaults(served):
    app, client = served
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", COMPLETION)):
        params = served_params(app, client, path, body)
        assert (params.temperature, params.top_p, params.top_k) == (0.3, 0.8, 20), path
        assert (params.min_p, params.repetition_penalty) == (0.0, 1.0)  # the model sets none: OpenAI's


def test_what_a_request_sends_wins(served):
    app, client = served
    params = served_params(app, client, "/v1/chat/completions", {**CHAT, "temperature": 0.0, "top_k": -1})
    assert (params.temperature, params.top_p, params.top_k) == (0.0, 0.8, -1)
    params = served_params(app, client, "/v1/completions", {**COMPLETION, "temperature": 1.0, "top_p": 1.0})
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, 20)


def test_generation_config_vllm_gives_openais_defaults():
    config = config_from_args(build_parser().parse_args(["serve", "--generation-config", "vllm"]))
    assert config.model.generation_config == "vllm"
    app = app_for(model_with_generation_config(temperature=0.3, top_p=0.8), "vllm")
    with TestClient(app) as client:
        params = served_params(app, client, "/v1/chat/completions", CHAT)
    assert (params.temperature, params.top_p, params.top_k) == (1.0, 1.0, -1)


def test_a_model_without_sampling_settings_keeps_openais_defaults_and_the_embedded_one_its_cards():
    assert sampling_defaults("auto", tiny_model()) == {}  # a generation config with token ids only
    assert sampling_defaults("auto", tiny_model(), embedded=True) == EMBEDDED_RECOMMENDED == \
        {"temperature": 0.2, "top_p": 0.9}
    assert sampling_defaults("vllm", tiny_model(), embedded=True) == {}


def test_a_folder_gives_its_generation_config_and_a_bad_one_is_a_config_error(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.7, "repetition_penalty": 1.1, "bos_token_id": 1}))
    assert sampling_defaults(str(tmp_path), tiny_model()) == {"temperature": 0.7, "repetition_penalty": 1.1}
    with pytest.raises(ValueError, match="generation_config.json"):
        sampling_defaults(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="temperature"):  # refused at startup, not blamed on every request
        sampling_defaults("auto", model_with_generation_config(temperature=5.0))
