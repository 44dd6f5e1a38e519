"""Greedy output of the engine equals Hugging Face `generate`, token for token, for every
supported family: alone, batched with prompts of other lengths, with prefill chunked
across steps, and with sequences preempted and recomputed."""

import dataclasses

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_config, make_engine
from tests.tiny import FAMILIES, TEST_DEVICE, tiny_model, tiny_tokenizer

PROMPTS = ["Hello, how are you today?", "The quick brown fox jumps over the lazy dog. What is the capital of France?",
           "Paris", "Continuous batching lets new requests join"]
MAX_TOKENS = 24


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt], device=model.device), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def greedy(max_tokens=MAX_TOKENS):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_generate_alone_and_batched(family):
    engine = make_engine(family, max_num_batched_tokens=11)  # forces chunked prefills
    prompts = [encode(p) for p in PROMPTS]
    reference = [hf_greedy(engine.model, p, MAX_TOKENS) for p in prompts]
    batched = [choices[0] for choices in engine.generate(prompts, greedy())]
    alone = [engine.generate([p], greedy())[0][0] for p in prompts]
    assert batched == reference
    assert alone == reference


def test_greedy_equals_generate_under_preemption():
    # 12 blocks of 4 tokens: four sequences growing to ~40 tokens cannot all fit
    engine = make_engine("llama", kv_cache_bytes=12 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=48)
    prompts = [encode(p)[:16] for p in PROMPTS]
    reference = [hf_greedy(engine.model, p, MAX_TOKENS) for p in prompts]
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, greedy())
    outputs, preempted = [[] for _ in prompts], 0
    while engine.has_unfinished():
        step_outputs, stats = engine.step()
        preempted += stats.num_preempted
        for out in step_outputs:
            outputs[int(out.request_id[1:])] += out.outputs[0].token_ids
    assert preempted > 0
    assert outputs == reference


def test_requests_join_a_running_batch_at_step_boundaries():
    engine = make_engine("qwen2")
    first, second = encode(PROMPTS[0]), encode(PROMPTS[1])
    engine.add_request("a", first, greedy())
    for _ in range(5):
        engine.step()
    engine.add_request("b", second, greedy())
    tokens = {"a": [], "b": []}
    while engine.has_unfinished():
        outputs, _ = engine.step()
        for out in outputs:
            tokens[out.request_id].extend(out.outputs[0].token_ids)
    ref_a = hf_greedy(engine.model, first, MAX_TOKENS)
    assert tokens["a"] == ref_a[5:]
    assert tokens["b"] == hf_greedy(engine.model, second, MAX_TOKENS)


@pytest.mark.gpu
def test_greedy_equals_generate_on_cuda():
    model = tiny_model("llama").to("cuda")
    engine = LLMEngine.for_model(model, tiny_tokenizer(), make_config())
    prompts = [encode(p) for p in PROMPTS]
    with torch.inference_mode():
        reference = [model.generate(torch.tensor([p], device="cuda"), max_new_tokens=MAX_TOKENS,
                                    min_new_tokens=MAX_TOKENS, do_sample=False,
                                    pad_token_id=0)[0, len(p):].tolist() for p in prompts]
    assert [c[0] for c in engine.generate(prompts, greedy())] == reference


@pytest.mark.skipif(TEST_DEVICE.type != "cpu", reason="oneDNN packing is a CPU path")
def test_packed_linear_engine_equals_plain_linear_engine():
    prompts = [encode(p) for p in PROMPTS]
    packed = make_engine("qwen2")  # qwen2: biased q/k/v projections go through the packed path too
    plain_config = make_config()
    plain_config = dataclasses.replace(plain_config, model=dataclasses.replace(plain_config.model,
                                                                               packed_linear=False))
    plain = LLMEngine.for_model(tiny_model("qwen2"), tiny_tokenizer(), plain_config)
    assert any(type(m).__name__ == "PackedLinear" for m in packed.model.modules())
    assert not any(type(m).__name__ == "PackedLinear" for m in plain.model.modules())
    assert packed.generate(prompts, greedy()) == plain.generate(prompts, greedy())


@pytest.mark.parametrize("family", FAMILIES)
def test_the_layers_get_the_cache_by_the_name_their_forward_declares(family):
    """transformers renamed the decoder layers' `past_key_values` to `cache`: passing the
    old name warns on every family, and stops working once the old name is gone."""
    import warnings
    engine = make_engine(family)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tokens = engine.generate([encode(PROMPTS[1])], greedy(4))[0][0]
    assert len(tokens) == 4
    assert not [w for w in caught if "past_key_values" in str(w.message)]
