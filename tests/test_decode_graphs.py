"""The static-shape decode step (engine/decode_graphs.py): padded rows write only the
scratch slot, the padded step is token-equal to generate, and on a GPU the replayed CUDA
graphs equal the eager step — before and after an optimizer step and a rollback."""

import dataclasses
import logging

import pytest
import torch

from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from engine.step_inputs import StepBuckets
from server.build import build_training_engine
from tests.conftest import encode, make_config
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.config import TrainConfig

PROMPTS = ["Hello, how are you today?", "Paris", "The quick brown fox jumps over the lazy dog."]


def _greedy(max_tokens: int = 12) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens)


def test_buckets_cover_every_batch_and_context():
    buckets = StepBuckets(block_size=16)
    assert buckets.all_batches(24) == [1, 2, 4, 8, 16, 32]
    assert buckets.all_keys(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    odd = StepBuckets(block_size=12)
    for n in range(1, 300):
        keys = odd.keys(n)
        assert keys >= n and keys % 12 == 0 and keys in odd.all_keys(300)


def test_padded_decode_rows_write_only_the_scratch_block():
    engine = LLMEngine.for_model(tiny_model("llama"), tiny_tokenizer(), make_config())
    engine.runner.exact_shapes = False  # a GPU's layout (the CPU pads nothing)
    cache, allocator = engine.runner.kv_cache, engine.scheduler.allocator
    size = cache.spec.block_size
    handed_out, static_steps = set(), []
    allocate, pack = allocator.allocate, engine.runner._pack

    def recording_allocate(count):
        blocks = allocate(count)
        handed_out.update(blocks)
        return blocks

    def recording_pack(step, buckets):
        packed = pack(step, buckets)
        static_steps.append(packed.static)
        return packed

    allocator.allocate, engine.runner._pack = recording_allocate, recording_pack
    engine.generate([encode(p) for p in PROMPTS], _greedy())  # three sequences: a batch bucket of 4
    assert any(static_steps), "no decode step took the static path"
    written = {slot // size for slot in cache.keys[0].abs().sum(dim=(1, 2)).nonzero().flatten().tolist()}
    assert cache.num_blocks in written  # the scratch block: the padded row wrote there
    assert written - {cache.num_blocks} <= handed_out


@pytest.mark.gpu
@pytest.mark.parametrize("decode_attention", ["gather", "flex"])
def test_replayed_decode_equals_eager_before_and_after_an_optimizer_step_and_a_rollback(decode_attention):
    config = make_config(max_num_seqs=4, max_model_len=64, block_size=16)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, decode_attention=decode_attention))
    engine, training = build_training_engine(tiny_model("llama").to("cuda"), tiny_tokenizer(), config,
                                             TrainConfig(mode="cpt", lora_rank=8))
    graphs = engine.runner.decode_graphs
    assert graphs.enabled and graphs.graphs, "no CUDA graph was captured"
    assert engine.runner.paged_decode == (decode_attention == "flex"), "FlexAttention did not compile"
    prompts = [encode(p) for p in PROMPTS]

    def both() -> tuple[list, list]:
        replays = graphs.replays
        replayed = engine.generate(prompts, _greedy())
        assert graphs.replays > replays
        graphs.enabled = False
        try:
            eager = engine.generate(prompts, _greedy())
        finally:
            graphs.enabled = True
        return replayed, eager

    lora = [p for name, p in training.peft_model.named_parameters() if "lora_" in name]
    saved = training.lifecycle.snapshot()
    replayed, eager = both()
    assert replayed == eager
    optimizer = torch.optim.AdamW(lora, lr=0.5)
    for p in lora:
        p.grad = torch.randn_like(p)
    optimizer.step()  # in place, as the trainer's optimizer changes the adapter
    training.lifecycle.after_step(True)  # the serving copy follows, in place
    stepped, stepped_eager = both()
    assert stepped == stepped_eager and stepped != replayed
    training.lifecycle.restore(saved, saved.version + 2)  # a rollback: the saved weights, in place
    assert both() == (replayed, eager)


@pytest.mark.gpu
def test_enforce_eager_captures_nothing():
    config = make_config()
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, enforce_eager=True))
    engine = LLMEngine.for_model(tiny_model("llama").to("cuda"), tiny_tokenizer(), config)
    assert not engine.runner.decode_graphs.graphs and engine.graph_capture is None


@pytest.mark.gpu
def test_paged_decode_graphs_are_one_per_batch_and_serve_the_gathered_tokens():
    """With decode attention reading the pool in place, a graph's shape is its batch alone,
    and the replayed, compiled FlexAttention serves the tokens the gathered path serves."""
    served = {}
    for mode in ("gather", "flex"):
        config = make_config(max_num_seqs=4, max_model_len=64, block_size=16)  # FlexAttention's smallest GPU key tile
        config = dataclasses.replace(config, model=dataclasses.replace(config.model, decode_attention=mode))
        engine = LLMEngine.for_model(tiny_model("llama").to("cuda"), tiny_tokenizer(), config)
        graphs = engine.runner.decode_graphs
        assert engine.runner.paged_decode == (mode == "flex"), "FlexAttention did not compile"
        served[mode] = engine.generate([encode(p) for p in PROMPTS], _greedy(24))
        if mode == "flex":
            assert len(graphs.graphs) == len(engine.runner.decode_batches) and graphs.replays > 0
    assert served["flex"] == served["gather"]


@pytest.mark.gpu
def test_kv_blocks_smaller_than_flex_attentions_gpu_key_tile_gather_instead(caplog):
    """FlexAttention's GPU kernel needs key tiles of at least 16 tokens: with 4-token KV
    blocks the engine says so at start, without trying to compile, and gathers."""
    config = make_config(max_num_seqs=4, max_model_len=64, block_size=4)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, decode_attention="flex"))
    with caplog.at_level(logging.ERROR, logger="engine.model_runner"):
        engine = LLMEngine.for_model(tiny_model("llama").to("cuda"), tiny_tokenizer(), config)
    assert not engine.runner.paged_decode and engine.runner.decode_graphs.graphs
    assert "key tile" in caplog.text


@pytest.mark.gpu
def test_auto_decode_attention_reads_the_pool_in_place_on_a_gpu():
    config = make_config(max_num_seqs=4, max_model_len=64, block_size=16)
    assert config.model.decode_attention == "auto"
    engine = LLMEngine.for_model(tiny_model("llama").to("cuda"), tiny_tokenizer(), config)
    assert engine.runner.paged_decode and len(engine.runner.decode_graphs.graphs) == len(engine.runner.decode_batches)
