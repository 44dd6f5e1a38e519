"""Groups over HTTP on a tiny model: n choices from one prefill, GRPO rewards and their
errors in OpenAI's format, the reward function, DPO between served choices, metrics."""

import sys
import types

import pytest
from fastapi.testclient import TestClient

from tests.servers import TINY_NAME, tiny_app, wait_for
from tests.test_feedback import metric
from trainer.config import TrainConfig


def group_chat(client, n=4, **extra):
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 6, "temperature": 1.0, "n": n,
                                                  "seed": 3, "messages": [{"role": "user", "content": "Hi there"}],
                                                  **extra})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == n
    return r.json()["id"]


@pytest.fixture(scope="module")
def grpo_client():
    with TestClient(tiny_app(train=TrainConfig(mode="grpo", lora_rank=4))) as client:
        yield client


def test_rewards_are_accepted_once_and_the_group_is_trained(grpo_client):
    completion = group_chat(grpo_client)
    r = grpo_client.post("/v1/feedback", json={"id": completion, "rewards": [1, 0, 0.5, 0]})
    assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
    r = grpo_client.post("/v1/feedback", json={"id": completion, "rewards": [1, 0, 0.5, 0]})
    assert r.status_code == 409 and r.json()["error"]["code"] == "label_exists"
    wait_for(lambda: metric(grpo_client, 'alchemist:trained_entries_total{mode="grpo",path="reuse"}') >= 1)
    assert metric(grpo_client, "alchemist:rewarded_groups_total") >= 1
    assert metric(grpo_client, "alchemist:reward_count") >= 4
    assert metric(grpo_client, "alchemist:reward_sum") >= 1.5


def test_equal_rewards_answer_skipped_and_are_counted(grpo_client):
    completion = group_chat(grpo_client)
    before = metric(grpo_client, "alchemist:zero_advantage_groups_total")
    r = grpo_client.post("/v1/feedback", json={"id": completion, "rewards": [1, 1, 1, 1]})
    assert r.status_code == 200 and r.json()["status"] == "skipped", r.text
    assert metric(grpo_client, "alchemist:zero_advantage_groups_total") == before + 1


@pytest.mark.parametrize("body, status, param", [
    ({"rewards": [1, 0, 0]}, 400, "rewards"),            # one per choice
    ({"rewards": []}, 400, "rewards"),
    ({"rewards": ["1", 0, 0, 0]}, 400, "rewards[0]"),    # numbers only
    ({"rewards": [0, True, True, 0]}, 400, "rewards[1]"),  # the first item at fault, not the last
    ({"chosen": "Paris."}, 400, "rewards"),              # a preference on a GRPO server
    ({"rewards": [1, 0, 0, 0], "chosen_index": 1}, 400, "chosen_index"),
])
def test_malformed_rewards_are_400_with_the_field_at_fault(grpo_client, body, status, param):
    completion = group_chat(grpo_client)
    r = grpo_client.post("/v1/feedback", json={"id": completion, **body})
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param and r.json()["error"]["type"] == "invalid_request_error"


def test_not_a_group_is_400_and_unknown_is_404(grpo_client):
    single = group_chat(grpo_client, n=1)
    r = grpo_client.post("/v1/feedback", json={"id": single, "rewards": [1.0]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "id"
    assert r.json()["error"]["code"] == "not_a_group"
    r = grpo_client.post("/v1/feedback", json={"id": "chatcmpl-nope", "rewards": [1.0, 0.0]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "id"


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_rewards_are_refused(grpo_client, literal):
    completion = group_chat(grpo_client, n=2)
    r = grpo_client.post("/v1/feedback", content=f'{{"id": "{completion}", "rewards": [{literal}, 0]}}',
                         headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] in ("rewards", "rewards[0]"), r.text


def test_a_reward_function_in_the_server_rewards_each_group():
    module = types.ModuleType("http_test_rewards")
    module.seen = []

    def by_length(prompt, responses):
        module.seen.append(prompt)
        return [float(len(r)) for r in responses]

    module.by_length = by_length
    sys.modules[module.__name__] = module
    try:
        train = TrainConfig(mode="grpo", lora_rank=4, reward_function="http_test_rewards:by_length")
        with TestClient(tiny_app(train=train)) as client:
            group_chat(client)
            wait_for(lambda: metric(client, "alchemist:rewarded_groups_total") >= 1)
            assert module.seen == [[{"role": "user", "content": "Hi there"}]]  # the messages, as sent
            r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Once upon a time", "n": 2,
                                                     "max_tokens": 4, "temperature": 1.0, "seed": 1})
            assert r.status_code == 200, r.text
            wait_for(lambda: metric(client, "alchemist:rewarded_groups_total") >= 2)
            assert module.seen[1] == "Once upon a time"  # the text, as sent
            for body in ({"max_tokens": 4, "n": 2, "train": False}, {"max_tokens": 4, "n": 1}):  # never scored
                r = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": "Hello", **body})
                assert r.status_code == 200, r.text
            recorder = client.app.state.alchemist.training.recorder
            # what the recorder keeps of a request lives from its admission to its last output
            assert not recorder._client_prompts and not recorder._responses and len(module.seen) == 2
            assert metric(client, "alchemist:reward_errors_total") == 0
            # feedback_total counts what clients sent: none here
            assert metric(client, 'alchemist:feedback_total{status="accepted"}') == 0
            assert metric(client, "alchemist:reward_count") == 4 + 2  # yet the groups' rewards are counted
    finally:
        del sys.modules[module.__name__]


def test_dpo_between_two_served_choices():
    with TestClient(tiny_app(train=TrainConfig(mode="dpo", lora_rank=4))) as client:
        completion = group_chat(client, n=3)
        r = client.post("/v1/feedback", json={"id": completion, "chosen_index": 3, "rejected_index": 0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chosen_index"
        # a text against an index: the form that says it is named; choice_index beside two indices is refused
        r = client.post("/v1/feedback", json={"id": completion, "chosen": "A better answer.", "rejected_index": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "chosen", r.text
        assert "'choice_index': i" in r.json()["error"]["message"]
        r = client.post("/v1/feedback", json={"id": completion, "chosen_index": 1, "rejected_index": 0,
                                              "choice_index": 2})
        assert r.status_code == 400 and r.json()["error"]["param"] == "choice_index", r.text
        r = client.post("/v1/feedback", json={"id": completion, "chosen_index": 2, "rejected_index": 0})
        assert r.status_code == 200, r.text
        r = client.post("/v1/feedback", json={"id": completion, "rewards": [1, 0, 0]})
        assert r.status_code in (400, 409)
        wait_for(lambda: metric(client, 'alchemist:trained_entries_total{mode="dpo",path="reuse"}') >= 1)
