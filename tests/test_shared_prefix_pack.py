"""A prompt and the suffixes that continue it in one forward (AttentionMetadata.shared_prefix),
as DPO's and GRPO's base references run: their log-probs equal Hugging Face's forward of
each whole sequence under the base model, in every family, in the CPU's exact shapes
and in a GPU's bucketed ones; the reference runs each decoder layer once; with grad, the
adapter's gradients equal those of the whole sequences in one batch."""

import pytest
import torch

from engine.attention import paged_attention_forward
from engine.kv_cache import AttentionMetadata
from engine.model_runner import run_to_end
from engine.step_inputs import training_buckets
from tests.conftest import encode, make_training
from tests.test_grpo import reward, serve_group
from tests.test_training import PROMPT, gradients_of, label, make_trainer, relative_difference, serve
from tests.test_training_buckets import bucketed
from tests.tiny import FAMILIES, TEST_DEVICE
from trainer.adapter import lora_gradients
from trainer.config import TrainConfig
from trainer.entries import PreferenceLabel
from trainer.forward import backward_segments, forward_segments
from trainer.losses import token_logprobs
from trainer.methods import head_logits

CHOSEN, REJECTED = "Paris, of course. It is a lovely city.", "Rome."


def token_logps_of_whole_sequences(peft_model, prompt: list[int], responses: list[list[int]],
                                   base: bool = True, temperature: float = 1.0) -> list[torch.Tensor]:
    """Each response's per-token log-probs from the model's own forward of prompt +
    response, all in one batch (the responses padded at the end), under the base model;
    the logits over `temperature` (GRPO's sampling distribution, as TRL takes it)."""
    width = len(prompt) + max(len(r) for r in responses)
    ids = torch.tensor([prompt + r + [0] * (width - len(prompt) - len(r)) for r in responses], device=TEST_DEVICE)
    if base:
        with peft_model.disable_adapter(), torch.no_grad():
            logits = peft_model(ids).logits
    else:
        logits = peft_model(ids).logits
    first = len(prompt) - 1
    return [(logits[b, first:first + len(r)].float() / temperature).log_softmax(-1)
            .gather(1, torch.tensor(r, device=TEST_DEVICE)[:, None])[:, 0] for b, r in enumerate(responses)]


@pytest.mark.parametrize("shapes", ["exact", "bucketed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_dpo_reference_is_the_base_models_log_probs_of_each_whole_sequence(family, shapes):
    trainer = make_trainer(family, mode="dpo")
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen=CHOSEN, rejected=REJECTED)
    bucketed(trainer, shapes == "bucketed")
    entry = trainer.cache.get("r")
    chosen, rejected = run_to_end(trainer.method.reference_logps(entry, trainer.context))
    expected = token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids,
                                              [entry.label.chosen, entry.label.rejected])
    assert [chosen, rejected] == pytest.approx([e.sum().item() for e in expected], abs=1e-3)


@pytest.mark.parametrize("family, temperature", [("llama", 1.0), ("qwen2", 1.0), ("llama", 0.7)])
def test_grpo_reference_is_the_base_models_log_prob_of_every_token(family, temperature):
    """At the group's sampling temperature, as TRL's reference model's."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="grpo", lora_rank=4, grpo_beta=0.05), family, init_lora_weights=False)
    serve_group(trainer, "g", temperature=temperature)
    assert reward(trainer, "g").accepted
    entry = trainer.cache.get("g")
    result = run_to_end(trainer.method.reference_token_logps(entry, trainer.context))
    indices = sorted(entry.responses)
    expected = token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids,
                                              [entry.responses[i] for i in indices], temperature=temperature)
    assert sorted(result) == indices
    for index, want in zip(indices, expected):
        assert result[index] == pytest.approx(want.tolist(), abs=1e-4)


def forwards_rows(runner, monkeypatch) -> list[tuple[int, bool]]:
    """(rows, with grad) of each forward through `runner` from now on."""
    forwards, run_layer = [], runner.run_layer

    def counted(index, hidden, *args):
        if index == 0:
            forwards.append((hidden.shape[1], torch.is_grad_enabled()))
        return run_layer(index, hidden, *args)

    monkeypatch.setattr(runner, "run_layer", counted)
    return forwards


@pytest.mark.parametrize("family", FAMILIES)
def test_the_separate_trainers_dpo_reference_is_trls_the_prompt_once_per_response(family, monkeypatch):
    """`baseline_job` computes the reference as TRL's DPOTrainer does: its batch of both
    whole sequences again, without grad — the same log-probs as the server's pack."""
    trainer = make_trainer(family, mode="dpo")
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen=CHOSEN, rejected=REJECTED)
    entry = trainer.cache.get("r")
    packed = run_to_end(trainer.method.reference_logps(entry, trainer.context))
    assert entry.reference_logps is None
    forwards = forwards_rows(trainer.context.runner, monkeypatch)
    run_to_end(trainer.method.baseline_job(entry, trainer.context))
    trainer.optimizer.zero_grad()
    prompt_len, responses = len(entry.prompt_token_ids), [entry.label.chosen, entry.label.rejected]
    rows = 2 * prompt_len + sum(map(len, responses))
    assert forwards == [(rows, False), (rows, True)]  # the reference, then the trained forward: the same batch
    expected = token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids, responses)
    assert list(entry.reference_logps) == pytest.approx([e.sum().item() for e in expected], abs=1e-3)
    assert list(entry.reference_logps) == pytest.approx(list(packed), abs=1e-3)


@pytest.mark.parametrize("family, temperature", [("llama", 1.0), ("qwen2", 1.0), ("llama", 0.7)])
def test_the_separate_trainers_grpo_reference_is_trls_a_row_per_sample(family, temperature, monkeypatch):
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="grpo", lora_rank=4, grpo_beta=0.05), family, init_lora_weights=False)
    serve_group(trainer, "g", temperature=temperature)
    assert reward(trainer, "g").accepted
    entry = trainer.cache.get("g")
    forwards = forwards_rows(trainer.context.runner, monkeypatch)
    run_to_end(trainer.method.baseline_job(entry, trainer.context))
    trainer.optimizer.zero_grad()
    indices = sorted(entry.responses)
    responses = [entry.responses[i] for i in indices]
    rows = len(entry.prompt_token_ids) * len(responses) + sum(len(r) - 1 for r in responses)
    assert forwards == [(rows, False), (rows, True)]
    expected = token_logps_of_whole_sequences(trainer.peft_model, entry.prompt_token_ids, responses,
                                              temperature=temperature)
    assert sorted(entry.reference_token_logps) == indices
    for index, want in zip(indices, expected):
        assert entry.reference_token_logps[index] == pytest.approx(want.tolist(), abs=1e-4)
    # samples of one token and of three, a row at a time: the same log-probs as the pack's
    entry.responses[indices[0]], entry.responses[indices[1]] = responses[0][:1], responses[1][:3]
    trainer.method.recompute_rows = 1
    separate = run_to_end(trainer.method.separate_trainer_reference_token_logps(entry, trainer.context))
    packed = run_to_end(trainer.method.reference_token_logps(entry, trainer.context))
    assert [len(separate[i]) for i in indices[:2]] == [1, 3] and sorted(separate) == sorted(packed) == indices
    for index in indices:
        assert separate[index] == pytest.approx(packed[index], abs=1e-4)


def test_a_reference_runs_each_decoder_layer_once(monkeypatch):
    trainer = make_trainer("llama", mode="dpo")
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen=CHOSEN, rejected=REJECTED)
    runner = trainer.context.runner
    calls = []
    run_layer = runner.run_layer
    monkeypatch.setattr(runner, "run_layer", lambda index, *args: calls.append(index) or run_layer(index, *args))
    run_to_end(trainer.method.reference_logps(trainer.cache.get("r"), trainer.context))
    assert calls == list(range(len(runner.layers)))


@pytest.mark.parametrize("family", FAMILIES)
def test_with_grad_the_pack_gives_the_whole_sequences_gradients(family):
    """The suffixes' log-probs back-propagated through the pack (the prompt's rows shared,
    their gradients summed over the suffixes that attended to them) and through the
    model's own forward of both whole sequences."""
    trainer = make_trainer(family, mode="cpt")
    ctx, peft = trainer.context, trainer.peft_model
    prompt, responses = encode(PROMPT), [encode(CHOSEN), encode(REJECTED) + encode(" No.")]
    fwd = run_to_end(forward_segments(ctx.runner, [prompt, *(r[:-1] for r in responses)], shared_prefix=True))
    trainer.optimizer.zero_grad()
    with torch.enable_grad():
        last = head_logits(ctx, fwd.head_leaf[0, len(prompt) - 1:len(prompt)])
        loss = -sum(token_logprobs(last, torch.tensor(r[:1], device=TEST_DEVICE)).sum() for r in responses)
        for b, r in enumerate(responses):
            rows = fwd.head_leaf[0, fwd.offsets[b + 1]:fwd.offsets[b + 2]]
            loss = loss - token_logprobs(head_logits(ctx, rows), torch.tensor(r[1:], device=TEST_DEVICE)).sum()
        loss.backward()
    run_to_end(backward_segments(fwd.segments, fwd.head_leaf.grad))
    packed = lora_gradients(peft)
    trainer.optimizer.zero_grad()
    with torch.enable_grad():
        (-sum(t.sum() for t in token_logps_of_whole_sequences(peft, prompt, responses, base=False))).backward()
    whole = lora_gradients(peft)
    trainer.optimizer.zero_grad()
    assert all(g.norm() > 0 for g in whole.values())
    assert relative_difference(packed, whole) <= 1e-4


@pytest.mark.parametrize("mode", ["dpo", "grpo"])
def test_the_servers_recompute_computes_the_prompt_once_and_the_baseline_once_per_response(mode, monkeypatch):
    """An entry without a usable recording trains on one pack of the prompt and its
    responses (`recompute_job`); the separate trainer the benchmarks compare against
    (`baseline_job`) computes the prompt once per response, as TRL's trainers do."""
    if mode == "grpo":
        torch.manual_seed(0)
        trainer = make_training(TrainConfig(mode="grpo", lora_rank=4), init_lora_weights=False)
        serve_group(trainer, "e")
        assert reward(trainer, "e").accepted
    else:
        trainer = make_trainer("llama", mode="dpo")
        serve(trainer, "e", max_tokens=8)
        label(trainer, "e", chosen=CHOSEN, rejected=REJECTED)
    entry = trainer.cache.get("e")
    responses = list(entry.responses.values()) if mode == "grpo" else [entry.label.chosen, entry.label.rejected]
    prompt_len = len(entry.prompt_token_ids)
    runner, rows = trainer.context.runner, []
    run_layer = runner.run_layer

    def counted(index, hidden, *args):
        if index == 0:
            rows.append(hidden.shape[1])  # the rows of each forward
        return run_layer(index, hidden, *args)

    monkeypatch.setattr(runner, "run_layer", counted)
    run_to_end(trainer.method.recompute_job(entry, trainer.context))
    assert rows[-1] == prompt_len + sum(len(r) - 1 for r in responses)
    run_to_end(trainer.method.baseline_job(entry, trainer.context))
    assert rows[-1] == sum(prompt_len + len(r) - (mode == "grpo") for r in responses)
    trainer.optimizer.zero_grad()


@pytest.mark.parametrize("shapes", ["exact", "bucketed"])
@pytest.mark.parametrize("window", [None, 3])
def test_the_packs_attention_is_each_whole_sequences(window, shapes):
    """At the attention call: queries of a prompt and of suffixes of lengths 3, 1 and 5,
    grouped-query heads, a sliding window shorter than the prompt — each row attends as
    in causal attention over its own whole sequence."""
    torch.manual_seed(0)
    prompt_len, suffixes, heads, kv_heads, dim = 6, [3, 1, 5], 4, 2, 8
    buckets = training_buckets(torch.device("cuda"), 16, 64) if shapes == "bucketed" else None
    meta = AttentionMetadata.shared_prefix(prompt_len, suffixes, TEST_DEVICE, buckets)
    total = prompt_len + sum(suffixes)
    query = torch.randn(1, heads, total, dim, device=TEST_DEVICE)
    key, value = (torch.randn(total, kv_heads, dim, device=TEST_DEVICE) for _ in range(2))
    out, _ = paged_attention_forward(None, query, key, value, meta, scaling=dim ** -0.5, sliding_window=window)
    offsets = [prompt_len + sum(suffixes[:i]) for i in range(len(suffixes))]
    for offset, n in zip([0, *offsets], [0, *suffixes]):
        rows = list(range(prompt_len)) + list(range(offset, offset + n))  # the whole sequence, in position order
        positions = torch.arange(len(rows), device=TEST_DEVICE)
        allowed = positions[None, :] <= positions[:, None]
        if window is not None:
            allowed &= positions[None, :] > positions[:, None] - window
        expected = torch.nn.functional.scaled_dot_product_attention(
            query[:, :, rows], key[rows].transpose(0, 1)[None], value[rows].transpose(0, 1)[None],
            attn_mask=allowed, scale=dim ** -0.5, enable_gqa=True)[0].transpose(0, 1)  # (rows, heads, dim)
        mine = rows if n == 0 else rows[prompt_len:]
        want = expected if n == 0 else expected[prompt_len:]
        assert torch.allclose(out[0, mine], want, atol=1e-5)


@pytest.mark.parametrize("lengths", [(1, 1), (6, 1), (1, 4)])
def test_responses_of_one_token_recompute_as_the_separate_trainer(lengths):
    trainer = make_trainer("llama", mode="dpo")
    serve(trainer, "r", max_tokens=8)
    label(trainer, "r", chosen=CHOSEN, rejected=REJECTED)
    entry = trainer.cache.get("r")
    eos = entry.label.chosen[-1:]
    chosen, rejected = lengths  # a one-token rejected response is not the end of turn: the two differ
    entry.label = PreferenceLabel(encode(CHOSEN)[:chosen - 1] + eos,
                                  encode(REJECTED)[:rejected - 1] + eos if rejected > 1 else encode(REJECTED)[:1])
    assert [len(r) for r in (entry.label.chosen, entry.label.rejected)] == list(lengths)
    packed = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    baseline = gradients_of(trainer, trainer.method.baseline_job(entry, trainer.context))
    assert all(g.norm() > 0 for g in baseline.values())
    assert relative_difference(packed, baseline) <= 1e-4  # as every DPO path's (tests/test_training.py)


@pytest.mark.parametrize("max_tokens, tokens_bound", [(1, None), (4, 1)])
def test_a_group_recomputes_in_packs_of_any_size_as_the_dense_trainer(max_tokens, tokens_bound):
    """Samples of one token (nothing after the prompt), and a token bound below the
    prompt's length: packs of one sample, the KL term's base reference packed the same."""
    torch.manual_seed(0)
    trainer = make_training(TrainConfig(mode="grpo", lora_rank=4, grpo_beta=0.05), init_lora_weights=False)
    serve_group(trainer, "g", max_tokens=max_tokens)
    assert reward(trainer, "g").accepted
    entry, method = trainer.cache.get("g"), trainer.method
    method.recompute_tokens = tokens_bound
    packed = gradients_of(trainer, method.recompute_job(entry, trainer.context))
    packed_reference, entry.reference_token_logps = entry.reference_token_logps, None
    method.recompute_tokens = None
    baseline = gradients_of(trainer, method.baseline_job(entry, trainer.context))
    assert sorted(packed_reference) == sorted(entry.reference_token_logps)
    for index, values in packed_reference.items():
        assert values == pytest.approx(entry.reference_token_logps[index], abs=1e-5)
    assert all(g.norm() > 0 for g in baseline.values())
    assert relative_difference(packed, baseline) <= 1e-5
