"""RoPE with a signed sine table (engine/fused_rope.py): the model's own results, to the
bit, in eight ops per layer instead of ten."""

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_apply_rotary_pos_emb

from bench.step_counts import decode_layer_ops
from engine.fused_rope import SignedRotary, install_fused_rope, rotate_query_and_key
from engine.llm_engine import LLMEngine
from tests.conftest import encode, make_config
from tests.test_engine_equivalence import MAX_TOKENS, PROMPTS, greedy, hf_greedy
from tests.tiny import FAMILIES, TEST_DEVICE, tiny_model, tiny_tokenizer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotation_equals_apply_rotary_pos_emb_to_the_bit(dtype):
    model = tiny_model("llama", dtype=dtype)
    positions = torch.tensor([[0, 1, 2, 7, 30, 31, 200]], device=TEST_DEVICE)
    query = torch.randn(1, 4, 7, 16, device=TEST_DEVICE).to(dtype)
    key = torch.randn(1, 2, 7, 16, device=TEST_DEVICE).to(dtype)
    plain = model.model.rotary_emb(query, positions)
    tables = SignedRotary(model.model.rotary_emb)(query, positions)
    expected = apply_rotary_pos_emb(query, key, *plain)
    for embeddings in (plain, tables):
        rotated = rotate_query_and_key(query, key, embeddings)
        for got, want in zip(rotated, expected):
            assert got.shape == want.shape and torch.equal(got, want)
        # a recording keeps each layer's K: it must not keep the query's memory with it
        assert rotated[0].untyped_storage().data_ptr() != rotated[1].untyped_storage().data_ptr()


def test_partial_rotation_equals_phi3s_to_the_bit():
    """Phi-3's partial rotary factor: the dimensions past the tables' pass unrotated."""
    query, key = torch.randn(1, 4, 5, 16, device=TEST_DEVICE), torch.randn(1, 2, 5, 16, device=TEST_DEVICE)
    angles = torch.randn(1, 5, 8, device=TEST_DEVICE)
    cos, sin = angles.cos(), angles.sin()
    expected = phi3_apply_rotary_pos_emb(query, key, cos, sin)
    for got, want in zip(rotate_query_and_key(query, key, (cos, sin)), expected):
        assert torch.equal(got, want)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_models_forward_and_backward_are_unchanged_to_the_bit(family, dtype):
    """The whole model through Hugging Face's own forward (its rotary tables, its SDPA),
    attention swapped or not: the same logits and the same gradient on the embeddings."""
    model = tiny_model(family, dtype=dtype)
    ids = torch.randint(3, model.config.vocab_size, (2, 11), device=TEST_DEVICE)

    def run():
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_()
        logits = model(inputs_embeds=embeddings).logits
        logits.float().logsumexp(-1).sum().backward()
        return logits.detach(), embeddings.grad

    own = run()
    assert install_fused_rope(model) == model.config.num_hidden_layers
    fused = run()
    assert all(type(layer.self_attn).__name__.startswith("Fused") for layer in model.model.layers)
    for a, b in zip(own, fused):
        assert torch.equal(a, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_greedy_tokens_equal_generate_of_an_untouched_model(family):
    """The engine runs the fused RoPE and RMSNorm; `generate` on a separate copy of the
    same model runs the family's own modules: the same greedy tokens."""
    reference = tiny_model(family)
    engine = LLMEngine.for_model(tiny_model(family), tiny_tokenizer(), make_config())
    assert not any(type(m).__name__.startswith("Fused") for m in reference.modules())
    prompts = [encode(p) for p in PROMPTS]
    assert [c[0] for c in engine.generate(prompts, greedy())] == [hf_greedy(reference, p, MAX_TOKENS)
                                                                    for p in prompts]


def test_a_decode_layer_rotates_with_two_rolls_and_no_neg():
    engine = LLMEngine.for_model(tiny_model("llama"), tiny_tokenizer(), make_config())
    counter = decode_layer_ops(engine, layer=1)  # layer 1: no step-wide work (layer 0 builds the mask)
    assert counter.ops["roll"] == 2 and not {"neg", "cat"} & set(counter.ops), dict(counter.ops)


def test_a_window_in_the_config_windows_mistral_and_not_llama():
    """Mistral's attention masks keys older than the config's window: the engine's tokens
    equal `generate`'s. Llama's forward passes no window, even when a checkpoint's config
    carries one: the engine's prefill equals `generate`'s first token. (Past it, the
    `DynamicCache` that `generate` builds from such a config drops old keys, which
    Llama's own prefill does not: the two disagree with each other, not with the engine.)"""
    prompts = [encode(p) for p in PROMPTS]
    for family, max_tokens in (("mistral", MAX_TOKENS), ("llama", 1)):
        reference, served = tiny_model(family), tiny_model(family)
        for model in (reference, served):
            model.config.sliding_window = 4
        engine = LLMEngine.for_model(served, tiny_tokenizer(), make_config())
        assert [c[0] for c in engine.generate(prompts, greedy(max_tokens))] == [
            hf_greedy(reference, p, max_tokens) for p in prompts], family
