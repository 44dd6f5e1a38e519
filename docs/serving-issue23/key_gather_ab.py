"""The serving step's key gather on the CPU: a decode step gathers each sequence's keys and
values out of the pool by cache slot (`AttentionGroup.key_slots`; the GPU reads the pool
in place instead, engine/paged_decode.py). Before 2026-11-27 the gather was advanced
indexing (`pool[key_slots]`); it is now `gather_rows`, an `index_select` (the same values).
This script runs the embedded model's decode steps (8 greedy streams of 64 tokens on
prompts of 200-291 tokens) with the attention function as it was (`old_forward`, kept
here) and as it is, registered in turn, alternating over 8 rounds: the median decode
step of each. Run from the repository root:

    PYTHONPATH=. .venv/bin/python docs/serving-issue23/key_gather_ab.py
"""

import statistics
import time

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from bench.traces import synthetic_tokens
from engine.attention import ATTENTION_NAME, paged_attention_forward
from engine.kv_cache import AttentionMetadata, gather_rows
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.paged_decode import paged_decode_attention
from engine.sampling_params import SamplingParams
from server.config import load_config


def old_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """engine/attention.py's paged_attention_forward before the change."""
    if not isinstance(attention_mask, AttentionMetadata):
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    meta = attention_mask
    heads, head_dim = query.shape[1], query.shape[3]
    packed = query[0].transpose(0, 1)
    pooled = key.dim() == 3
    outputs = []
    window = kwargs.get("sliding_window")
    for group in meta.groups:
        queries = gather_rows(packed, group.query_index).transpose(1, 2)
        if pooled and group.paged is not None:
            out = paged_decode_attention(queries, key, value, group.paged, scaling, window)
        else:
            keys, values = (key[group.key_slots].transpose(1, 2), value[group.key_slots].transpose(1, 2)) if pooled \
                else (key, value)
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask(window, queries.dtype),
                                                 scale=scaling, enable_gqa=keys.shape[1] != heads)
        outputs.append(out.transpose(1, 2).reshape(-1, heads, head_dim))
    out = gather_rows(outputs[0] if len(outputs) == 1 else torch.cat(outputs), meta.output_index)
    return out.unsqueeze(0), None


def main() -> None:
    config = load_config()
    model, tokenizer, _ = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    prompts = [synthetic_tokens(tokenizer, 200 + 13 * i, i) for i in range(8)]

    def decode_step_seconds() -> float:
        for i, prompt in enumerate(prompts):
            engine.add_request(f"r{time.monotonic_ns()}-{i}", prompt,
                               SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
        engine.step()  # the prefill
        started, steps = time.perf_counter(), 0
        while engine.has_unfinished():
            engine.step()
            steps += 1
        return (time.perf_counter() - started) / steps

    ways = {"index (before)": old_forward, "index_select (after)": paged_attention_forward}
    for way in ways.values():  # warm-up
        AttentionInterface.register(ATTENTION_NAME, way)
        decode_step_seconds()
    seconds = {name: [] for name in ways}
    for r in range(8):
        for name in (list(ways) if r % 2 == 0 else list(ways)[::-1]):
            AttentionInterface.register(ATTENTION_NAME, ways[name])
            seconds[name].append(decode_step_seconds())
    AttentionInterface.register(ATTENTION_NAME, paged_attention_forward)
    median = {name: statistics.median(s) for name, s in seconds.items()}
    for name, s in seconds.items():
        print(f"{name}: median decode step {median[name] * 1e3:.1f} ms; rounds {[round(x * 1e3, 1) for x in s]}")
    print(f"before / after: {median['index (before)'] / median['index_select (after)']:.3f}x")


if __name__ == "__main__":
    main()
