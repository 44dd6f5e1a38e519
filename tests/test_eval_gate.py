"""The eval gate: a candidate version is scored on the probes before it serves; serving stays
on the promoted version meanwhile; a poisoned batch is rejected (weights and optimizer
state back to the promoted ones, a new version number, its labels quarantined in the
ledger, the rollback counted) and benign feedback after it is promoted; a restart serves
the last promoted version; without an eval set nothing changes."""

import dataclasses
import json

import jinja2
import pytest
import torch
from fastapi.testclient import TestClient
from peft import get_peft_model_state_dict

from server.cli import main
from tests.conftest import make_training, run_into_a_backward
from tests.servers import tiny_app
from tests.test_no_label_lost import metric
from tests.test_stash import live_weights, load_weights, stashed_gradients
from tests.test_training import gradients_of, label, serve
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.config import AdapterConfig, TrainConfig
from trainer.eval_set import EvalSetError, load_eval_set
from trainer.feedback import FeedbackLabel, FeedbackOutcome
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE, read_ledger, release_quarantined
from tests.tiny import tiny_tokenizer

PROMPT = "The capital of France is"
RIGHT, WRONG = " Paris, the city of light.", " Lyon, the city of silk."


def eval_set(tmp_path) -> str:
    path = tmp_path / "probes.jsonl"
    path.write_text(json.dumps({"prompt": PROMPT, "chosen": RIGHT, "rejected": WRONG}) + "\n"
                    + json.dumps({"prompt": "The capital of Italy is", "completion": " Rome."}) + "\n")
    return str(path)


def gated(tmp_path, **train):
    config = TrainConfig(mode="dpo", lora_rank=4, learning_rate=5e-2, entries_per_step=2, eval_set=eval_set(tmp_path),
                         eval_tolerance=2.0, **train)
    checkpointer = AdapterCheckpointer(AdapterStore(tmp_path / "adapters"), save_every=1)
    return make_training(config, checkpointer=checkpointer, ledger=Ledger(tmp_path / "adapters" / LEDGER_FILE))


def labelled_batch(training, prefix: str, chosen: str, rejected: str) -> list[str]:
    ids = [f"{prefix}{i}" for i in range(2)]
    for request_id in ids:
        serve(training, request_id, prompt=PROMPT)
        result = training.feedback.submit(FeedbackLabel(request_id, chosen, rejected))
        assert result.accepted, result
    return ids


def logits(training) -> torch.Tensor:
    ids = torch.tensor([tiny_tokenizer()(PROMPT)["input_ids"]])
    with torch.inference_mode():
        return training.peft_model(ids).logits


def run_until_pending(training) -> None:
    while not (training.gate.pending and training.gate.candidate_version is not None):
        assert training.run_slice(), "no candidate came"


@pytest.mark.parametrize("merged_serving", [True, False])
def test_a_poisoned_batch_is_rejected_and_quarantined_and_benign_feedback_after_it_is_promoted(tmp_path,
                                                                                              merged_serving):
    """With merged serving weights (the CPU's default) and without (serving from the
    adapter's serving copy, as a GPU does): serving is pinned to the promoted version."""
    training = gated(tmp_path, merged_serving=merged_serving)
    assert all(layer._merged_pack is None for layer in training.gate.layers) != merged_serving
    gate = training.gate
    baseline = gate.promoted
    assert baseline.version == 0 and baseline.preference_margin is not None and baseline.completion_logprob is not None
    served_before = logits(training)
    promoted_weights = {k: v.clone() for k, v in get_peft_model_state_dict(training.peft_model).items()}

    poisoned = labelled_batch(training, "bad", WRONG, RIGHT)
    run_until_pending(training)
    assert training.optimizer.version == 1 and training.status().adapter_version == 0
    assert torch.equal(logits(training), served_before)  # serving is pinned to the promoted weights
    training.train_until_idle()

    rejected = gate.last_rejected
    assert rejected is not None and rejected[0].version == 1 and "preference probes" in rejected[1][0]
    assert rejected[0].preference_margin < baseline.preference_margin - 2.0
    status = training.status()
    assert status.adapter_version == 2 and training.optimizer.version == 2  # the number 1 is spent
    live = get_peft_model_state_dict(training.peft_model)
    assert all(torch.equal(live[k], v) for k, v in promoted_weights.items())  # back to the promoted weights
    assert status.training.rollbacks == {"manual": 0, "eval_gate": 1} and status.training.quarantined_labels == 2
    training.ledger.flush()
    rows = {row.request.id: row for row in read_ledger(tmp_path / "adapters" / LEDGER_FILE)}
    assert all(rows[i].fate == "quarantined" and "rejected version 1" in rows[i].fate_reason for i in poisoned)
    again = training.feedback.submit(FeedbackLabel(poisoned[0], RIGHT, WRONG))  # what became of it, not "trained on"
    assert again.outcome is FeedbackOutcome.CONFLICT and "already has its label and is quarantined (" in \
        again.message and "rejected version 1" in again.message, again  # (and why)

    labelled_batch(training, "good", RIGHT, WRONG)
    training.train_until_idle()
    assert gate.promoted.version == 3 and training.status().adapter_version == 3
    assert gate.promoted.preference_margin > baseline.preference_margin
    assert not torch.equal(logits(training), served_before)  # serving moved to the promoted candidate
    training.lifecycle.checkpointer.wait()  # saves are written on a thread of their own
    saved = [v.version for v in training.lifecycle.saved_versions()]
    assert 1 not in saved and 3 in saved  # a rejected version is never saved
    state = json.loads((training.lifecycle.checkpointer.store.path_of(3) / "alchemist_state.json").read_text())
    assert state["gate"]["status"] == "promoted" and state["gate"]["scores"]["version"] == 3
    training.close()
    # quarantined labels can be released by hand: they train when the server next starts
    assert release_quarantined(tmp_path / "adapters" / LEDGER_FILE, poisoned[:1]) == poisoned[:1]
    assert main(["feedback", "release", "--adapter-dir", str(tmp_path / "adapters"), "nope"]) == 1  # said, not released
    again = gated(tmp_path, merged_serving=merged_serving)
    assert again.status().adapter_version == 3 and again.cache.get(poisoned[0]).state.value == "ready"
    assert again.cache.get(poisoned[1]) is None
    again.close()


def test_repeated_rejections_name_the_promoted_version_in_every_copy(tmp_path):
    """Each rejection saves a copy of the promoted weights. A copy used to name the copy
    before it, a chain; once the oldest copy was pruned the others counted as distinct, and
    the distinct versions went instead: an operator's review found five identical copies
    and no version 0 to roll back to after nine rejections. Each copy names version 0, so
    the store knows them for one version's weights (tests/test_adapter_directory.py)."""
    config = TrainConfig(mode="dpo", lora_rank=4, learning_rate=5e-2, entries_per_step=2, eval_set=eval_set(tmp_path),
                         eval_tolerance=2.0)
    store = AdapterStore(tmp_path / "adapters", keep=3)
    training = make_training(config, checkpointer=AdapterCheckpointer(store, save_every=1))
    for batch in range(4):
        labelled_batch(training, f"bad{batch}-", WRONG, RIGHT)
        training.train_until_idle()
        training.lifecycle.checkpointer.wait()
    assert training.status().training.rollbacks["eval_gate"] == 4
    saved = [v.version for v in training.lifecycle.saved_versions()]
    assert saved == [4, 6, 8]  # nothing else to keep: the newest holds version 0's weights, and stays
    for version in saved:
        assert json.loads((store.path_of(version) / "alchemist_state.json").read_text())["weights_of"] == 0
    training.close()


def test_a_label_deleted_while_its_candidate_is_scored_is_not_counted_as_quarantined(tmp_path):
    """The ledger drops it for good rather than quarantine it; the counter says so too."""
    training = gated(tmp_path)
    poisoned = labelled_batch(training, "bad", WRONG, RIGHT)
    run_until_pending(training)
    forgotten = training.forget(poisoned[0], label_only=True)
    assert forgotten.found and forgotten.trained_into == 1 and not forgotten.training
    training.train_until_idle()
    assert training.gate.last_rejected is not None and training.status().training.quarantined_labels == 1
    training.ledger.flush()
    rows = {row.request.id: row for row in read_ledger(tmp_path / "adapters" / LEDGER_FILE)}
    assert [(rows[i].fate, rows[i].fate_reason[:7]) for i in poisoned] == [("dropped", "deleted"),
                                                                           ("quarantined", "eval ga")]
    training.close()


def test_after_a_rollback_the_promoted_scores_are_unknown_until_its_weights_are_scored(tmp_path):
    """They read the replaced version's, labelled with the new number (an outside pass)."""
    training = gated(tmp_path)
    labelled_batch(training, "a", RIGHT, WRONG)
    training.train_until_idle()
    promoted = training.status().gate.last_promoted
    assert promoted["version"] == 1 and promoted["preference_margin"] is not None
    training.lifecycle.rollback(training.lifecycle.load_saved(0))
    scoring = training.status().gate.last_promoted
    assert scoring["version"] == 2 and (scoring["preference_margin"], scoring["kl"]) == (None, None)
    training.train_until_idle()
    scored = training.status().gate.last_promoted
    assert scored["version"] == 2 and scored["preference_margin"] != promoted["preference_margin"]
    training.close()


def test_a_prefill_served_while_a_candidate_is_scored_is_recorded_under_the_promoted_weights(tmp_path):
    """It is stamped with the promoted version, its recorded logits are the promoted
    weights', and its gradient is exactly the promoted weights' (the stash)."""
    training = gated(tmp_path)
    labelled_batch(training, "a", RIGHT, WRONG)
    promoted = live_weights(training)
    served_before = logits(training)
    run_until_pending(training)
    serve(training, "during", prompt=PROMPT)
    entry = training.cache.get("during")
    assert entry.recording is not None and entry.adapter_version == 0 and training.optimizer.version == 1
    assert torch.allclose(entry.recording.logits[-1], served_before[0, -1], atol=1e-5)
    label(training, "during", chosen=RIGHT, rejected=WRONG)
    stashed = stashed_gradients(training, entry, 0)
    candidate = live_weights(training)
    load_weights(training, promoted)
    fresh = gradients_of(training, training.method.recompute_job(entry, training.context))
    load_weights(training, candidate)
    # over all of them at once: with LoRA's B = 0, every A's gradient is zero
    difference = sum((stashed[k] - fresh[k]).norm() ** 2 for k in fresh) ** 0.5
    assert difference <= 1e-5 * sum(g.norm() ** 2 for g in fresh.values()) ** 0.5
    training.close()


@pytest.mark.parametrize("stale_weights", ["stashed", "live"])
def test_a_recording_made_while_a_candidate_is_scored_trains_on_it_once_the_candidate_is_promoted(tmp_path,
                                                                                                   stale_weights):
    """With "live" stale weights the promoted version's copies, which the recording saved,
    take the live values before its job: its backward reads them, it is not refused."""
    training = gated(tmp_path, stale_weights=stale_weights)
    labelled_batch(training, "a", RIGHT, WRONG)
    run_until_pending(training)
    serve(training, "during", prompt=PROMPT)
    label(training, "during", chosen=RIGHT, rejected=WRONG)
    assert training.stash.has(0)
    copies = training.stash._versions[0]  # what the recording saved: its gradient must not stay on them
    training.train_until_idle()
    assert all(copy.grad is None for copy in copies)
    assert training.optimizer.version >= 2 and not training.gate.pending  # its step was judged too
    assert training.stats.trained_entries == {("dpo", "reuse"): 2, ("dpo", "stashed"): 1}
    assert training.stats.failed_jobs == 0
    assert training.stash.versions == []  # freed with the last recording that needed it
    training.close()


def test_with_max_staleness_0_no_prefill_is_recorded_while_a_candidate_is_scored(tmp_path):
    """Nothing recorded under the promoted version could be trained on once the candidate
    is promoted: the request gets a label entry, stamped with the serving version."""
    training = gated(tmp_path, max_staleness=0)
    labelled_batch(training, "a", RIGHT, WRONG)
    run_until_pending(training)
    serve(training, "during", prompt=PROMPT)
    entry = training.cache.get("during")
    assert entry.recording is None and entry.adapter_version == 0
    training.close()


def test_over_http_the_adapter_route_and_metrics_show_the_gate(tmp_path):
    train = TrainConfig(mode="dpo", lora_rank=4, eval_set=eval_set(tmp_path))
    app = tiny_app(train=train, adapter=AdapterConfig(dir=str(tmp_path / "adapters")))
    with TestClient(app) as client:
        body = client.get("/v1/adapters").json()
        assert body["version"] == 0 and body["gate"]["candidate_version"] is None
        assert body["gate"]["last_promoted"]["version"] == 0 and body["gate"]["last_rejected"] is None
        assert metric(client, 'alchemist:adapter_rollbacks_total{reason="eval_gate"}') == 0
        assert metric(client, "alchemist:eval_runs_total") == 1
        assert metric(client, 'alchemist:eval_score{kind="preference_margin",version="promoted"}') != 0
        assert client.post("/v1/adapters/rollback", json={"version": 0}).status_code == 200
        assert metric(client, 'alchemist:adapter_rollbacks_total{reason="manual"}') == 1


def test_bad_eval_sets_are_refused_with_the_line_at_fault(tmp_path):
    path = tmp_path / "probes.jsonl"
    for text, message in (("", "no probes"), ("{", "not JSON"), ('{"prompt": "a"}', "'chosen' and 'rejected'"),
                          ('{"prompt": "a", "chosen": "b"}', "'chosen' and 'rejected'"),
                          ('{"chosen": "b", "rejected": "c"}', "'messages'"),
                          # (a review: a traceback, and errors that named no line)
                          ('{"messages": [{"content": "a"}], "completion": "b"}', "probes.jsonl:1: 'messages'"),
                          ('{"messages": [], "completion": "b"}', "probes.jsonl:1: 'messages' is a non-empty list"),
                          ('{"prompt": "a", "completion": "b"}\n{"prompt": "\udcff"}', "probes.jsonl:2: not UTF-8")):
        path.write_bytes(text.encode("utf-8", "surrogateescape"))
        with pytest.raises(EvalSetError, match=message):
            load_eval_set(path, tiny_tokenizer(), 256)

    class StrictTemplate:  # a template that cannot render a message without content (the embedded model's)
        def __getattr__(self, name):
            return getattr(tiny_tokenizer(), name)

        def apply_chat_template(self, *args, **kwargs):
            raise jinja2.exceptions.UndefinedError("'dict object' has no attribute 'content'")

    path.write_text('{"messages": [{"role": "user"}], "completion": "b"}')
    with pytest.raises(EvalSetError, match="probes.jsonl:1: the chat template cannot render these messages: 'dict"):
        load_eval_set(path, StrictTemplate(), 256)


def test_without_an_eval_set_every_version_serves_at_once(tmp_path):
    training = make_training(TrainConfig(mode="dpo", lora_rank=4))
    assert training.gate is None and training.status().gate is None
    labelled_batch(training, "a", RIGHT, WRONG)
    training.train_until_idle()
    assert training.status().adapter_version == training.optimizer.version >= 1


def test_a_version_that_cannot_be_scored_does_not_serve(tmp_path):
    training = gated(tmp_path)
    labelled_batch(training, "a", RIGHT, WRONG)
    run_until_pending(training)
    training.gate.probes = [dataclasses.replace(training.gate.probes[0], prompt_ids=[10 ** 9])]  # out of vocabulary
    training.train_until_idle()
    scores, failures = training.gate.last_rejected
    assert scores.version == 1 and failures[0].startswith("scoring failed")
    assert training.status().adapter_version == 2 and not training.gate.pending
    training.close()


def test_a_recording_admitted_under_weights_that_no_longer_serve_is_not_made(tmp_path):
    training = gated(tmp_path)
    spec = training.method.record_spec(0)
    assert training.recorder.confirm("r", [1, 2, 3], spec) is spec
    labelled_batch(training, "a", RIGHT, WRONG)
    run_until_pending(training)
    # a candidate is being scored: version 0 still serves, and its weights are stashed to record with
    assert training.recorder.confirm("r", [1, 2, 3], spec) is spec
    training.train_until_idle()
    assert training.status().adapter_version == 1
    assert training.recorder.confirm("s", [1, 2, 3], spec) is None  # version 0 no longer serves
    assert training.recorder.confirm("s", [1, 2, 3], training.method.record_spec(1)) is not None
    training.close()


def test_the_kl_is_zero_for_the_base_weights_and_its_cached_base_side_matches_a_fresh_one(tmp_path):
    """The KL sample keeps the base model's log-probs (float16) after their first use: with
    the adapter at zero (version 0) the KL is ~0, and a scoring from the cache gives what
    the scoring that computed them gave."""
    from trainer.adapter import adapters_disabled
    from trainer.eval_gate import KLSample

    train = TrainConfig(mode="dpo", lora_rank=4, learning_rate=5e-2, eval_set=eval_set(tmp_path), eval_tolerance=100)
    training = make_training(train)
    gate, ids = training.gate, tiny_tokenizer()(PROMPT)["input_ids"]
    gate.recent.append(KLSample.of(ids, [5, 6, 7, 8]))
    assert gate.score_now(0).kl == pytest.approx(0.0, abs=1e-3)
    labelled_batch(training, "a", RIGHT, WRONG)
    training.train_until_idle()  # the adapter moves off zero
    version = training.optimizer.version
    gate.recent.clear()
    gate.recent.append(KLSample.of(ids, [5, 6, 7, 8]))
    sample = gate.recent[0]
    first = gate.score_now(version).kl  # computes and keeps the base side
    assert sample.base_logp is not None and gate.score_now(version).kl == pytest.approx(first, rel=1e-6)
    with torch.inference_mode():  # the plain computation: both models' full forwards, in float32
        tokens = torch.tensor([sample.tokens])
        live = torch.log_softmax(training.peft_model(tokens).logits[0, sample.start:].float(), -1)
        with adapters_disabled(training.peft_model):
            base = torch.log_softmax(training.peft_model(tokens).logits[0, sample.start:].float(), -1)
    plain = float((live.exp() * (live - base)).sum(-1).mean())
    assert plain > 1e-3 and first == pytest.approx(plain, rel=1e-2)
    assert KLSample.of(ids, []).rows == 0 and KLSample.of(ids, [5, 6]).rows == 2


def test_a_job_dropped_while_a_candidate_waits_leaves_no_gradient_on_the_promoted_copies(tmp_path):
    """While a candidate waits for its verdict, prompts are recorded under the promoted
    version's stashed weights, and their backward lands gradients on those copies until
    the entry ends. A job dropped mid-backward (a rollback, a label deleted while it
    trains) drops those too: none reaches a later step."""
    training = gated(tmp_path)
    labelled_batch(training, "a", RIGHT, WRONG)
    run_until_pending(training)
    labelled_batch(training, "b", RIGHT, WRONG)  # recorded under the promoted version 0
    run_into_a_backward(training)
    assert training.trainer.abandon_job()
    training.stash.collect_gradients(0)  # what the dropped job left on version 0's copies, if anything
    assert all(p.grad is None for p in training.optimizer.params)
    training.close()


def test_a_rollback_whose_save_failed_is_carried_by_what_a_shutdown_saves_while_its_weights_are_scored(tmp_path):
    """With a gate, a shutdown while the rolled-back weights are still scored saves the
    promoted snapshot: it carries the rollback, so the labels it undid are quarantined
    (a review found them left `trained` in no weights)."""
    training = gated(tmp_path)
    for prefix in ("a", "b"):
        labelled_batch(training, prefix, RIGHT, WRONG)
        while training.run_slice():
            pass
    training.lifecycle.checkpointer.wait()
    store = training.lifecycle.checkpointer.store
    save = store.save

    def full_disk(snapshot):
        raise OSError("No space left on device")

    store.save = full_disk
    version = training.rollback(store.load(0))
    store.save = save
    assert training.gate.pending  # the rolled-back weights are being scored as the bar
    training.close()
    state = json.loads((store.path_of(version) / "alchemist_state.json").read_text())
    assert state["rollbacks"] == [[0, version]]
    fates = {row.request.id: row.fate for row in read_ledger(tmp_path / "adapters" / LEDGER_FILE)}
    assert set(fates.values()) == {"quarantined"}, fates
