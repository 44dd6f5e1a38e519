"""Metrics that tell the truth: gauges follow requests added and aborted (not only
steps), prefill time is measured, and vLLM's inter-token latency sits beside the
per-request time per output token."""

import dataclasses
import math
import time

import pytest

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import STEP_KINDS
from server.metrics import ServingMetrics, request_finish_reason
from tests.conftest import encode, make_engine
from tests.servers import TINY_NAME, tiny_app
from tests.test_feedback import metric
from fastapi.testclient import TestClient


def observed_engine():
    metrics = ServingMetrics(TINY_NAME)
    return make_engine(observers=(metrics,)), metrics


def value(gauge) -> float:
    return gauge._value.get()


def test_gauges_follow_adds_and_aborts_with_no_step_in_between():
    engine, metrics = observed_engine()
    engine.add_request("a", encode("Hello there"), SamplingParams(max_tokens=20, n=3))
    assert value(metrics.waiting) == 3  # choice 0 queued, two choices waiting to fork it
    engine.step()
    assert value(metrics.running) == 3 and value(metrics.waiting) == 0
    engine.abort_request("a")  # a client gone, nothing else running: no step follows
    assert value(metrics.running) == 0 and value(metrics.waiting) == 0 and value(metrics.kv_cache.usage) == 0


def test_inter_token_latency_per_output_and_time_per_output_token_per_request():
    engine, metrics = observed_engine()
    engine.add_request("a", encode("Hello there"), SamplingParams(max_tokens=5, min_tokens=5))
    while engine.has_unfinished():
        engine.step()
    assert metrics.itl._sum.get() > 0 and _count(metrics.itl) == 4  # between 5 tokens
    assert _count(metrics.tpot) == 1  # one finished request


def _count(histogram) -> int:
    return int(sum(bucket.get() for bucket in histogram._buckets))


def test_prefill_time_is_measured_over_http():
    with TestClient(tiny_app()) as client:
        r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert metric(client, "alchemist:request_prefill_time_seconds_count") == 1
        assert metric(client, "alchemist:request_prefill_time_seconds_sum") > 0
        assert metric(client, "alchemist:inter_token_latency_seconds_count") >= 1


def test_idle_seconds_grow_while_the_engine_idles_with_no_hook_to_wake_it():
    """Training off: the engine waits without a timeout, and its idle spell is counted as
    it goes, not all at once when a request ends it (a rate of zero, then a spike)."""
    with TestClient(tiny_app()) as client:
        first = metric(client, "alchemist:engine_idle_seconds_total")
        time.sleep(0.3)
        second = metric(client, "alchemist:engine_idle_seconds_total")
        assert second - first >= 0.25
        r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 2,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        assert metric(client, "alchemist:engine_idle_seconds_total") >= second


def test_the_longest_training_slice_is_exported_with_what_it_ran():
    from tests.test_training import make_trainer, serve
    from server.training_metrics import TrainingCollector

    trainer = make_trainer(mode="cpt")
    serve(trainer, "r")
    while trainer.run_slice():
        pass
    stats = trainer.status().training
    assert stats.max_slice_seconds > 0
    assert stats.max_slice_item in ("cpt reuse job", "optimizer step", "housekeeping")
    family = next(f for f in TrainingCollector(trainer).collect() if f.name == "alchemist:train_slice_max_seconds")
    (sample,) = family.samples
    assert sample.labels == {"item": stats.max_slice_item} and sample.value == stats.max_slice_seconds


def test_cpu_seconds_of_the_event_loop_and_the_device_thread_are_exported():
    import threading
    import time

    from prometheus_client.parser import text_string_to_metric_families

    from engine.thread_cpu import thread_cpu_seconds

    before, started = thread_cpu_seconds(threading.get_native_id()), time.thread_time()
    while time.thread_time() - started < 0.1:  # burn CPU on this thread (whatever the others do)
        pass
    assert thread_cpu_seconds(threading.get_native_id()) >= before + 0.05
    assert thread_cpu_seconds(2**31 - 1) is None  # no such thread
    with TestClient(tiny_app()) as client:
        r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "max_tokens": 3,
                                                      "messages": [{"role": "user", "content": "hi"}]})
        assert r.status_code == 200
        text = client.get("/metrics").text
    samples = {s.labels["thread"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "alchemist:thread_cpu_seconds_total"}
    assert set(samples) == {"event_loop", "device"} and all(v >= 0 for v in samples.values())


def _steps(metrics, kind: str) -> tuple[int, int]:
    """(steps, tokens) of `kind` observed so far."""
    return _count(metrics.steps.seconds[kind]), int(metrics.steps.tokens[kind]._value.get())


def test_engine_steps_are_timed_by_what_they_ran():
    engine, metrics = observed_engine()
    first, second = encode("Hello there"), encode("Hi")
    engine.add_request("a", first, SamplingParams(max_tokens=4, min_tokens=4))
    engine.step()
    assert _steps(metrics, "prefill") == (1, len(first))
    engine.step()
    assert _steps(metrics, "decode") == (1, 1)
    engine.add_request("b", second, SamplingParams(max_tokens=2, min_tokens=2))
    engine.step()  # a's next token beside b's prompt
    assert _steps(metrics, "mixed") == (1, len(second) + 1)
    while engine.has_unfinished():
        engine.step()
    assert _steps(metrics, "decode")[0] >= 2 and _steps(metrics, "recorded_prefill") == (0, 0)
    assert metrics.steps.seconds["prefill"]._sum.get() > 0


def test_a_recorded_prefill_is_timed_as_one():
    from tests.conftest import engine_of, make_training
    from trainer.config import TrainConfig

    metrics = ServingMetrics(TINY_NAME)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4), observers=(metrics,))
    engine, prompt = engine_of(trainer), encode("Hello there")
    engine.add_request("r", prompt, SamplingParams(max_tokens=3, min_tokens=3), train=True)
    while engine.has_unfinished():
        engine.step()
    assert _steps(metrics, "recorded_prefill") == (1, len(prompt)) and _steps(metrics, "prefill") == (0, 0)
    assert _steps(metrics, "decode") == (2, 2)


def test_a_recorded_prefill_with_decodes_riding_along_is_a_recorded_mixed_step():
    from tests.conftest import engine_of, make_training
    from trainer.config import TrainConfig

    metrics = ServingMetrics(TINY_NAME)
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4), observers=(metrics,))
    engine, first, second = engine_of(trainer), encode("Hello there"), encode("Hi you")
    engine.add_request("plain", first, SamplingParams(max_tokens=4, min_tokens=4))
    engine.step()
    engine.add_request("recorded", second, SamplingParams(max_tokens=2, min_tokens=2), train=True)
    engine.step()  # the recorded prompt, with "plain"'s next token riding along
    assert _steps(metrics, "recorded_mixed") == (1, len(second) + 1)
    assert _steps(metrics, "recorded_prefill") == (0, 0) and _steps(metrics, "mixed") == (0, 0)


def test_a_prompt_of_one_token_and_a_last_prefill_chunk_of_one_token_are_prefills():
    engine, metrics = observed_engine()  # at most 64 tokens per step
    engine.add_request("one", encode("Hello")[:1], SamplingParams(max_tokens=1))
    engine.step()
    assert _steps(metrics, "prefill") == (1, 1)
    prompt = (encode("Hello there, how are you today? ") * 20)[:65]
    engine.add_request("long", prompt, SamplingParams(max_tokens=1))
    engine.step()
    engine.step()  # the prompt's last token, alone
    assert _steps(metrics, "prefill") == (3, 66) and _steps(metrics, "decode") == (0, 0)


def test_the_colocate_bench_compares_a_recorded_prefill_with_a_plain_one_of_its_composition():
    from bench.colocate import recorded_over_plain

    def run(**kinds) -> dict:
        steps = {kind: {"s_per_token": math.nan, "seconds": 0.0, "tokens": 0.0} for kind in STEP_KINDS}
        for kind, (seconds, tokens) in kinds.items():
            steps[kind] = {"s_per_token": seconds / tokens, "seconds": seconds, "tokens": tokens}
        return {"steps": steps}

    off = [run(prefill=(1.0, 100.0), mixed=(3.0, 100.0)), run(prefill=(3.0, 100.0), mixed=(3.0, 100.0))]
    on = [run(recorded_prefill=(2.4, 100.0), recorded_mixed=(6.6, 200.0)), run(recorded_mixed=(3.3, 100.0))]
    ratios = recorded_over_plain({False: off, True: on})
    # medians of the rounds: plain alone 0.02 s per token, mixed 0.03; recorded alone 0.024, mixed 0.033
    assert ratios["recorded_alone_per_token_ratio"] == 1.2 and ratios["recorded_mixed_per_token_ratio"] == 1.1
    # the recorded steps' 12.3 s over what plain steps of their kinds take for their tokens: 100 × 0.02 + 300 × 0.03
    assert ratios["recorded_over_plain_of_its_composition"] == round(12.3 / 11.0, 4)
    assert math.isnan(recorded_over_plain({False: off, True: on[1:]})["recorded_alone_per_token_ratio"])


def test_a_request_of_several_choices_is_counted_once_whatever_its_choices_finish_with():
    """`request_success_total` counts requests (its sum is `requests_served`): choices
    ending with different reasons count their request once. A request's every output
    carries all its choices (engine/output_processor.py), finished ones too."""
    metrics = ServingMetrics(TINY_NAME)
    timing = RequestMetrics(0.0, 0.1, None, 3, 2)
    metrics.on_output(RequestOutput("a", [CompletionOutput(0, "x", [5], None, "stop"),
                                          CompletionOutput(1, "y", [6], None)], False, timing))
    metrics.on_output(RequestOutput("a", [CompletionOutput(0, "", [], None, "stop"),
                                          CompletionOutput(1, "z", [7], None, "length")], True,
                                    dataclasses.replace(timing, finish_time=0.2)))
    metrics.on_output(RequestOutput("b", [CompletionOutput(0, "x", [5], None, "stop"),
                                          CompletionOutput(1, "y", [6], None, "stop")], True,
                                    dataclasses.replace(timing, finish_time=0.2)))
    counted = {s.labels["finished_reason"]: s.value for m in metrics.success.collect() for s in m.samples
               if s.name.endswith("_total")}
    assert counted == {"length": 1, "stop": 1, "abort": 0} and metrics.requests_served() == 2
    assert request_finish_reason(set()) == "abort" and request_finish_reason({"abort", "length"}) == "abort"


def test_an_aborted_request_is_counted_by_its_reason_not_in_the_latency_histograms():
    """An outside pass (guidellm): 506 of 515 end-to-end observations were requests its
    sweep abandoned in the queue, the histogram's mean 13.7 s against 2.8 s served."""
    metrics = ServingMetrics(TINY_NAME)
    served = RequestMetrics(0.0, 0.1, 0.9, 3, 4, 0.05)
    metrics.on_output(RequestOutput("a", [CompletionOutput(0, "x", [5, 6, 7, 8], None, "length")], True, served))
    queued = RequestMetrics(0.0, None, 30.0, 3, 0)  # abandoned before it was scheduled
    metrics.on_output(RequestOutput("b", [CompletionOutput(0, "", [], None, "abort")], True, queued))
    decoding = RequestMetrics(0.0, 0.1, 20.0, 3, 2, 0.05)  # its client gone mid-answer
    metrics.on_output(RequestOutput("c", [CompletionOutput(0, "x", [5, 6], None, "abort")], True, decoding))

    def count(histogram):
        return next(s.value for m in histogram.collect() for s in m.samples if s.name.endswith("_count"))

    assert [count(h) for h in (metrics.e2e, metrics.decode_time, metrics.tpot, metrics.prompt_len,
                               metrics.gen_len)] == [1, 1, 1, 1, 1]
    counted = {s.labels["finished_reason"]: s.value for m in metrics.success.collect() for s in m.samples
               if s.name.endswith("_total")}
    assert counted == {"length": 1, "stop": 0, "abort": 2}


def test_every_finish_reason_is_a_series_from_the_first_scrape():
    """Prometheus' rate() and increase() see a series' first increment only if the series
    was there, at 0, in the scrape before it."""
    text = ServingMetrics(TINY_NAME).render().decode()
    for reason in ("stop", "length", "abort"):
        assert f'alchemist:request_success_total{{finished_reason="{reason}",model_name="{TINY_NAME}"}} 0.0' in text


def test_every_routes_status_codes_are_series_from_the_first_scrape_and_deletions_have_their_own():
    """An outside pass's burst of 429s never showed in `increase()`: each (route, status)
    series was born at its first response. Those the route table declares start at 0; a
    route with a parameter is counted under its template, not as "other"."""
    with TestClient(tiny_app()) as client:
        text = client.get("/metrics").text
        for handler, status in (("/v1/chat/completions", 429), ("/v1/chat/completions", 499), ("/health", 503),
                                ("/v1/feedback/{completion_id}", 404), ("other", 404), ("/v1/completions", 500),
                                ("/v1/feedback", 415), ("/tokenize", 415)):
            assert f'alchemist:http_requests_total{{handler="{handler}",status="{status}"}} 0.0' in text, handler
        assert 'status="401"' not in text  # no key set: none can come
        assert 'handler="/v1/models",status="415"' not in text  # no body: none can come
        assert client.delete("/v1/feedback/chatcmpl-x").status_code == 404
        assert client.get("/v1/models/org/name").status_code == 404
        text = client.get("/metrics").text
        assert 'alchemist:http_requests_total{handler="/v1/feedback/{completion_id}",status="404"} 1.0' in text
        assert 'alchemist:http_requests_total{handler="/v1/models/{model_id}",status="404"} 1.0' in text
        assert 'alchemist:http_requests_total{handler="other",status="404"} 0.0' in text


def test_a_prompt_counts_as_running_while_its_prefill_runs():
    """A request whose prompt is being prefilled is running, not waiting (an outside pass:
    a long prompt's prefill, one step of seconds, read as a queue that did not exist)."""
    engine, metrics = observed_engine()
    during_prefill = []

    class Probe:
        def on_step(self, stats) -> None:
            if not stats.kind and not during_prefill and stats.num_running:
                during_prefill.append((value(metrics.running), value(metrics.waiting)))

        def on_output(self, output) -> None:
            pass

    engine.hooks = dataclasses.replace(engine.hooks, observers=(*engine.hooks.observers, Probe()))
    engine.add_request("a", encode("Hello there"), SamplingParams(max_tokens=3))
    assert value(metrics.waiting) == 1 and value(metrics.running) == 0
    original = engine.runner.execute

    def execute(*args, **kwargs):
        during_prefill.append(("in the forward", value(metrics.running), value(metrics.waiting)))
        return original(*args, **kwargs)

    engine.runner.execute = execute
    engine.step()
    assert during_prefill[:2] == [(1, 0), ("in the forward", 1, 0)]


def test_a_trained_preference_is_exported_with_trls_implicit_rewards():
    """TRL's DPO figures (rewards/chosen, rejected, margins, accuracies) of a preference,
    taken before its step, written out on the PEFT model's dense forward: β times the
    policy's summed log-prob of a response over the base model's."""
    from server.training_metrics import TrainingCollector
    from tests.test_shared_prefix_pack import token_logps_of_whole_sequences
    from tests.test_training import label, make_trainer, serve

    trainer = make_trainer(mode="dpo")
    serve(trainer, "r")
    label(trainer, "r", chosen="Paris is the capital.")  # the served response is the rejected one
    entry = trainer.cache.get("r")
    responses = [entry.label.chosen, entry.label.rejected]
    policy, reference = (token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids, responses,
                                                        base=base) for base in (False, True))
    beta = trainer.config.dpo_beta
    chosen, rejected = (beta * (p.sum().item() - r.sum().item()) for p, r in zip(policy, reference))
    assert abs(chosen - rejected) > 1e-3  # random LoRA weights: the policy is not the base model
    trainer.train_until_idle()
    families = {f.name: f for f in TrainingCollector(trainer).collect()}

    def summary(name):
        samples = {s.name: s.value for s in families[f"alchemist:dpo_{name}"].samples}
        return samples[f"alchemist:dpo_{name}_count"], samples[f"alchemist:dpo_{name}_sum"]

    assert summary("reward_chosen") == (1, pytest.approx(chosen, abs=1e-4))
    assert summary("reward_rejected") == (1, pytest.approx(rejected, abs=1e-4))
    assert summary("reward_margin") == (1, pytest.approx(chosen - rejected, abs=1e-4))
    (ranked,) = families["alchemist:dpo_ranked_right"].samples
    assert ranked.value == (1.0 if chosen > rejected else 0.0)


def test_a_preference_trained_against_its_served_policy_exports_no_implicit_rewards():
    """With `dpo_reference = "served"` the reference is the policy itself: its implicit
    rewards are 0 by construction, so none are counted (a review: the panel read 0% ranked right)."""
    from server.training_metrics import TrainingCollector
    from tests.test_training import label, make_trainer, serve

    trainer = make_trainer(mode="dpo", dpo_reference="served")
    serve(trainer, "r")
    label(trainer, "r")
    trainer.train_until_idle()
    assert trainer.stats.trained_entries == {("dpo", "reuse"): 1}
    families = {f.name: {s.name: s.value for s in f.samples} for f in TrainingCollector(trainer).collect()}
    assert families["alchemist:dpo_reward_margin"]["alchemist:dpo_reward_margin_count"] == 0
    assert families["alchemist:dpo_ranked_right"]["alchemist:dpo_ranked_right_total"] == 0


@pytest.mark.parametrize("beta, rewards, shift", [(0.05, (1.0, 0.0, 0.5, 0.0), -0.5),
                                                 (0.0, (1.0, 0.0, 0.5, 0.5), 0.5)])
def test_a_trained_group_is_exported_with_trls_clip_ratio_and_kl(beta, rewards, shift):
    """TRL's GRPO figures of a group: its tokens clipped on the side of their advantage, over
    all its tokens (served log-probs moved by `shift` here, so that every ratio reads e^-shift:
    lowered, the samples with a positive advantage are clipped; raised, those with a negative
    one; a sample without advantage never is, though its tokens count), and the KL to the base
    model per token, written out on the PEFT model's dense forward."""
    import torch

    from server.training_metrics import TrainingCollector
    from tests.test_grpo import make_trainer, reward, serve_group
    from tests.test_shared_prefix_pack import token_logps_of_whole_sequences
    from trainer.losses import group_advantages

    trainer = make_trainer(grpo_beta=beta)
    served = serve_group(trainer, temperature=0.8)
    assert reward(trainer, rewards=rewards).accepted
    entry = trainer.cache.get("g")
    entry.served_token_logps = {i: [v + shift for v in values] for i, values in entry.served_token_logps.items()}
    policy, base = (token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids, served, base=b,
                                                   temperature=0.8) for b in (False, True))
    kl = sum((torch.exp(r - p) - (r - p) - 1).sum().item() for p, r in zip(policy, base)) if beta else 0.0
    assert kl > 1e-4 or not beta  # random LoRA weights: the policy is not the base model
    advantages = group_advantages(torch.tensor(rewards)).tolist()
    assert 0.0 in advantages or beta
    trainer.train_until_idle()
    assert trainer.stats.trained_entries == {("grpo", "reuse"): 1}
    families = {f.name: {s.name: s.value for s in f.samples} for f in TrainingCollector(trainer).collect()}
    tokens = sum(map(len, served))
    assert families["alchemist:grpo_completion_tokens"]["alchemist:grpo_completion_tokens_total"] == tokens
    clipped_side = 1 if shift < 0 else -1
    assert families["alchemist:grpo_clipped_tokens"]["alchemist:grpo_clipped_tokens_total"] == sum(
        len(response) for response, advantage in zip(served, advantages) if advantage * clipped_side > 0) > 0
    # (a float32 sum over every token: its last bits differ between machines' kernels)
    assert families["alchemist:grpo_kl"] == {"alchemist:grpo_kl_count": tokens if beta else 0,
                                             "alchemist:grpo_kl_sum": pytest.approx(kl, rel=1e-6, abs=1e-5)}
