"""End to end: the embedded model learns from what it serves, through HTTP alone."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench.launch import running_server
from tests.test_e2e_embedded import MODEL

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "learn_a_fact.py"


def load_example():
    spec = importlib.util.spec_from_file_location("learn_a_fact", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpt_serving_a_made_up_fact_raises_its_log_likelihood_by_several_nats():
    example = load_example()
    with running_server("--train-mode", "cpt", "--learning-rate", "1e-4") as url:
        before = example.fact_logprob(url, MODEL)
        out = subprocess.run([sys.executable, str(EXAMPLE), "--url", url, "--rounds", "12"], capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr
        after = example.fact_logprob(url, MODEL)
        assert example.get_metric(url, "alchemist:adapter_version") >= 12
    assert after - before >= 3.0, (before, after)


def test_dpo_feedback_is_trained_on():
    with running_server("--train-mode", "dpo") as url:
        client = httpx.Client(base_url=url, timeout=120)
        reply = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 16, "temperature": 0,
                                                          "messages": [{"role": "user", "content":
                                                                        "What is the capital of France?"}]}).json()
        # greedy, the model answers "The capital of France is Paris."; the user prefers more
        chosen = "Paris, capital of France since the tenth century, on the Seine."
        assert reply["choices"][0]["message"]["content"] != chosen
        r = client.post("/v1/feedback", json={"id": reply["id"], "chosen": chosen})
        assert r.status_code == 200, r.text
        example = load_example()
        import time
        deadline = time.time() + 600  # generous: a loaded CI machine is slow
        while example.get_metric(url, "alchemist:adapter_version") < 1:
            assert time.time() < deadline
            time.sleep(0.1)
        metrics = client.get("/metrics").text
        assert 'alchemist:trained_entries_total{mode="dpo",path="reuse"} 1.0' in metrics


@pytest.mark.parametrize("reference", ["base", "served"])
def test_dpo_feedback_shifts_a_held_out_preference(reference):
    """examples/learn_a_preference.py: feedback that prefers answers opened by a marker
    raises the marker's log-probability on questions never trained on, with either DPO
    reference (24 rounds: +5.2 nats both; BENCHMARKS.md)."""
    spec = importlib.util.spec_from_file_location("learn_a_preference", EXAMPLE.with_name("learn_a_preference.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with running_server("--train-mode", "dpo", "--dpo-reference", reference) as url:
        before = example.held_out_logprob(url, MODEL)
        example.teach(url, MODEL, 12)
        after = example.held_out_logprob(url, MODEL)
    assert after - before >= 1.5, (reference, before, after)


def test_grpo_rewards_raise_the_rewarded_opening_on_held_out_questions():
    """examples/learn_from_rewards.py: groups of 8 answers at temperature 1, reward 1 for
    an answer that opens with "The"; the opening's log-probability rises on questions
    never trained on (BENCHMARKS.md)."""
    spec = importlib.util.spec_from_file_location("learn_from_rewards", EXAMPLE.with_name("learn_from_rewards.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with running_server("--train-mode", "grpo", "--learning-rate", "1e-3") as url:
        before = example.held_out_logprob(url, MODEL, example.OPENING)
        counts = example.teach(url, MODEL, 12)
        after = example.held_out_logprob(url, MODEL, example.OPENING)
        metrics = httpx.get(url + "/metrics", timeout=300).text
    assert counts["accepted"] >= 4, counts
    assert 'alchemist:trained_entries_total{mode="grpo",path="reuse"}' in metrics
    assert after - before >= 0.5, (before, after, counts)
