"""What a serving step would cost a GPU, counted on the CPU (bench/step_counts.py): one
host read per decode step, a constant number of host-to-device copies whatever the batch,
a bounded set of attention shapes under a trace with arrivals; and the batched sampler
agrees with a plain per-row reference."""

import pytest
import torch

from bench.step_counts import arrival_trace, decode_step_counts, replay_trace
from engine.sampler import truncated
from engine.sampling_params import SamplingParams
from engine.structured import choice_grammar
from tests.conftest import make_engine


def _engine():
    return make_engine("llama", max_num_seqs=32, max_num_batched_tokens=256, kv_cache_bytes=64 << 20,
                       max_model_len=512, block_size=16)


def _prompts(count: int) -> list[list[int]]:
    return [[5 + i % 50, 7, 9 + i % 7, 11] for i in range(count)]


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, max_tokens=32, min_tokens=16),
    SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, max_tokens=32, min_tokens=16, seed=3,
                   logprobs=3, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                   logit_bias={7: 2.0}),
    SamplingParams(temperature=0.0, max_tokens=32, logprobs=0),
], ids=["temperature-min-tokens", "every-option", "greedy-logprobs"])
def test_a_decode_step_reads_the_host_once_and_copies_the_same_at_8_and_32_streams(params):
    counts = {n: decode_step_counts(_engine(), _prompts(n), params) for n in (8, 32)}
    for n, counter in counts.items():
        assert counter.reads <= 1, (n, dict(counter.sites))
        assert counter.built <= 8, (n, dict(counter.sites))
    assert counts[8].built == counts[32].built, {n: dict(c.sites) for n, c in counts.items()}


def test_structured_outputs_keep_one_read_per_decode_step():
    engine = _engine()
    params = SamplingParams(temperature=1.0, max_tokens=16, grammar=choice_grammar(["yes", "no", "maybe"], "x"))
    counter = decode_step_counts(engine, _prompts(8), params, warmup_steps=1)
    assert counter.reads <= 1 and counter.built <= 8, dict(counter.sites)


def test_a_trace_with_arrivals_builds_few_attention_shapes():
    engine = _engine()
    counts = replay_trace(engine, arrival_trace(engine.vocab_size, steps=400, seed=0),
                          lambda max_tokens: SamplingParams(temperature=1.0, max_tokens=max_tokens, min_tokens=4))
    assert counts.steps >= 400 and counts.decode_steps > 100
    assert counts.distinct_attention_shapes <= 32
    assert counts.max_reads_per_decode_step <= 1, counts.reads_sites


def _truncated_reference(row: torch.Tensor, top_k: int, top_p: float, min_p: float) -> torch.Tensor:
    """One row, as the sampler filtered it before it was batched."""
    sorted_logits, order = row.sort(descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if top_k != -1:
        remove[top_k:] = True
    probs = sorted_logits.softmax(-1)
    if top_p < 1.0:
        remove |= (probs.cumsum(-1) - probs) >= top_p
    if min_p > 0.0:
        remove |= probs < min_p * probs[0]
    remove[0] = False
    filtered = torch.full_like(row, float("-inf"))
    filtered[order[~remove]] = sorted_logits[~remove]
    return filtered


def test_batched_truncation_equals_the_per_row_filter():
    torch.manual_seed(0)
    vocab = 300
    settings = [(-1, 1.0, 0.0), (5, 1.0, 0.0), (-1, 0.7, 0.0), (-1, 1.0, 0.1), (40, 0.9, 0.02), (1, 0.5, 0.5)]
    logits = torch.randn(len(settings), vocab) * 3
    inputs = {"top_k": torch.tensor([vocab if k == -1 else k for k, _, _ in settings]),
              "top_p": torch.tensor([p for _, p, _ in settings]), "min_p": torch.tensor([m for _, _, m in settings])}
    batched = truncated(logits, inputs)
    for row, (k, p, m) in enumerate(settings):
        assert torch.equal(batched[row], _truncated_reference(logits[row], k, p, m)), settings[row]


def test_draws_follow_the_distribution_and_greedy_rows_in_the_same_batch_take_the_argmax():
    engine = _engine()
    sampler = engine.runner.sampler
    probs = torch.tensor([0.6, 0.25, 0.1, 0.05] + [0.0] * 60)
    logits = probs.log().unsqueeze(0).expand(2, -1).contiguous().to(engine.runner.device)
    seqs = []
    for i, temperature in enumerate((1.0, 0.0)):
        engine.add_request(f"d{i}", [5, 6, 7], SamplingParams(temperature=temperature, max_tokens=4, seed=11))
        seqs.append(engine.scheduler.waiting[-1])
    torch.manual_seed(0)
    draws = torch.zeros(64)
    for _ in range(4000):
        sampled, greedy = sampler.sample(logits, seqs)
        assert greedy.token_id == 0
        draws[sampled.token_id] += 1
    assert draws[4:].sum() == 0  # a token of probability 0 is never drawn
    assert torch.allclose(draws[:4] / 4000, probs[:4], atol=0.03), draws[:4] / 4000


def test_a_recorded_prefill_with_decodes_riding_along_reads_the_host_once():
    """The recorded prompt's first token and the riders' next ones come from one draw."""
    from bench.step_counts import HostSyncCounter
    from tests.conftest import encode, engine_of, make_training
    from trainer.config import TrainConfig

    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4))
    engine = engine_of(trainer)
    params = SamplingParams(temperature=1.0, max_tokens=16, min_tokens=8, seed=3)
    for i in range(3):
        engine.add_request(f"rider-{i}", _prompts(3)[i], params)
        engine.step()
    engine.add_request("recorded", encode("A recorded prompt, long enough to span several rows."), params,
                       train=True)
    counter = HostSyncCounter()
    with counter.counting():
        outputs, stats = engine.step()
    assert stats.kind == "recorded_mixed", stats
    assert {output.request_id for output in outputs} >= {"recorded", "rider-0", "rider-1", "rider-2"}
    assert trainer.cache.get("recorded").recording is not None
    assert counter.reads <= 1, dict(counter.sites)


@pytest.mark.parametrize("bucketed", [False, True], ids=["cpu-lengths", "gpu-buckets"])
def test_a_recorded_prefill_keeps_its_key_and_value_rows_where_attention_saved_them(bucketed):
    """The recorded prompt's keys and values are held once: as they are where its key
    length is its own (the CPU's; a zero pad would copy them), as rows of the padded copy
    attention saves where the length is a bucket (a GPU's, forced here) — not a copy
    saved beside the rows kept for the suffixes. Bucketed, the copy is the pad's alone (the
    value, a view of the training copies' fused q|k|v output, is not copied first), and
    the recording trains to the recomputation's gradients."""
    from bench.step_counts import AtenOps
    from engine.recording import SavedTensorTracker
    from engine.step_inputs import StepBuckets
    from tests.conftest import encode, engine_of, make_training
    from tests.test_training import gradients_of, relative_difference
    from trainer.config import TrainConfig

    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4, lora_compute_dtype="model",
                                        record_after_cached_prefix=False),  # the prompt again, recorded whole
                            dtype=torch.bfloat16, init_lora_weights=False)
    engine = engine_of(trainer)
    # the CPU's own lengths, or a GPU's buckets, whatever the test device
    engine.runner.training_buckets = StepBuckets(16, half_octaves=True, max_len=512) if bucketed else None
    engine.runner.exact_shapes = not bucketed
    tracker = engine.runner.record_tracker = SavedTensorTracker()  # the hooks on: what autograd saved
    prompt = encode("A recorded prompt, long enough to span several rows.")
    for request_id in ("warm-up", "recorded"):  # the first builds the training copies (clones)
        engine.add_request(request_id, prompt, SamplingParams(temperature=0.0, max_tokens=4), train=True)
        if request_id == "warm-up":
            while engine.has_unfinished():
                engine.step()
    counter = AtenOps()
    with counter.counting():
        _, stats = engine.step()
    assert stats.kind == "recorded_prefill", stats
    layers = len(trainer.cache.get("recorded").recording.segments)
    assert counter.ops["constant_pad_nd"] == (2 * layers if bucketed else 0), counter.ops
    assert counter.ops["clone"] == (0 if bucketed else layers), counter.ops  # V's own storage where not padded
    entry = trainer.cache.get("recorded")
    saved = set(tracker._storages)  # white-box: the storages autograd holds for the recording
    assert all(t.untyped_storage().data_ptr() in saved for s in entry.recording.segments for t in (s.key, s.value))
    reuse = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    recompute = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    assert relative_difference(reuse, recompute) <= 2e-2  # bfloat16 math
