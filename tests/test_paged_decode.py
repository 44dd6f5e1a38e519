"""Paged decode attention (engine/paged_decode.py): reading K/V in place through block
tables equals gathering them for SDPA — row by row with shared blocks, padded rows and a
sliding window, and token for token in the engine, forks and padded batches included."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from engine.llm_engine import LLMEngine
from engine.paged_decode import PagedDecode, paged_decode_attention
from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_config
from tests.tiny import TEST_DEVICE, tiny_model, tiny_tokenizer

PROMPTS = ["Hello, how are you today?", "Paris", "The quick brown fox jumps over the lazy dog.",
           "One two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen"]


def _gathered(query, keys, values, table, position, size, window):
    """One row's attention the plain way: its context's slots gathered, then SDPA."""
    slots = torch.tensor([block * size + i for block in table for i in range(size)], device=keys.device)[:position + 1]
    if window is not None:
        slots = slots[max(0, position + 1 - window):]
    k, v = keys[slots].transpose(0, 1).unsqueeze(0), values[slots].transpose(0, 1).unsqueeze(0)
    return F.scaled_dot_product_attention(query, k, v, enable_gqa=True)


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("heads", [4, 6])  # 6 over 2 KV heads: FlexAttention's main kernel, not its decoding one
def test_reading_the_pool_in_place_equals_gathering_each_rows_context(window, heads):
    torch.manual_seed(0)
    size, pool_blocks, kv_heads, dim = 16, 12, 2, 16
    keys = torch.randn(pool_blocks * size, kv_heads, dim, device=TEST_DEVICE)
    values = torch.randn(pool_blocks * size, kv_heads, dim, device=TEST_DEVICE)
    # row 1 shares row 0's first two blocks (a fork); row 3 is padding
    tables = [[3, 7, 9], [3, 7, 2], [5], [0]]
    positions = [40, 33, 0, -1]
    width = max(len(t) for t in tables) + 1  # entries past a context must be ignored
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=TEST_DEVICE)
    query = torch.randn(len(tables), heads, 1, dim, device=TEST_DEVICE)
    paged = PagedDecode(table, torch.tensor(positions, device=TEST_DEVICE), size, pool_blocks)
    out = paged_decode_attention(query, keys, values, paged, None, window)
    for row, (blocks, position) in enumerate(zip(tables, positions)):
        if position < 0:
            assert torch.equal(out[row], torch.zeros_like(out[row]))  # a padded row: zeros, not NaN
            continue
        expected = _gathered(query[row:row + 1], keys, values, blocks, position, size, window)
        torch.testing.assert_close(out[row:row + 1], expected, atol=1e-5, rtol=1e-5)


def _engine(family: str, decode_attention: str, **config) -> LLMEngine:
    # small blocks spread a prompt over more of them; on a GPU FlexAttention's key tile is at least 16 tokens
    base = make_config(block_size=16 if TEST_DEVICE.type == "cuda" else 4, **config)
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, decode_attention=decode_attention))
    return LLMEngine.for_model(tiny_model(family), tiny_tokenizer(), base)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_the_engine_serves_the_same_tokens_reading_the_pool_in_place(family):
    """Greedy tokens equal the gathered path's: a batch padded to its bucket, prompts that
    span several blocks, and requests arriving while others decode (mixed steps)."""
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=24, min_tokens=24)
    served = {}
    for mode in ("gather", "flex"):
        engine = _engine(family, mode, max_num_seqs=4)
        paged_steps = []
        pack = engine.runner._pack

        def counting_pack(step, buckets, pack=pack, paged_steps=paged_steps):
            packed = pack(step, buckets)
            paged_steps.append(any(g.paged is not None for g in packed.metadata.groups))
            return packed

        engine.runner._pack = counting_pack
        batched = engine.generate(prompts[:3], params)  # three decoding rows: a batch bucket of 4
        tokens: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):  # each arrives while the ones before it decode: mixed steps
            engine.add_request(f"r{i}", prompt, params)
            for _ in range(3):
                outputs, _ = engine.step()
                for out in outputs:
                    tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        while engine.has_unfinished():
            outputs, _ = engine.step()
            for out in outputs:
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        served[mode] = (batched, tokens)
        assert any(paged_steps) == (mode == "flex")
    assert served["flex"] == served["gather"]


def test_forked_choices_read_their_shared_prompt_blocks_in_place():
    params = SamplingParams(temperature=0.8, seed=7, n=3, max_tokens=10, min_tokens=10)
    prompt = encode(PROMPTS[3])  # more than one block, so the choices share full blocks
    served = {mode: _engine("llama", mode).generate([prompt], params) for mode in ("gather", "flex")}
    assert served["flex"] == served["gather"]


def test_auto_decode_attention_gathers_on_the_cpu():
    """The default, auto: FlexAttention on a GPU (compiled), gathered K/V on the CPU, where
    FlexAttention runs its slow eager reference."""
    engine = _engine("llama", "auto")
    assert engine.runner.paged_decode == (TEST_DEVICE.type == "cuda")
