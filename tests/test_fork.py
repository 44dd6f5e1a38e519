"""One prefill for n choices: the choices of a request fork choice 0's prompt KV blocks.

Against the plain path (`fork_choices=False`, no prefix cache: every choice prefills the prompt itself):
the same tokens for greedy and seeded sampling, alone, batched, chunked and under
preemption; the prompt is computed once; every block is free again at the end."""

from dataclasses import dataclass

import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import encode, make_engine
from tests.test_engine_equivalence import PROMPTS, hf_greedy


def seeded(n: int, max_tokens: int = 12, seed: int = 7) -> SamplingParams:
    return SamplingParams(n=n, temperature=1.0, seed=seed, max_tokens=max_tokens, min_tokens=max_tokens)


@dataclass
class Totals:
    # tokens the engine computed, and sequences it preempted, in all
    computed: int = 0
    preempted: int = 0


def run(engine, prompts, params):
    """generate(), and what the engine did to produce it (Totals)."""
    totals = Totals()
    ids = [f"r{i}" for i in range(len(prompts))]
    results = {rid: [[] for _ in range(params.n)] for rid in ids}
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, params)
    while engine.has_unfinished():
        outputs, stats = engine.step()
        totals.computed += stats.num_scheduled_tokens
        totals.preempted += stats.num_preempted
        for out in outputs:
            for c in out.outputs:
                results[out.request_id][c.index].extend(c.token_ids)
    return [results[rid] for rid in ids], totals


def assert_all_blocks_free(engine):
    allocator = engine.scheduler.allocator
    assert allocator.num_free == allocator.num_blocks
    assert all(allocator.refs(b) == 0 for b in range(allocator.num_blocks))


@pytest.mark.parametrize("prompt_len", [8, 11])  # a whole number of 4-token blocks, and a partial last block
def test_seeded_choices_equal_the_per_choice_path_and_prefill_once(prompt_len):
    prompt = (encode(PROMPTS[1]) * 2)[:prompt_len]
    forked_engine, plain_engine = make_engine(), make_engine(fork_choices=False, enable_prefix_caching=False)
    forked, forked_totals = run(forked_engine, [prompt], seeded(4))
    plain, plain_totals = run(plain_engine, [prompt], seeded(4))
    assert forked == plain
    assert len({tuple(c) for c in forked[0]}) > 1  # the choices differ: each has its own generator
    # the plain path computes the prompt 4 times; the forked one once (decodes are equal)
    assert plain_totals.computed - forked_totals.computed == 3 * prompt_len
    assert_all_blocks_free(forked_engine)


def test_greedy_choices_equal_generate_batched_and_chunked():
    engine = make_engine(max_num_batched_tokens=7)  # chunks every prompt
    prompts = [encode(p) for p in PROMPTS]
    params = SamplingParams(n=3, temperature=0.0, max_tokens=10, min_tokens=10)
    outputs, _ = run(engine, prompts, params)
    for prompt, choices in zip(prompts, outputs):
        reference = hf_greedy(engine.model, prompt, 10)
        assert choices == [reference] * 3
    assert_all_blocks_free(engine)


def test_forked_choices_share_the_prompt_blocks_and_own_the_partial_one():
    engine = make_engine()
    prompt = encode(PROMPTS[1])[:10]  # blocks of 4: two full, one partial
    engine.add_request("r", prompt, seeded(3))
    engine.step()
    parent, *children = engine.outputs.requests["r"]
    allocator = engine.scheduler.allocator
    for child in children:
        assert child.block_ids[:2] == parent.block_ids[:2]
        assert child.block_ids[2] != parent.block_ids[2]
    assert [allocator.refs(b) for b in parent.block_ids[:2]] == [3, 3]
    assert allocator.refs(parent.block_ids[2]) == 1
    while engine.has_unfinished():
        engine.step()
    assert_all_blocks_free(engine)


def test_forked_choices_under_preemption_equal_the_per_choice_path():
    # 14 blocks of 4 tokens for 2 requests x 3 choices growing to 16 + 20 tokens
    kwargs = dict(kv_cache_bytes=14 * 4 * 2 * 2 * 2 * 16 * 4, max_model_len=48)
    forked_engine, plain_engine = make_engine(**kwargs), make_engine(fork_choices=False, enable_prefix_caching=False, **kwargs)
    prompts = [encode(p)[:16] for p in PROMPTS[:2]]
    forked, totals = run(forked_engine, prompts, seeded(3, max_tokens=20))
    plain, _ = run(plain_engine, prompts, seeded(3, max_tokens=20))
    assert totals.preempted > 0
    assert forked == plain
    assert_all_blocks_free(forked_engine)


# a 28-token prompt in chunks of 8: queued, prefill half done (choices wait to fork), forked and decoding
@pytest.mark.parametrize("steps_before_abort", [0, 2, 6])
def test_abort_frees_forked_and_waiting_choices(steps_before_abort):
    engine = make_engine(max_num_batched_tokens=8)
    engine.add_request("r", encode(PROMPTS[1]), seeded(4, max_tokens=20))
    for _ in range(steps_before_abort):
        engine.step()
    parent, *children = engine.outputs.requests["r"]
    assert bool(parent.fork_children) == (steps_before_abort < 4)
    output = engine.abort_request("r")
    assert output.finished and len(output.outputs) == 4
    assert not engine.has_unfinished()
    assert_all_blocks_free(engine)


def test_choices_that_cannot_fork_are_prefilled_alone():
    engine = make_engine(max_num_seqs=2)  # room for the parent and one forked choice
    forked, _ = run(engine, [encode(PROMPTS[0])], seeded(4))
    plain, _ = run(make_engine(fork_choices=False, enable_prefix_caching=False, max_num_seqs=2), [encode(PROMPTS[0])], seeded(4))
    assert forked == plain
    assert_all_blocks_free(engine)
