"""Automatic prefix caching (engine/block_pool.py, engine/scheduler.py).

Against the plain path (`enable_prefix_caching=False`): the same tokens, greedy and
seeded, for requests that share a beginning, chunked, preempted, forked, on every family;
fewer tokens computed by exactly the cached ones; nothing read across salts, for prompt
log-probs, or after the weights serving runs with changed; a recorded prefill reads it
unless told to record its whole prompt (tests/test_recorded_after_cached_prefix.py)."""

import itertools
import json

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import Phi3Config, Phi3ForCausalLM

from bench.report import read_metric

from engine.block_pool import BlockPool, block_names, cache_root
from engine.hooks import EngineHooks
from engine.kv_cache import KVCacheSpec
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.conftest import encode, engine_of, make_config
from tests.servers import TINY_NAME, tiny_app
from tests.test_fork import assert_all_blocks_free
from tests.test_training import make_trainer
from tests.tiny import FAMILIES, tiny_model, tiny_tokenizer

SYSTEM = encode("You are a careful assistant. Answer in one short sentence, and never guess. " * 2)
QUESTIONS = ["What is the capital of France?", "Name a prime number.", "Why is the sky blue?"]


def make_engine(caching: bool, family: str = "llama", model=None, generation=None, **config_kwargs) -> LLMEngine:
    config = make_config(enable_prefix_caching=caching, **config_kwargs)
    torch.manual_seed(0)
    return LLMEngine.for_model(model or tiny_model(family), tiny_tokenizer(), config,
                               EngineHooks(weights_generation=generation))


def run_one_by_one(engine, prompts, params, salts=None):
    """Each prompt to its end before the next: its tokens, its cached prompt tokens; and the
    tokens the engine computed in all."""
    results, computed = [], 0
    for i, prompt in enumerate(prompts):
        request = engine.make_request(f"r{next(_ids)}", prompt, params, cache_salt=salts[i] if salts else None)
        engine.add(request)
        tokens, cached = [], None
        while engine.has_unfinished():
            outputs, stats = engine.step()
            computed += stats.num_scheduled_tokens
            for out in outputs:
                tokens += out.outputs[0].token_ids
                cached = out.metrics.num_cached_tokens
        results.append((tokens, cached))
    return results, computed


_ids = itertools.count()
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def test_block_names_chain_on_what_comes_before():
    root = cache_root(0)
    first = block_names(root, [1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    assert len(first) == 2  # the partial last block has no name
    assert block_names(root, [1, 2, 3, 4, 5, 6, 7, 8], 4) == first
    assert block_names(root, [0, 2, 3, 4, 5, 6, 7, 8], 4)[1] != first[1]  # the same tokens after others
    assert block_names(cache_root(1), [1, 2, 3, 4], 4)[0] != first[0]  # other weights
    assert block_names(cache_root(0, "tenant"), [1, 2, 3, 4], 4)[0] != first[0]  # another salt
    assert block_names(first[0], [5, 6, 7, 8], 4) == first[1:]  # extended a block at a time


def test_a_freed_named_block_is_given_to_other_tokens_last_and_least_recently_freed_first():
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.name(a, b"a")
    pool.name(b, b"b")
    pool.free([b, a, c])
    assert pool.num_free == 4 and pool.num_named == 2
    assert pool.allocate(2) == [3, c]  # nameless blocks first
    assert pool.take_cached_prefix([b"a", b"x", b"b"]) == [a]  # the longest run from the first
    pool.free([a])  # freed after b: b is now the least recently freed
    assert pool.allocate(1) == [b] and pool.num_named == 1
    assert pool.take_cached_prefix([b"b"]) == []  # its name went with it
    pool.forget_names()
    assert pool.num_named == 0 and pool.allocate(1) == [a]


@pytest.mark.parametrize("family", FAMILIES)
def test_prompts_sharing_a_beginning_take_its_blocks_and_answer_as_the_plain_path(family):
    prompts = [SYSTEM + encode(q) for q in QUESTIONS] + [SYSTEM + encode(QUESTIONS[0])]
    plain, plain_computed = run_one_by_one(make_engine(False, family), prompts, GREEDY)
    engine = make_engine(True, family)
    cached, cached_computed = run_one_by_one(engine, prompts, GREEDY)
    assert [t for t, _ in cached] == [t for t, _ in plain]
    full = len(SYSTEM) // 4 * 4
    hits = [c for _, c in cached]
    assert hits[0] == 0 and hits[1] == hits[2] == full
    assert hits[3] == (len(prompts[3]) - 1) // 4 * 4  # its own question's blocks too
    assert plain_computed - cached_computed == sum(hits)
    assert_all_blocks_free(engine)


def test_prompts_admitted_in_one_step_take_the_blocks_it_computes_for_the_first():
    prompts = [SYSTEM + encode(q) for q in QUESTIONS]

    def together(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"s{i}", prompt, GREEDY)
        got, computed, cached = {}, 0, {}
        first = engine.step()[1]  # all three admitted in one step
        computed += first.num_scheduled_tokens
        while engine.has_unfinished():
            outputs, stats = engine.step()
            computed += stats.num_scheduled_tokens
            for o in outputs:
                got[o.request_id] = got.get(o.request_id, []) + o.outputs[0].token_ids
                cached[o.request_id] = o.metrics.num_cached_tokens
        return got, computed, cached

    plain, plain_computed, _ = together(make_engine(False, max_num_batched_tokens=512))
    engine = make_engine(True, max_num_batched_tokens=512)
    shared, shared_computed, cached = together(engine)
    full = len(SYSTEM) // 4 * 4
    assert shared == plain and cached == {"s0": 0, "s1": full, "s2": full}
    assert plain_computed - shared_computed == 2 * full
    assert_all_blocks_free(engine)


class _FailsOnce:
    """Replaces `owner.name` with a function that raises once, then puts the original back."""

    def __init__(self, owner, name: str):
        self.owner, self.name, self.original = owner, name, getattr(owner, name)
        setattr(owner, name, self)

    def __call__(self, *args, **kwargs):
        setattr(self.owner, self.name, self.original)
        raise RuntimeError("the device fell over")


class _RoomMaker:
    """A memory guard (the offloader's seam) that does nothing."""

    def before_step(self, *args):
        pass

    def after_step(self):
        pass


class _RefusingRecorder:
    """A recorder (the trainer's seam) whose admission of a prefill raises."""

    wants_served_logprobs = False

    def logprob_temperature(self, temperature, n):
        return 1.0

    def expect(self, request_id, expected=True):
        pass

    def admit(self, *args):
        raise RuntimeError("the recorder fell over")


@pytest.mark.parametrize("where", ["forward", "memory_guard", "admission"])
def test_a_step_that_fails_leaves_no_name_and_no_taken_block_on_what_it_was_to_compute(where):
    """Two prompts alike in one step, the step fails (in its forward, in the memory guard before
    it, or while scheduling it, after the first prompt was admitted and its blocks named): the
    first is aborted, the second goes on — and computes its tokens, not the first's unwritten ones."""
    engine = make_engine(True, max_num_batched_tokens=512)
    prompt = SYSTEM + encode(QUESTIONS[0])
    if where == "forward":
        _FailsOnce(engine.runner, "execute")
    elif where == "memory_guard":
        guard = _RoomMaker()
        engine.hooks = EngineHooks(memory_guard=guard)
        _FailsOnce(guard, "before_step")
    elif where == "admission":  # the second is trainable: the recorder is asked about it, and raises
        engine.hooks = EngineHooks(recorder=_RefusingRecorder())
    engine.add_request("first", prompt, GREEDY)
    engine.add_request("second", prompt, GREEDY, train=where == "admission")
    with pytest.raises(RuntimeError):
        engine.step()
    assert engine.scheduler.allocator.num_named == 0
    engine.hooks = EngineHooks()
    engine.abort_request("first")
    tokens = []
    while engine.has_unfinished():
        for output in engine.step()[0]:
            tokens += output.outputs[0].token_ids
    assert tokens == run_one_by_one(make_engine(False), [prompt], GREEDY)[0][0][0]


def test_seeded_sampling_and_several_choices_are_unchanged_by_the_cache():
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    prompts = [SYSTEM + encode(q) for q in QUESTIONS]

    def choices(engine):
        out = []
        for prompt in prompts:
            engine.add_request(f"r{next(_ids)}", prompt, params)
            got = [[] for _ in range(3)]
            while engine.has_unfinished():
                for o in engine.step()[0]:
                    for c in o.outputs:
                        got[c.index] += c.token_ids
            out.append(got)
        return out

    assert choices(make_engine(True)) == choices(make_engine(False))


def test_a_cached_beginning_followed_by_chunks_and_preemptions_answers_as_the_plain_path():
    # 14 blocks of 4 tokens for everything: the sequences preempt one another
    bytes_per_token = KVCacheSpec.from_model_config(tiny_model("llama").config, torch.float32, 4).bytes_per_token
    small = dict(kv_cache_bytes=14 * 4 * bytes_per_token, max_num_batched_tokens=16, max_model_len=52)
    prompts = [SYSTEM[:20] + encode(q) for q in QUESTIONS]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def together(engine):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"c{i}", prompt, params)
        got, preempted, hits = {f"c{i}": [] for i in range(len(prompts))}, 0, 0
        while engine.has_unfinished():
            outputs, stats = engine.step()
            preempted += stats.num_preempted
            hits += stats.prefix_cache_hits
            for o in outputs:
                got[o.request_id] += o.outputs[0].token_ids
        return got, preempted

    engine = make_engine(True, **small)
    assert engine.scheduler.allocator.num_blocks == 14
    plain, _ = together(make_engine(False, **small))
    run_one_by_one(engine, [prompts[0]], params)  # its blocks cached
    cached, preempted = together(engine)
    assert cached == plain and preempted > 0
    assert_all_blocks_free(engine)


def test_prompt_log_probs_are_computed_for_every_position_not_read_from_the_cache():
    prompt = SYSTEM + encode(QUESTIONS[0])
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0)

    def scored(engine):
        engine.add_request(f"p{next(_ids)}", prompt, params)
        logprobs, cached, queries = None, None, 0
        while engine.has_unfinished():
            outputs, stats = engine.step()
            queries += stats.prefix_cache_queries
            for o in outputs:
                logprobs = o.prompt_logprobs or logprobs
                cached = o.metrics.num_cached_tokens
        return [lp.logprob if lp else None for lp in logprobs], cached, queries

    engine = make_engine(True)
    run_one_by_one(engine, [prompt], GREEDY)
    with_cache, cached, queries = scored(engine)
    assert cached == 0 and queries == 0  # (a lookup it could not make is not counted as a miss, as in vLLM)
    assert with_cache == pytest.approx(scored(make_engine(False))[0], abs=1e-5)


def longrope_phi3():
    """A tiny Phi-3 whose RoPE switches to its long factors past 32 positions (Phi-3's 128k models')."""
    tokenizer = tiny_tokenizer()
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                        original_max_position_embeddings=32, pad_token_id=tokenizer.pad_token_id,
                        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [8.0] * 8})
    model = Phi3ForCausalLM(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() == 2:
                parameter.normal_(0.0, 0.15)
    return model


def test_a_rope_that_follows_the_steps_length_turns_the_cache_off():
    """A key rotated by a short step's factors is not the key a long step rotates: a cached
    short prompt would change what a longer one that begins with it generates."""
    model = longrope_phi3()
    prompts = [SYSTEM[:24], SYSTEM[:60]]
    engine = make_engine(True, model=model, max_num_batched_tokens=256)
    cached, _ = run_one_by_one(engine, prompts, GREEDY)
    assert cached == run_one_by_one(make_engine(False, model=model, max_num_batched_tokens=256), prompts, GREEDY)[0]
    assert not engine.scheduler.prefix_caching


def test_prompts_salted_otherwise_share_no_blocks():
    prompts = [SYSTEM + encode(q) for q in QUESTIONS]
    results, _ = run_one_by_one(make_engine(True), prompts, GREEDY, salts=["alice", "bob", "alice"])
    assert [c for _, c in results] == [0, 0, len(SYSTEM) // 4 * 4]


def test_after_the_weights_change_nothing_computed_before_is_read():
    model, generation = tiny_model("llama"), [0]
    engine = make_engine(True, model=model, generation=lambda: generation[0])
    prompt = SYSTEM + encode(QUESTIONS[0])
    run_one_by_one(engine, [prompt], GREEDY)
    with torch.no_grad():  # the weights serving runs with change, as an optimizer step changes them
        for layer in model.model.layers:
            layer.self_attn.k_proj.weight.mul_(1.5)
    generation[0] += 1
    after, _ = run_one_by_one(engine, [prompt], GREEDY)
    assert after[0][1] == 0
    # the blocks named before hold no name now: only what the new weights computed is named
    assert engine.scheduler.allocator.num_named == (len(prompt) + GREEDY.max_tokens - 1) // 4
    assert after[0][0] == run_one_by_one(make_engine(False, model=model), [prompt], GREEDY)[0][0][0]
    again, _ = run_one_by_one(engine, [prompt], GREEDY)  # what the new weights computed is cached
    assert again[0][1] > 0 and again[0][0] == after[0][0]


def _serve(trainer, prompt, train, params=GREEDY):
    engine = engine_of(trainer)
    engine.add_request(f"t{next(_ids)}", prompt, params, train=train)
    tokens, cached = [], None
    while engine.has_unfinished():
        for o in engine.step()[0]:
            tokens += o.outputs[0].token_ids
            cached = o.metrics.num_cached_tokens
    return tokens, cached


@pytest.mark.parametrize("reads", [True, False])
def test_a_recorded_prefill_reads_the_cache_and_an_optimizer_step_empties_it(reads):
    """A recorded prefill records the prompt after its cached beginning (or, with
    `train.record_after_cached_prefix = false`, its whole prompt); an optimizer step changes
    the weights serving runs with, and nothing cached before is read again."""
    trainer = make_trainer(mode="cpt", record_after_cached_prefix=reads)
    prompt = SYSTEM + encode(QUESTIONS[1])
    assert _serve(trainer, prompt, train=False)[1] == 0
    assert _serve(trainer, prompt, train=False)[1] > 0
    _, cached = _serve(trainer, prompt, train=True)  # recorded: CPT trains on every prompt
    assert cached == ((len(prompt) - 1) // 4 * 4 if reads else 0)
    [entry] = [e for e in trainer.cache.entries() if e.recording is not None]
    assert entry.recording.prefix_len == cached and entry.recording.rows == len(prompt) - cached
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1  # the serving weights changed: nothing before is read
    tokens, cached = _serve(trainer, prompt, train=False)
    assert cached == 0
    again, cached = _serve(trainer, prompt, train=False)
    assert cached > 0 and again == tokens


def test_what_a_recorded_prefill_computed_is_read_by_the_prompts_after_it():
    trainer = make_trainer(mode="cpt")
    # one token: the request ends with its recorded step (no decode step names its blocks later)
    _serve(trainer, SYSTEM + encode(QUESTIONS[1]), train=True, params=SamplingParams(temperature=0.0, max_tokens=1))
    assert [e.recording is not None for e in trainer.cache.entries()] == [True]
    assert _serve(trainer, SYSTEM + encode(QUESTIONS[2]), train=False)[1] == len(SYSTEM) // 4 * 4


SYSTEM_TEXT = "You are a careful assistant. Answer in one short sentence, and never guess. " * 3


@pytest.fixture(scope="module")
def client():
    with TestClient(tiny_app(max_model_len=256)) as c:
        yield c


def _cached(usage: dict) -> int:
    return usage["prompt_tokens_details"]["cached_tokens"]


def test_usage_says_how_many_prompt_tokens_came_from_the_cache(client):
    def chat(question, salt, stream=False):
        body = {"model": TINY_NAME, "max_tokens": 4, "temperature": 0, "cache_salt": salt,
                "messages": [{"role": "system", "content": SYSTEM_TEXT}, {"role": "user", "content": question}]}
        if not stream:
            return client.post("/v1/chat/completions", json=body).json()["usage"]
        body.update(stream=True, stream_options={"include_usage": True})
        with client.stream("POST", "/v1/chat/completions", json=body) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        return events[-1]["usage"]

    before = client.get("/metrics").text
    first = chat("What is the capital of France?", "usage-test")
    second = chat("Why is the sky blue?", "usage-test")
    streamed = chat("Name a prime number.", "usage-test", stream=True)
    other_tenant = chat("Why is the sky blue?", "usage-test-2")
    assert _cached(first) == 0 and _cached(other_tenant) == 0
    assert 0 < _cached(second) < second["prompt_tokens"] and _cached(second) % 4 == 0
    assert _cached(streamed) == _cached(second)
    after = client.get("/metrics").text
    queries = read_metric(after, "alchemist:prefix_cache_queries_total") - read_metric(
        before, "alchemist:prefix_cache_queries_total")
    hits = read_metric(after, "alchemist:prefix_cache_hits_total") - read_metric(
        before, "alchemist:prefix_cache_hits_total")
    assert queries == sum(u["prompt_tokens"] for u in (first, second, streamed, other_tenant))
    assert hits == _cached(second) + _cached(streamed)


def test_completions_and_responses_report_cached_tokens_too(client):
    prompt = SYSTEM_TEXT + "Question: what is two and two?"
    body = {"model": TINY_NAME, "prompt": prompt, "max_tokens": 2, "cache_salt": "completions-test"}
    assert _cached(client.post("/v1/completions", json=body).json()["usage"]) == 0
    usage = client.post("/v1/completions", json=body).json()["usage"]
    assert 0 < _cached(usage) < usage["prompt_tokens"]
    request = {"model": TINY_NAME, "instructions": SYSTEM_TEXT, "input": "Hi", "max_output_tokens": 16,
               "cache_salt": "responses-test"}
    assert client.post("/v1/responses", json=request).json()["usage"]["input_tokens_details"]["cached_tokens"] == 0
    again = client.post("/v1/responses", json=request).json()["usage"]
    assert 0 < again["input_tokens_details"]["cached_tokens"] < again["input_tokens"]


def test_an_empty_cache_salt_is_refused_naming_it(client):
    r = client.post("/v1/chat/completions", json={"model": TINY_NAME, "cache_salt": "",
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
