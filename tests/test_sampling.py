"""Per-request sampling parameters as vLLM defines them, and logprobs."""

import pytest
import torch

from engine.sampling_params import InvalidParameter, SamplingParams
from tests.conftest import encode, make_engine
from tests.tiny import TEST_DEVICE, tiny_tokenizer

PROMPT = "Hello, how are you today?"


def run(engine, params, prompt=PROMPT, request_id="r"):
    engine.add_request(request_id, encode(prompt), params)
    outputs = []
    while engine.has_unfinished():
        step_outputs, _ = engine.step()
        outputs += [o for o in step_outputs if o.request_id == request_id]
    return outputs


def collect(outputs, index=0):
    text, ids, lps, reason, stop_reason = "", [], [], None, None
    for out in outputs:
        for c in out.outputs:
            if c.index == index:
                text += c.text
                ids += c.token_ids
                lps += c.logprobs or []
                reason, stop_reason = c.finish_reason or reason, c.stop_reason if c.finish_reason else stop_reason
    return text, ids, lps, reason, stop_reason


def test_max_tokens_respected():
    _, ids, _, reason, _ = collect(run(make_engine(), SamplingParams(max_tokens=7, ignore_eos=True)))
    assert len(ids) == 7 and reason == "length"


def test_seed_reproducibility_independent_of_batch():
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = collect(run(make_engine(), params))[1]
    engine = make_engine()
    engine.add_request("other", encode("The quick brown fox"), SamplingParams(temperature=1.0, max_tokens=20))
    with_company = collect(run(engine, params))[1]
    assert alone == with_company
    different = collect(run(make_engine(), SamplingParams(temperature=1.0, seed=99, max_tokens=16,
                                                          ignore_eos=True)))[1]
    assert different != alone


def test_top_k_one_is_greedy():
    greedy = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)))[1]
    top1 = collect(run(make_engine(), SamplingParams(temperature=1.0, top_k=1, seed=3, max_tokens=12,
                                                     ignore_eos=True)))[1]
    assert top1 == greedy


def test_a_top_k_past_the_vocabulary_samples_as_no_top_k_and_fails_no_request_beside_it():
    """However large (2**63 does not fit the sampler's int64 row): the whole vocabulary.
    A failed step would fail every request in it."""
    params = dict(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True)
    unbounded = collect(run(make_engine(), SamplingParams(**params)))[1]
    engine = make_engine()
    engine.add_request("beside", encode("The quick brown fox"), SamplingParams(temperature=1.0, max_tokens=20))
    assert collect(run(engine, SamplingParams(top_k=2**63, **params)))[1] == unbounded
    assert collect(run(engine, SamplingParams(top_k=2**70, **params), request_id="again"))[1] == unbounded


def test_min_tokens_suppresses_eos_and_ignore_eos_continues_past_it():
    engine = make_engine()
    eos = tiny_tokenizer().eos_token_id
    # force EOS: a stop token list containing every token but EOS is not possible, so
    # check through min_tokens that EOS never appears before min_tokens
    _, ids, _, _, _ = collect(run(engine, SamplingParams(temperature=1.0, seed=0, max_tokens=30, min_tokens=30)))
    assert len(ids) == 30 and eos not in ids
    _, ids, _, reason, _ = collect(run(make_engine(), SamplingParams(temperature=2.0, seed=5, max_tokens=200,
                                                                     ignore_eos=True)))
    assert len(ids) == 200 and reason == "length"


def test_stop_token_ids_end_generation():
    engine = make_engine()
    greedy = collect(run(engine, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)))[1]
    target = greedy[5]
    first = greedy.index(target)
    _, ids, _, reason, stop_reason = collect(run(make_engine(), SamplingParams(
        temperature=0.0, max_tokens=20, ignore_eos=True, stop_token_ids=[target])))
    assert ids == greedy[:first + 1] and reason == "stop" and stop_reason == target


def test_stop_string_truncates_output_and_is_not_streamed():
    full_text = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))[0]
    stop = full_text[10:13]
    outputs = run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, stop=[stop]))
    text, _, _, reason, stop_reason = collect(outputs)
    assert text == full_text[:full_text.index(stop)] and reason == "stop" and stop_reason == stop
    streamed = "".join(c.text for o in outputs for c in o.outputs)
    assert stop not in streamed
    included = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                         stop=[stop], include_stop_str_in_output=True)))[0]
    assert included == full_text[:full_text.index(stop) + len(stop)]


def test_a_stop_string_before_min_tokens_stays_in_the_text_and_the_first_one_after_ends_it():
    engine = make_engine()
    greedy_text, greedy_ids, _, _, _ = collect(run(engine, SamplingParams(temperature=0.0, max_tokens=30,
                                                                          ignore_eos=True)))
    tok = tiny_tokenizer()
    # a stop string that the first tokens complete, and that occurs again later
    prefix_lengths = [len(tok.decode(greedy_ids[:n])) for n in range(1, 31)]
    stop = next(greedy_text[end - 1:end] for end in prefix_lengths[:5] if greedy_text[end - 1:end].strip()
                and greedy_text.count(greedy_text[end - 1:end]) >= 2)
    first_after = greedy_text.index(stop, prefix_lengths[9])  # from the 11th token's text on (vLLM's: past min_tokens)
    outputs = run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, min_tokens=10,
                                                stop=[stop]))
    text, ids, _, reason, stop_reason = collect(outputs)
    assert text == greedy_text[:first_after] and reason == "stop" and stop_reason == stop
    assert ids == greedy_ids[:len(ids)] and len(ids) > 10
    assert "".join(c.text for o in outputs for c in o.outputs) == text  # streamed: the same text


def test_a_stop_token_is_in_the_text_when_stop_strings_are_and_stop_strings_count_past_min_tokens():
    """An outside review against vLLM: `include_stop_str_in_output` kept a stop string but
    not a stop token's text; and a stop string the min_tokens-th token completed ended the
    request, leaving fewer than min_tokens tokens of text (vLLM looks from the next one)."""
    greedy_text, greedy_ids, _, _, _ = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=12,
                                                                                ignore_eos=True)))
    tok = tiny_tokenizer()
    target = greedy_ids[3]
    first = greedy_ids.index(target)
    for include in (False, True):
        text, ids, _, _, stop_reason = collect(run(make_engine(), SamplingParams(
            temperature=0.0, max_tokens=12, ignore_eos=True, stop_token_ids=[target], include_stop_str_in_output=include)))
        assert ids == greedy_ids[:first + 1] and stop_reason == target
        assert text == tok.decode(greedy_ids[:first + 1 if include else first])
    pieces = [tok.decode(greedy_ids[:n + 1])[len(tok.decode(greedy_ids[:n])):] for n in range(12)]
    stop = pieces[1]  # completed by token 2
    text, ids, _, _, _ = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True,
                                                                   min_tokens=2, stop=[stop])))
    assert len(ids) > 2 and text.startswith("".join(pieces[:2]))


def test_n_choices_are_returned_and_differ():
    outputs = run(make_engine(), SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=10, ignore_eos=True))
    choices = [collect(outputs, i)[1] for i in range(3)]
    assert all(len(c) == 10 for c in choices)
    assert len({tuple(c) for c in choices}) == 3


def test_logprobs_match_the_model_distribution():
    engine = make_engine()
    outputs = run(engine, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3,
                                         prompt_logprobs=2))
    _, ids, lps, _, _ = collect(outputs)
    prompt = encode(PROMPT)
    with torch.inference_mode():
        ref = engine.model(torch.tensor([prompt + ids], device=TEST_DEVICE)).logits[0].float().log_softmax(-1)
    for i, lp in enumerate(lps):
        row = ref[len(prompt) - 1 + i]
        assert lp.token_id == ids[i]
        assert lp.logprob == pytest.approx(row[ids[i]].item(), abs=1e-4)
        assert [t for t, _ in lp.top] == row.topk(3).indices.tolist()
    prompt_lps = next(o.prompt_logprobs for o in outputs if o.prompt_logprobs is not None)
    assert prompt_lps[0] is None and len(prompt_lps) == len(prompt)
    for pos in range(1, len(prompt)):
        assert prompt_lps[pos].logprob == pytest.approx(ref[pos - 1, prompt[pos]].item(), abs=1e-4)


def test_max_tokens_zero_scores_the_prompt_only():
    outputs = run(make_engine(), SamplingParams(max_tokens=0, prompt_logprobs=0))
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "length"
    assert not collect(outputs)[1]
    assert next(o.prompt_logprobs for o in outputs if o.prompt_logprobs) is not None


def test_abort_stops_a_request_and_frees_its_blocks():
    engine = make_engine()
    engine.add_request("a", encode(PROMPT), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished() and engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_blocks


@pytest.mark.parametrize("kwargs, param", [
    (dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-5), "top_k"),
    (dict(n=0), "n"), (dict(max_tokens=-1), "max_tokens"), (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(logprobs=21), "logprobs"), (dict(stop=[""]), "stop"), (dict(presence_penalty=3), "presence_penalty"),
])
def test_out_of_range_parameters_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidParameter) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param


def test_prompt_longer_than_the_context_is_rejected():
    engine = make_engine(max_model_len=32)
    with pytest.raises(InvalidParameter, match="maximum context length is 32"):
        engine.add_request("x", list(range(5)) * 5, SamplingParams(max_tokens=10))
    assert not engine.has_unfinished()


def test_penalties_change_the_distribution():
    base = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)))[1]
    penalized = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True,
                                                          frequency_penalty=2.0)))[1]
    assert len(set(penalized)) >= len(set(base))
    assert penalized != base


def test_logit_bias_forces_and_bans_tokens():
    engine = make_engine()
    greedy = collect(run(engine, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))[1]
    forced = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                       logit_bias={42: 100.0})))[1]
    assert forced == [42] * 8
    banned = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                       logit_bias={greedy[0]: -100.0})))[1]
    assert banned[0] != greedy[0]


def test_tiny_temperature_is_greedy():
    greedy = collect(run(make_engine(), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)))[1]
    tiny = collect(run(make_engine(), SamplingParams(temperature=1e-9, max_tokens=8, ignore_eos=True)))[1]
    assert tiny == greedy


def test_a_seeded_server_samples_the_same_tokens_for_unseeded_requests_on_every_start():
    """`--seed` (model.seed), as vLLM's: the same traffic after each start gets the same
    tokens from requests that give no seed of their own; another seed, others."""
    import dataclasses

    from fastapi.testclient import TestClient

    from server.serve import build_server
    from tests.conftest import make_config
    from tests.servers import TINY_NAME
    from tests.tiny import tiny_model

    def sampled(seed: int) -> list[str]:
        config = make_config()
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, seed=seed))
        app = build_server(config, model=tiny_model("llama"), tokenizer=tiny_tokenizer(), model_name=TINY_NAME)
        body = {"model": TINY_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 1.0, "n": 2}
        with TestClient(app) as client:
            return [choice["text"] for _ in range(2)
                    for choice in client.post("/v1/completions", json=body).json()["choices"]]

    first = sampled(5)
    assert sampled(5) == first and len(set(first)) > 1
    assert sampled(6) != first


def test_top_p_reads_what_top_k_left_as_transformers_and_vllm_do():
    """An outside review: top-p summed the whole distribution, so with [.30, .25, .20, .15,
    .10], top_k = 2 and top_p = 0.5 both tokens stayed, where transformers' and vLLM's
    top-k-then-top-p keep the first alone."""
    from transformers.generation.logits_process import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    from engine.sampler import truncated

    logits = torch.tensor([[.30, .25, .20, .15, .10]]).log()
    inputs = {"top_k": torch.tensor([2]), "top_p": torch.tensor([0.5]), "min_p": torch.tensor([0.0])}
    assert truncated(logits, inputs).isfinite().tolist() == [[True, False, False, False, False]]
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p, min_p in ((5, 0.9, 0.0), (20, 0.6, 0.0), (40, 0.95, 0.05), (64, 1.0, 0.1), (3, 0.3, 0.0)):
        logits = torch.randn(16, 64, generator=generator) * 2
        inputs = {"top_k": torch.full((16,), top_k), "top_p": torch.full((16,), top_p),
                  "min_p": torch.full((16,), min_p)}
        expected = TopKLogitsWarper(top_k)(None, logits)
        if top_p < 1.0:
            expected = TopPLogitsWarper(top_p)(None, expected)
        if min_p > 0.0:
            expected = MinPLogitsWarper(min_p)(None, expected)
        assert torch.equal(truncated(logits, inputs).isfinite(), expected.isfinite()), (top_k, top_p, min_p)


def test_tracked_log_probs_are_taken_at_each_rows_temperature_and_the_clients_stay_raw():
    """One batch: rows tracked at 0.7 (a GRPO group's) and at 1, with and without the
    client's logprobs, and one that tracks nothing. A tracked value is log_softmax(z / T)
    of the sampled token; the client's value and alternatives are the raw distribution's."""
    from engine.sampler import Sampler
    from engine.sequence import Sequence

    torch.manual_seed(0)
    rows = [(True, 0.7, 2), (True, 1.0, None), (False, 1.0, 3), (True, 0.7, None), (False, 1.0, None)]
    seqs = [Sequence(seq_id=i, request_id=str(i), index=0, prompt_token_ids=[1], max_tokens=4, arrival_time=0.0,
                     detokenizer=None, params=SamplingParams(temperature=0.9, logprobs=logprobs),
                     track_logprob=tracked, logprob_temperature=temperature)
            for i, (tracked, temperature, logprobs) in enumerate(rows)]
    logits = torch.randn(len(rows), 50) * 3
    results = Sampler(eos_token_ids={0}).sample(logits, seqs)
    raw = logits.log_softmax(-1)
    for row, ((tracked, temperature, logprobs), result) in enumerate(zip(rows, results)):
        token = result.token_id
        at_temperature = (logits[row] / temperature).log_softmax(-1)[token].item()
        assert result.logprob_value == (pytest.approx(at_temperature, abs=1e-5) if tracked else None)
        if logprobs is None:
            assert result.logprob is None
            continue
        assert result.logprob.logprob == pytest.approx(raw[row, token].item(), abs=1e-5)
        values, ids = raw[row].topk(logprobs)
        assert [t for t, _ in result.logprob.top] == ids.tolist()
        assert [v for _, v in result.logprob.top] == pytest.approx(values.tolist(), abs=1e-5)
