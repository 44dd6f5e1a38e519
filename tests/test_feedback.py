"""POST /v1/feedback and online training through HTTP, on a tiny model."""

import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from trainer.config import TrainConfig
from trainer.feedback import FeedbackLabel
from trainer.status import Forgotten
from tests.conftest import make_training
from tests.servers import TINY_NAME, ServerThread, tiny_app, wait_for
from tests.test_training import serve


def train_app(mode: str, **train_kwargs):
    return tiny_app(train=TrainConfig(mode=mode, lora_rank=4, **train_kwargs))


def chat(client, content="What is the capital of France?", **extra):
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 6, "temperature": 0,
                                                  "messages": [{"role": "user", "content": content}], **extra})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def metric(client, name: str) -> float:
    for line in client.get("/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.split()[-1])
    raise KeyError(name)


@pytest.fixture(scope="module")
def dpo_client():
    with TestClient(train_app("dpo")) as client:
        yield client


def feedback(client, **body):
    return client.post("/v1/feedback", json=body)


def test_feedback_is_accepted_once_and_trained_on(dpo_client):
    completion = chat(dpo_client)
    r = feedback(dpo_client, id=completion, chosen="Paris.")
    assert r.status_code == 200 and r.json()["status"] == "accepted"
    r = feedback(dpo_client, id=completion, rejected="Rome.")
    assert r.status_code == 409 and r.json()["error"]["code"] == "label_exists"
    wait_for(lambda: metric(dpo_client, 'alchemist:trained_entries_total{mode="dpo",path="reuse"}') >= 1)
    assert metric(dpo_client, "alchemist:adapter_version") >= 1
    assert metric(dpo_client, 'alchemist:feedback_total{status="accepted"}') >= 1
    r = feedback(dpo_client, id=completion, chosen="Lyon.")
    assert r.status_code == 409  # trained: its label exists


@pytest.mark.parametrize("body, status, param", [
    ({"id": "chatcmpl-nope", "chosen": "x"}, 404, "id"),
    ({"chosen": "x"}, 400, "id"),
    ({"id": "x"}, 400, "chosen"),
    ({"id": "x", "chosen": ""}, 400, "chosen"),
    ({"id": "x", "chosen": 5}, 400, "chosen"),
    ({"id": "x", "chosen": "a", "choice_index": -1}, 400, "choice_index"),
    ({"id": "x", "chosen": "a", "extra": 1}, 400, "extra"),
    ({"id": "x" * 100_000, "chosen": "a"}, 400, "id"),  # no id of this server's (it was echoed back whole in a 404)
])
def test_bad_feedback_gets_openai_errors(dpo_client, body, status, param):
    outcome = "unknown" if status == 404 else "invalid"
    before = metric(dpo_client, f'alchemist:feedback_total{{status="{outcome}"}}')
    r = feedback(dpo_client, **body)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param
    # counted by outcome, also a body refused before it reached the trainer (a wrong type, an unknown field)
    assert metric(dpo_client, f'alchemist:feedback_total{{status="{outcome}"}}') == before + 1


def test_a_body_that_is_not_json_is_counted_as_invalid_feedback(dpo_client):
    before = metric(dpo_client, 'alchemist:feedback_total{status="invalid"}')
    r = dpo_client.post("/v1/feedback", content=b"not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    assert metric(dpo_client, 'alchemist:feedback_total{status="invalid"}') == before + 1


def test_feedback_edge_cases(dpo_client):
    completion = chat(dpo_client, "Tell me something.")
    r = feedback(dpo_client, id=completion, chosen="a", choice_index=3)
    assert r.status_code == 400 and r.json()["error"]["param"] == "choice_index"
    r = feedback(dpo_client, id=completion, chosen="a", rejected="b", choice_index=3)  # both texts: checked too
    assert r.status_code == 400 and r.json()["error"]["param"] == "choice_index", r.text
    r = feedback(dpo_client, id=completion, chosen="same", rejected="same")
    assert r.status_code == 400
    opted_out = chat(dpo_client, "Do not learn from this.", train=False)
    r = feedback(dpo_client, id=opted_out, chosen="x")  # served with "train": false: never trained on
    assert r.status_code == 400 and r.json()["error"]["code"] == "not_trainable"
    r = dpo_client.post("/v1/feedback", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400


@pytest.mark.parametrize("tokenized_as_served", [False, True])
@pytest.mark.parametrize("side", ["chosen", "rejected"])
def test_one_side_that_is_the_served_response_is_refused_as_a_pair_of_the_same(dpo_client, side, monkeypatch,
                                                                               tokenized_as_served):
    """The other side defaults to the served response: the same text on the given side made
    a pair that teaches nothing, and was accepted and exported (an outside pass); the answer
    names the side sent, also where its text tokenizes to the served ids (an answer that
    ended with the end of sequence: a second pass had "chosen" for either side)."""
    r = dpo_client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 6, "temperature": 0,
                                                      "messages": [{"role": "user", "content": f"Say {side}."}]})
    completion, served = r.json()["id"], r.json()["choices"][0]["message"]["content"]
    assert served
    intake = dpo_client.app.state.alchemist.training.feedback
    if tokenized_as_served:
        served_ids, tokenize = intake.cache.get(completion).responses[0], intake._response_ids
        monkeypatch.setattr(intake, "_response_ids", lambda text: list(served_ids) if text == served else
                            tokenize(text))
    r = feedback(dpo_client, id=completion, **{side: served})
    assert r.status_code == 400 and r.json()["error"]["param"] == side, r.text
    assert "served response" in r.json()["error"]["message"]
    assert feedback(dpo_client, id=completion, **{side: served + "!"}).status_code == 200


def test_the_text_read_of_an_answer_a_stop_string_ended_is_the_served_response_too(dpo_client):
    """A review: the served ids hold the stop string's tokens, which the client never read;
    its own text, sent back as one side, made a pair that taught the end of sequence
    against the stop string."""
    body = {"model": TINY_NAME, "max_tokens": 12, "temperature": 0, "messages": [{"role": "user", "content": "Go."}]}
    whole = dpo_client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    stop = whole[len(whole) // 2:][:2]
    r = dpo_client.post("/v1/chat/completions", json={**body, "stop": [stop]})
    completion, read = r.json()["id"], r.json()["choices"][0]["message"]["content"]
    assert r.json()["choices"][0]["stop_reason"] == stop and stop not in read
    r = feedback(dpo_client, id=completion, chosen=read)
    assert r.status_code == 400 and "served response" in r.json()["error"]["message"], r.text
    assert feedback(dpo_client, id=completion, chosen=read + " Better.").status_code == 200


def test_a_completion_of_several_prompts_takes_a_label_per_choice_as_its_response_numbers_them(dpo_client):
    """`/v1/completions` with a list of prompts answers with one id; choice i·n + j is
    prompt i's j-th: a label names it by `choice_index` (or a pair by their indices)."""
    r = dpo_client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["One", "Two", "Three"], "n": 2,
                                                 "max_tokens": 4, "temperature": 1.0, "seed": 0})
    assert r.status_code == 200, r.text
    completion = r.json()["id"]
    assert [c["index"] for c in r.json()["choices"]] == list(range(6))
    assert feedback(dpo_client, id=completion, chosen="A better answer.", choice_index=3).status_code == 200
    r = feedback(dpo_client, id=completion, rejected="Worse.", choice_index=2)  # prompt 1's other choice
    assert r.status_code == 409 and r.json()["error"]["code"] == "label_exists"
    r = feedback(dpo_client, id=completion, chosen_index=0, rejected_index=2)
    assert r.status_code == 400 and r.json()["error"]["param"] == "rejected_index", r.text
    r = feedback(dpo_client, id=completion, chosen="x", choice_index=6)
    assert r.status_code == 400 and r.json()["error"]["param"] == "choice_index", r.text
    r = feedback(dpo_client, id=completion, chosen_index=5, rejected_index=4)  # prompt 2's two choices
    assert r.status_code == 200 or "same response" in r.json()["error"]["message"], r.text  # (two equal samples)
    assert feedback(dpo_client, id=completion, rejected="Worse.").status_code == 200  # choice 0: prompt 0
    r = feedback(dpo_client, id=f"{completion}-0", chosen="x")
    assert r.status_code == 409 and r.json()["error"]["code"] == "label_exists"


def test_a_list_of_one_prompt_takes_its_label_by_its_own_id_or_as_prompt_0(dpo_client):
    """Its entry is the completion's own id (no batch); an outside pass's client, which
    names a list's prompt i as `<id>-<i>`, got 404 for `<id>-0`."""
    for label_id in ("{}", "{}-0"):
        r = dpo_client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["Once upon"], "max_tokens": 4})
        completion = r.json()["id"]
        r = feedback(dpo_client, id=label_id.format(completion), chosen="a time.")
        assert r.status_code == 200, r.text
        again = feedback(dpo_client, id=completion, chosen="a time.")  # the completion's label, whichever id named it
        assert again.status_code == 409 and again.json()["error"]["code"] == "label_exists", again.text
    assert feedback(dpo_client, id=f"{completion}-1", chosen="a time.").status_code == 404  # no prompt 1


def test_feedback_after_the_label_timeout_is_404():
    with TestClient(train_app("dpo", label_timeout_s=0.2)) as client:
        completion = chat(client)
        wait_for(lambda: metric(client, 'alchemist:activation_cache_ended_entries_total{state="expired"}') >= 1)
        r = feedback(client, id=completion, chosen="Paris.")
        assert r.status_code == 404 and "expired" in r.json()["error"]["message"]
        assert metric(client, "alchemist:activation_cache_bytes") == 0
        batch = client.post("/v1/completions", json={"model": TINY_NAME, "prompt": ["One", "Two"],
                                                     "max_tokens": 3}).json()["id"]
        wait_for(lambda: metric(client, 'alchemist:activation_cache_ended_entries_total{state="expired"}') >= 3)
        for index in (0, 1):  # every prompt's entry expired: said so, whichever choice is named
            r = feedback(client, id=batch, chosen="x", choice_index=index)
            assert r.status_code == 404 and "expired" in r.json()["error"]["message"], r.text


def test_entries_expire_while_the_engine_never_idles():
    """Expiry must not wait for an idle gap: under steady load (no gap, so no training
    under the idle policy) the cache would otherwise fill with entries nobody labels."""
    app = tiny_app(max_model_len=4096, kv_cache_bytes=16 << 20,
                   train=TrainConfig(mode="dpo", lora_rank=4, label_timeout_s=0.3))
    engine = app.state.alchemist.engine
    with ServerThread(app) as server:
        body = {"model": TINY_NAME, "prompt": "keep busy", "max_tokens": 3000, "ignore_eos": True, "train": False}
        busy = threading.Thread(target=lambda: httpx.post(f"{server.url}/v1/completions", json=body, timeout=300))
        busy.start()
        wait_for(lambda: engine.engine.num_requests == 1)
        idle_before = engine.idle_hook.stats.idle_slices
        r = httpx.post(f"{server.url}/v1/chat/completions", timeout=300,
                       json={"model": TINY_NAME, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]})
        completion = r.json()["id"]
        trainer = app.state.alchemist.training
        wait_for(lambda: trainer.cache.get(completion) is None)  # it may be gone already on a slow machine
        assert trainer.cache.ended_state(completion).value == "expired" and trainer.cache.bytes == 0
        assert engine.engine.num_requests == 1 and engine.idle_hook.stats.idle_slices == idle_before  # never idle
        engine.abort(next(iter(engine.engine.request_ids())))
        busy.join(30)


def test_cpt_trains_on_every_served_prompt_and_feedback_is_refused():
    with TestClient(train_app("cpt")) as client:
        for i in range(3):
            chat(client, f"Fact number {i}: the sky is green.")
        wait_for(lambda: metric(client, 'alchemist:trained_entries_total{mode="cpt",path="reuse"}') == 3)
        assert metric(client, "alchemist:adapter_version") >= 1
        assert metric(client, "alchemist:train_tokens_total") > 0
        assert metric(client, "alchemist:activation_cache_entries" + '{state="ready"}') == 0
        r = feedback(client, id="whatever", chosen="x")
        assert r.status_code == 400 and r.json()["error"]["code"] == "feedback_not_used"


def test_feedback_without_training_is_a_clear_400():
    with TestClient(tiny_app()) as client:
        r = feedback(client, id="x", chosen="y")
        assert r.status_code == 400 and "training is off" in r.json()["error"]["message"]
        for route in ("/v1/feedback/x", "/v1/chat/completions/x"):  # nothing is kept: OpenAI's 404 for an id
            r = client.delete(route)
            assert r.status_code == 404 and "keeps no completions" in r.json()["error"]["message"], r.text


def test_a_label_reaches_a_prompt_of_a_batch_whose_first_prompt_the_cache_no_longer_remembers():
    """A busy server forgets entries that ended long ago: the batch's prompt 1, still
    waiting, takes its label though prompt 0 is forgotten (here: never served)."""
    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    serve(training, "cmpl-z-1")
    assert training.feedback.submit(FeedbackLabel("cmpl-z", "A better answer.", None, 1)).accepted
    assert training.cache.get("cmpl-z-1").label is not None
    training.close()


def test_a_deletion_that_comes_after_its_labels_step_is_a_409_that_says_so():
    """DELETE /v1/feedback/{id} while the label trains, when its step could not be stopped
    (applied meanwhile, or combined across replicas): the client is told the label is in
    the adapter, not 200 nor 404."""
    with TestClient(tiny_app(train=TrainConfig(mode="dpo", lora_rank=4))) as client:
        training = client.app.state.alchemist.training
        training.forget = lambda completion_id, label_only=False: Forgotten(True, [completion_id])
        training.withdraw_from_training = lambda completion_ids: list(completion_ids)
        r = client.delete("/v1/feedback/chatcmpl-x")
        assert r.status_code == 409 and r.json()["error"]["code"] == "label_in_training", r.text
        assert "in the adapter from the next version on" in r.json()["error"]["message"]
        training.withdraw_from_training = lambda completion_ids: []  # withdrawn from its job
        assert client.delete("/v1/feedback/chatcmpl-x").status_code == 200


@pytest.mark.parametrize("served_end", ["end-of-turn", "cut"])
def test_a_labels_text_ends_as_the_served_response_did(served_end):
    """A chat's end of turn need not be the tokenizer's `eos_token` (Gemma's `<end_of_turn>`,
    Llama 3's `<|eot_id|>` under a base tokenizer): a text label ended with the tokenizer's,
    so a pair of one text and the served response taught one ending against the other. It
    ends with the token the served response ended with, where that was one of the model's
    end tokens; else (cut by `max_tokens`) with the tokenizer's."""
    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    eos = training.feedback.tokenizer.eos_token_id
    end_of_turn = next(i for i in range(3, 100) if i != eos)
    training.feedback.end_token_ids = frozenset({eos, end_of_turn})
    served = serve(training, "r")
    entry = training.cache.get("r")
    if served_end == "end-of-turn":
        entry.responses[0][-1] = end_of_turn
    assert training.feedback.submit(FeedbackLabel("r", "Paris is the capital.", None, 0)).accepted
    chosen, rejected = entry.label.chosen, entry.label.rejected
    assert rejected == entry.responses[0] and rejected[:-1] == served[:-1]
    assert chosen[-1] == (end_of_turn if served_end == "end-of-turn" else eos)
    assert chosen[:-1] == training.feedback.tokenizer("Paris is the capital.", add_special_tokens=False)["input_ids"]
    training.close()
