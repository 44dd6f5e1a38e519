"""The activation offloader: gradients equal keeping everything on the device under every
policy, the device budget holds while serving and training go on, the hedged plan is
never predicted slower than the better pure plan, and the host pool keeps its budget."""

import asyncio
import dataclasses
import random
from pathlib import Path

import httpx
import pytest
import torch

from engine.config import ModelConfig
from engine.model_runner import run_to_end
from offload.config import OffloadConfig
from server.config import AlchemistConfig

from trainer.config import TrainConfig
from engine.sampling_params import SamplingParams
from offload.hedging import LOAD, RECOMPUTE, LayerCosts, Timings, plan, simulate
from offload.host_pool import HostPool
from tests.conftest import encode, engine_of, make_training
from tests.servers import TINY_NAME, ServerThread, tiny_app, wait_for
from tests.test_training import PROMPT, gradients_of, label, relative_difference
from tests.tiny import FAMILIES, tiny_tokenizer

OTHER_PROMPT = "Tell me a story about a dragon who learned to paint with fire and light."


def make_trainer(family="llama", mode="cpt", offload=None, **train_kwargs):
    torch.manual_seed(0)
    return make_training(TrainConfig(mode=mode, lora_rank=4, **train_kwargs), family, offload,
                         init_lora_weights=False)


def serve_two(trainer) -> None:
    """Request "a" is decoding when "b"'s recorded prefill runs, so "b"'s recorded step
    carries another sequence's decode rows."""
    engine = engine_of(trainer)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for request_id, prompt in (("a", OTHER_PROMPT), ("b", PROMPT)):
        ids = encode(prompt)
        engine.add_request(request_id, ids, params, train=True)
        engine.step()
    while engine.has_unfinished():
        engine.step()


def gradients_after_serving(trainer, mode: str) -> dict:
    """LoRA gradients of "b"'s reuse job; with an offloader, every layer freed first."""
    serve_two(trainer)
    if trainer.offloader is not None:
        trainer.offloader.free_to(0)
    if mode == "dpo":
        label(trainer, "b", chosen="Paris, of course. It is a lovely city.")
    entry = trainer.cache.get("b")
    return gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))


@pytest.mark.parametrize("copy_to_host", ["recording", "freeing"])
@pytest.mark.parametrize("policy", ["load", "recompute", "hedged"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_gradients_equal_keeping_every_layer_on_the_device(mode, policy, copy_to_host):
    reference = gradients_after_serving(make_trainer(mode=mode), mode)
    trainer = make_trainer(mode=mode, offload=OffloadConfig(device_budget_bytes=1 << 40, policy=policy,
                                                            copy_to_host=copy_to_host))
    grads = gradients_after_serving(trainer, mode)
    stats = trainer.offloader.stats
    num_layers = len(engine_of(trainer).runner.layers)
    assert stats.offloaded_layers + stats.dropped_layers >= 2 * num_layers
    assert stats.reloaded_layers + stats.recomputed_layers == num_layers  # "b"'s layers came back
    if policy == "load":
        assert stats.reloaded_layers == num_layers
    if policy == "recompute":
        assert stats.recomputed_layers == num_layers and trainer.offloader.host_bytes == 0
    assert relative_difference(grads, reference) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_recomputed_and_reloaded_layers_mixed_in_one_backward(family):
    """Half the layers dropped (no host room), half loaded back: one backward over both."""
    reference = gradients_after_serving(make_trainer(family), "cpt")
    trainer = make_trainer(family, offload=OffloadConfig(device_budget_bytes=1 << 40, policy="load"))
    serve_two(trainer)
    trainer.offloader.free_to(0)
    entry = trainer.cache.get("b")
    placement = entry.recording.placement
    assert [layer.residence.value for layer in placement.layers] == ["host"] * len(placement.layers)
    residency = trainer.offloader.residency(entry.recording)
    residency.choices = ["recompute" if i % 2 == 0 else "load" for i in range(len(placement.layers))]
    trainer.context.residency = lambda recording: residency
    grads = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    stats = trainer.offloader.stats
    assert stats.recomputed_layers == (len(placement.layers) + 1) // 2
    assert stats.reloaded_layers == len(placement.layers) // 2
    assert relative_difference(grads, reference) <= 1e-5


def test_measured_layer_costs_refine_the_planner_once_the_backward_sweep_ends():
    """Every recomputed layer's recompute and every layer's backward are timed, and the
    planner's per-token costs take the measurements when the sweep ends: on a GPU their
    events are read then, one wait on the device per recording rather than one per layer."""
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40, policy="recompute"))
    serve_two(trainer)
    trainer.offloader.free_to(0)
    entry = trainer.cache.get("b")
    timings = trainer.offloader.timings
    timings.recompute_per_token_s = timings.backward_per_token_s = 1.0  # far above what a tiny layer takes
    residency = trainer.offloader.residency(entry.recording)
    during = []
    before = residency.before
    residency.before = lambda index: during.append((timings.recompute_per_token_s,
                                                    timings.backward_per_token_s)) or before(index)
    trainer.context.residency = lambda recording: residency
    gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    layers = len(entry.recording.placement.layers)
    assert during == [(1.0, 1.0)] * layers
    for refined in (timings.recompute_per_token_s, timings.backward_per_token_s):  # one step of the average per layer
        assert 0.8 ** layers <= refined < 0.8 ** layers + 0.05
    assert trainer.offloader.stats.recomputed_layers == layers


@pytest.mark.parametrize("policy", ["load", "recompute"])
def test_decodes_riding_in_a_recorded_step_leave_its_gradients_alone(policy):
    """Decodes riding along in a recorded prefill's forward (`recorded_prefill_alone` off)
    add their rows to its layers' saved inputs, not to its gradients: loaded back, or
    recomputed from the prompt's rows alone, its layers train as the prompt recorded alone."""
    alone = make_trainer(mode="dpo")
    scheduler = engine_of(alone).scheduler
    scheduler.config = dataclasses.replace(scheduler.config, recorded_prefill_alone=True)
    reference = gradients_after_serving(alone, "dpo")
    trainer = make_trainer(mode="dpo", offload=OffloadConfig(device_budget_bytes=1 << 40, policy=policy))
    scheduler = engine_of(trainer).scheduler
    scheduler.config = dataclasses.replace(scheduler.config, recorded_prefill_alone=False)
    serve_two(trainer)
    entry = trainer.cache.get("b")
    assert {s.leaf.shape[1] for s in entry.recording.segments} == {len(encode(PROMPT)) + 1}  # "a" rode along
    trainer.offloader.free_to(0)
    label(trainer, "b", chosen="Paris, of course. It is a lovely city.")
    grads = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    stats = trainer.offloader.stats
    assert stats.reloaded_layers + stats.recomputed_layers == len(entry.recording.segments)
    assert relative_difference(grads, reference) <= 1e-5


def test_layers_are_copied_while_recording_or_only_when_freed():
    eager = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40, copy_to_host="recording"))
    serve_two(eager)
    assert eager.offloader.host_bytes > 0 and eager.offloader.stats.offloaded_layers == 0
    lazy = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40, copy_to_host="freeing"))
    serve_two(lazy)
    assert lazy.offloader.host_bytes == 0
    lazy.offloader.free_to(0)
    assert lazy.offloader.host_bytes > 0 and lazy.offloader.stats.offloaded_layers > 0


def test_host_pool_full_drops_layers_for_recompute_and_gradients_hold():
    reference = gradients_after_serving(make_trainer(), "cpt")
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40, host_budget_bytes=64 << 10,
                                                 policy="hedged"))
    grads = gradients_after_serving(trainer, "cpt")
    stats = trainer.offloader.stats
    assert stats.dropped_layers > 0 and stats.recomputed_layers > 0
    assert trainer.offloader.pool.used_bytes <= 64 << 10
    assert relative_difference(grads, reference) <= 1e-5


def test_an_optimizer_step_frees_the_recordings_it_made_stale():
    """Without weight stashing (max_staleness 0), entries recorded under the old adapter
    are never back-propagated: their device and host memory is released at the step, not
    when their turn comes."""
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40), max_staleness=0,
                           entries_per_step=1, cohort_max_entries=1)
    serve_two(trainer)
    trainer.offloader.free_to(trainer.offloader.device_bytes // 2)  # some layers in the host pool
    assert trainer.offloader.host_bytes > 0
    while trainer.optimizer.version == 0:
        assert trainer.run_slice()
    waiting = trainer.cache.get("b") or trainer.cache.get("a")
    assert waiting is not None and waiting.adapter_version == 0 and waiting.recording is None
    assert trainer.cache.bytes == 0
    assert trainer.offloader.device_bytes == 0 and trainer.offloader.host_bytes == 0
    trainer.train_until_idle()  # and it is still trained, through the recompute path
    assert trainer.optimizer.version == 2 and trainer.stats.stale_entries == 1


def tight_budget(as_admission_reckons: bool = False) -> int:
    """Room for a running step, the never-freed tensors of four recordings (admission
    predicts a new one's from the memory model, above what the tiny model keeps: with
    `as_admission_reckons`, four of those), what a recorded step holds before its layers
    can be freed and one layer more: less than the cached activations of a few requests."""
    probe = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40))
    serve_two(probe)
    placement = probe.cache.get("b").recording.placement
    largest_layer = max(layer.nbytes for layer in placement.layers)
    kept = placement.kept_bytes
    if as_admission_reckons:
        kept = max(kept, int(probe.offloader.map.model.kept_per_token * placement.num_tokens))
    return (probe.offloader.map.serving_bytes(64, 8) + 4 * kept
            + probe.offloader.in_flight_bytes(placement.num_tokens) + largest_layer)


@pytest.mark.parametrize("beginnings", ["own", "shared"])
def test_device_budget_holds_while_serving_and_training_continue(beginnings):
    """Requests keep arriving and finishing while every recorded entry is trained; the
    offloader's accounting (cached activations plus the running step) stays within the
    budget, and everything is released at the end. `own`: every prompt begins with its
    own tokens (each recording holds its whole prompt: layers must be freed); `shared`:
    they share two beginnings (recordings after a cached beginning, admitted by the K/V
    they keep of it)."""
    budget = tight_budget()
    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=budget, policy="hedged"))
    offloader = trainer.offloader
    engine = engine_of(trainer)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    rng = random.Random(0)
    finished = 0
    for i in range(24):
        prompt = rng.choice([PROMPT, OTHER_PROMPT])
        ids = encode(f"Request {i}: {prompt}" if beginnings == "own" else f"{prompt} request {i}")
        engine.add_request(f"r{i}", ids, params, train=True)
        for _ in range(rng.randint(1, 4)):
            outputs, _ = engine.step()
            finished += sum(out.finished for out in outputs)
            trainer.run_slice()
    while engine.has_unfinished():
        outputs, _ = engine.step()
        finished += sum(out.finished for out in outputs)
    trainer.train_until_idle()
    stats = offloader.stats
    assert finished == 24
    assert trainer.stats.recorded >= 6 and sum(trainer.stats.trained_entries.values()) == trainer.stats.recorded
    assert trainer.stats.not_recorded > 0  # some were refused: their kept tensors would not fit
    if beginnings == "own":
        assert stats.offloaded_layers > 0 and stats.reloaded_layers + stats.recomputed_layers > 0
    else:
        assert trainer.stats.recorded_cached_tokens > 0
    assert stats.over_budget_steps == 0 and stats.peak_budget_bytes <= budget, (stats.peak_budget_bytes, budget)
    assert offloader.device_bytes == 0 and offloader.host_bytes == 0


@pytest.mark.parametrize("copy_to_host", ["freeing", "recording"])  # recording: what "auto" picks on CUDA
def test_server_under_a_tight_budget_serves_every_request_and_trains(copy_to_host):
    """Over HTTP: concurrent requests all succeed while the offloader frees layers and
    training brings them back; the metrics say so. (Three optimizer steps need three
    recordings admitted: the budget has room for four as admission reckons them.)"""
    budget = tight_budget(as_admission_reckons=True)
    app = tiny_app(train=TrainConfig(mode="cpt", lora_rank=4, entries_per_step=1, cohort_max_entries=1),
                   offload=OffloadConfig(device_budget_bytes=budget, copy_to_host=copy_to_host))
    trainer = app.state.alchemist.training

    async def traffic(url):
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            bodies = [{"model": TINY_NAME, "prompt": f"{PROMPT} number {i}", "max_tokens": 8} for i in range(16)]
            return await asyncio.gather(*(client.post("/v1/completions", json=b) for b in bodies))

    with ServerThread(app) as server:
        responses = asyncio.run(traffic(server.url))
        assert [r.status_code for r in responses] == [200] * 16
        wait_for(lambda: trainer.optimizer.version >= 3 and not trainer.has_work())
        metrics = httpx.get(f"{server.url}/metrics", timeout=300).text
    stats = trainer.offloader.stats
    assert stats.offloaded_layers > 0 and stats.reloaded_layers + stats.recomputed_layers > 0
    assert stats.peak_budget_bytes <= budget
    assert _sample(metrics, "alchemist:offloaded_layers_total") == stats.offloaded_layers
    assert _sample(metrics, "alchemist:over_budget_steps_total") == 0, (budget, dataclasses.asdict(stats))
    assert _sample(metrics, "alchemist:activation_device_bytes") == trainer.offloader.device_bytes


def _sample(metrics: str, name: str) -> float:
    return next(float(line.split()[-1]) for line in metrics.splitlines() if line.startswith(name))


def test_offload_config_is_validated_and_read_from_the_environment():
    from server.config import load_config
    with pytest.raises(ValueError, match="offload.policy"):
        OffloadConfig(policy="sometimes")
    with pytest.raises(ValueError, match="offload.copy_to_host"):
        OffloadConfig(copy_to_host="later")
    with pytest.raises(ValueError, match="offload.device_budget_bytes"):
        OffloadConfig(device_budget_bytes=-1)
    config = load_config(None, {}, {"ALCHEMIST_OFFLOAD_POLICY": "recompute",
                                    "ALCHEMIST_OFFLOAD_DEVICE_BUDGET_BYTES": "123456"})
    assert config.offload == OffloadConfig(device_budget_bytes=123456, policy="recompute")


def random_costs(rng: random.Random, num: int) -> tuple[list[bool], list[LayerCosts], Timings]:
    timings = Timings(rng.uniform(1e8, 1e10), rng.uniform(0, 1e-4), 0.0, 0.0, 0.0, 0.0)
    freed = rng.randint(1, num)
    resident = [i >= freed for i in range(num)]
    costs = [LayerCosts(None if rng.random() < 0.1 else rng.randint(1 << 20, 64 << 20), rng.uniform(1e-3, 2e-2),
                        rng.uniform(2e-3, 4e-2)) for _ in range(num)]
    return resident, costs, timings


def test_hedged_plan_is_never_predicted_slower_than_either_pure_plan():
    rng = random.Random(0)
    strictly_better = 0
    for _ in range(300):
        resident, costs, timings = random_costs(rng, rng.randint(2, 24))
        choices, seconds = plan(resident, costs, timings, prefetch=2)
        fixed = ["keep" if r else (RECOMPUTE if c.reload_bytes is None else None) for r, c in zip(resident, costs)]
        pure = [simulate([f or p for f in fixed], costs, timings, 2) for p in (LOAD, RECOMPUTE)]
        assert seconds <= min(pure) + 1e-12
        assert seconds == pytest.approx(simulate(choices, costs, timings, 2))
        assert all(c == RECOMPUTE for c, cost in zip(choices, costs) if cost.reload_bytes is None and c != "keep")
        strictly_better += seconds < min(pure) - 1e-9
    assert strictly_better > 0  # mixing is sometimes strictly better, not only a tie


def test_hedged_plan_mixes_when_the_link_is_slower_than_backward():
    """Slow link (35 ms per layer load against 20 ms of backward), all but the top layer
    freed: loading everything stalls, recomputing everything spends 10 ms per layer; the
    plan loads some layers behind the backward of others and recomputes the rest."""
    num = 8
    costs = [LayerCosts(10 << 20, 0.010, 0.020) for _ in range(num)]
    timings = Timings(3e8, 0.0, 0.0, 0.0, 0.0, 0.0)
    resident = [i == num - 1 for i in range(num)]
    choices, seconds = plan(resident, costs, timings, prefetch=2)
    assert choices[0] == LOAD and RECOMPUTE in choices
    load_all = simulate(["keep" if r else LOAD for r in resident], costs, timings, 2)
    recompute_all = simulate(["keep" if r else RECOMPUTE for r in resident], costs, timings, 2)
    assert seconds < 0.9 * min(load_all, recompute_all)
    # a fast link hides every load: then loading all is the plan
    timings.bandwidth_bytes_per_s = 1e10
    assert plan(resident, costs, timings, prefetch=2)[0] == ["load"] * (num - 1) + ["keep"]


def test_host_pool_allocates_within_its_budget_and_coalesces():
    pool = HostPool(1024, pin=False)
    blocks = [pool.allocate(200) for _ in range(4)]  # 4 x 256 aligned
    assert all(b is not None for b in blocks) and pool.allocate(1) is None
    assert pool.used_bytes == 1024
    pool.free(blocks[1])
    pool.free(blocks[2])
    big = pool.allocate(500)  # fits only in the coalesced middle
    assert big is not None and big.offset == 256
    pool.free(blocks[0])
    pool.free(blocks[3])
    pool.free(big)
    assert pool.used_bytes == 0 and pool.allocate(1024) is not None


def _embedded_shape_config(tmp_path, device: str) -> AlchemistConfig:
    """The embedded model's shape with random weights in float32 and the tiny tokenizer
    (the GPU machine does not have the embedded weights)."""
    tiny_tokenizer().save_pretrained(tmp_path / "tokenizer")
    shape = Path(__file__).parent.parent / "configs" / "models" / "smollm2-135m"
    return AlchemistConfig(model=ModelConfig(model=str(shape), load_format="dummy", tokenizer=str(tmp_path / "tokenizer"),
                                             device=device, dtype="float32"))


@pytest.mark.slow  # the embedded model's shape
def test_the_offload_bench_runs_on_a_random_weight_model_shape(tmp_path):
    """What the GPU test runs, on the CPU at a small size: gradients equal with every policy."""
    from bench.offload import run_offload_bench
    report = run_offload_bench(config=_embedded_shape_config(tmp_path, "cpu"), entries=1, tokens=32, repeats=1)
    for name, result in report["policies"].items():
        assert result["max_grad_rel_diff"] <= 1e-5, name
    # freeing copies to the host at freeing time on the CPU: timed apart, as no other figure holds it (a review)
    assert report["policies"]["offload"]["freeing_over_training"] > 0


@pytest.mark.gpu
def test_cuda_copy_stream_round_trip_through_pinned_pool():
    from offload.copy_stream import CopyStream
    device = torch.device("cuda")
    pool = HostPool(64 << 20, pin=True)
    assert pool.buffer.is_pinned()
    copies = CopyStream(device)
    source = torch.randn(8 << 20, device=device)
    block = pool.allocate(source.numel() * 4)
    alias = torch.empty(0, dtype=torch.uint8, device=device).set_(source.untyped_storage())
    copies.copy(block.data, alias).wait()
    back = torch.empty_like(alias)
    copies.copy(back, block.data).wait()
    assert torch.equal(back.view(torch.float32), source)


@pytest.mark.gpu
def test_cuda_offload_gradients_and_hidden_loads(tmp_path):
    """On a GPU the reloads overlap backward: gradients equal, and the wait is a small
    fraction of the backward for a one-third offloaded fraction."""
    from bench.offload import run_offload_bench
    report = run_offload_bench(config=_embedded_shape_config(tmp_path, "cuda"), fractions=(1 / 3,), entries=2,
                               tokens=512)
    for name, result in report["policies"].items():
        assert result["max_grad_rel_diff"] <= 1e-5, name
    assert report["sweep"][0]["policies"]["offload"]["reload_wait_fraction"] < 0.1


def _labelled_dpo_trainer(budget: int):
    trainer = make_trainer(mode="dpo", offload=OffloadConfig(device_budget_bytes=budget))
    serve_two(trainer)
    trainer.offloader.free_to(0)
    label(trainer, "b", chosen="Paris, of course. It is a lovely city.")
    return trainer, trainer.cache.get("b")


def test_dpo_responses_go_one_at_a_time_when_the_budget_has_no_room_for_both():
    """Batched, the two responses' graphs are alive at once; under a budget without room
    for them the reuse job takes its one-response-at-a-time schedule, with the same gradients."""
    reference = gradients_after_serving(make_trainer(mode="dpo"), "dpo")  # no budget: batched
    probe, entry = _labelled_dpo_trainer(tight_budget())
    batch_rows = 2 * max(len(entry.label.chosen), len(entry.label.rejected))
    offloader = probe.offloader
    room = offloader.budget_bytes - offloader._max_step_bytes - offloader.device_bytes
    need = offloader.map.model.num_layers * offloader.layer_bytes(batch_rows)
    assert probe.context.graph_fits(batch_rows) and room >= need
    trainer, entry = _labelled_dpo_trainer(tight_budget() - (room - need) - 1)  # room for all but the batch
    assert entry.recording is not None and not trainer.context.graph_fits(batch_rows)
    schedules = []
    one_at_a_time = trainer.method._reuse_one_response_at_a_time
    trainer.method._reuse_one_response_at_a_time = lambda *args: schedules.append(1) or one_at_a_time(*args)
    grads = gradients_of(trainer, trainer.method.reuse_job(entry, trainer.context))
    assert schedules == [1]
    assert relative_difference(grads, reference) <= 1e-5


def room_for_graph_layers(offloader, rows: int, kept: int, held: int | None = None) -> int:
    """A budget with room, beside the offloader's largest step and what it holds (`held`
    when the job asks; None: now), for `kept` layer graphs of a `rows`-row training
    forward and every layer's input (as `ActivationOffloader.graph_layers_fit` reckons)."""
    model = offloader.map.model
    inputs = int((model.kept_per_token - model.head_per_token) * rows)
    held = offloader.device_bytes if held is None else held
    # (a few bytes over: the reckoning's float rounding may differ from this one's)
    return offloader._max_step_bytes + held + inputs + kept * offloader.layer_bytes(rows) + 8


@pytest.mark.parametrize("mode,kept", [("cpt", 0), ("cpt", 1), ("dpo", 0), ("grpo", 0)])
def test_a_recomputation_whose_graphs_do_not_fit_the_budget_runs_its_lower_layers_again(mode, kept):
    """An entry trained from its tokens under a budget with room for `kept` of its forward's
    layer graphs (of two): the layers below keep their input only and run again in
    backward, with the gradients of every graph kept (no budget)."""
    from tests.test_grpo import make_trainer as make_grpo_trainer, reward, serve_group
    grads = {}
    for tight in (False, True):
        offload = OffloadConfig(device_budget_bytes=1 << 40) if tight else None
        if mode == "grpo":
            trainer = make_grpo_trainer(offload=offload)
            serve_group(trainer)
            assert reward(trainer).accepted
            entry = trainer.cache.get("g")
        else:
            trainer = make_trainer(mode=mode, offload=offload)
            serve_two(trainer)
            if mode == "dpo":
                label(trainer, "b", chosen="Paris, of course. It is a lovely city.")
            entry = trainer.cache.get("b")
        if tight:
            offloader = trainer.offloader
            budget = room_for_graph_layers(offloader, len(entry.prompt_token_ids), kept) if kept else 1
            offloader.config = dataclasses.replace(offloader.config, device_budget_bytes=budget)
        grads[tight] = gradients_of(trainer, trainer.method.recompute_job(entry, trainer.context))
    assert trainer.offloader.stats.rerun_training_layers == 2 - kept
    assert all(g.norm() > 0 for g in grads[False].values())
    assert relative_difference(grads[True], grads[False]) <= 1e-5


def test_suffixes_against_a_prefix_with_their_layers_run_again_give_the_same_gradients():
    """A forward attending to a prompt's K/V leaves (as suffixes do), every layer kept as
    its input and run again in backward: the gradients of keeping every graph, on the
    LoRA weights and on the prefix leaves."""
    from trainer.forward import backward_segments, forward_segments, kv_leaves
    trainer = make_trainer()
    runner = trainer.context.runner
    prompt, suffix = encode(PROMPT), encode(" Paris, of course.")
    prompt_fwd = run_to_end(forward_segments(runner, [prompt], keep_kv=True))
    top = torch.randn(1, len(suffix), runner.embed.weight.shape[1], generator=torch.Generator().manual_seed(0))
    grads = {}
    for graph_layers in (None, 0):
        prefix = kv_leaves(prompt_fwd.segments)

        def job():
            fwd = yield from forward_segments(runner, [suffix], [len(prompt)], prefix, graph_layers=graph_layers)
            assert (fwd.rerun is None) == (graph_layers is None)
            yield from backward_segments(fwd.segments, top, residency=fwd.rerun)

        grads[graph_layers] = gradients_of(trainer, job())
        grads[graph_layers].update({f"prefix-{i}-{j}": t.grad for i, pair in enumerate(prefix)
                                    for j, t in enumerate(pair)})
    assert all(g.norm() > 0 for g in grads[None].values())
    assert relative_difference(grads[0], grads[None]) <= 1e-6


def test_a_profile_of_another_model_or_with_impossible_figures_is_refused_naming_it(tmp_path):
    """`offload.profile` was taken as it came: another model's shape sized every serving
    step wrong for good, a zero bandwidth failed every hedged plan with a ZeroDivisionError,
    and a corrupt file raised a bare JSON error naming no setting (a review of the offloader)."""
    import functools
    import json

    from offload.build import build_offloader, calibrated_model
    from offload.profile import build_profile, write_profile
    from trainer.forward import recompute_segment

    trainer = make_trainer(offload=OffloadConfig(device_budget_bytes=1 << 40))
    recompute = functools.partial(recompute_segment, engine_of(trainer).runner)
    memory, timings, measurements = calibrated_model(trainer.peft_model, 256, recompute)
    good = build_profile(memory, timings, 1 << 30, 1000, 5, 2, measurements)

    def offloader_from(profile_text: str):
        path = tmp_path / "profile.json"
        path.write_text(profile_text)
        return build_offloader(trainer.peft_model, OffloadConfig(device_budget_bytes=1 << 30, profile=str(path)),
                               256, recompute)

    assert offloader_from(json.dumps(good)).map.model.num_layers == memory.num_layers
    older = json.loads(json.dumps(good))  # written before a cached beginning's kept bytes were a field
    del older["memory_model"]["kept_per_cached_token"]
    assert offloader_from(json.dumps(older)).map.model.kept_per_cached_token == memory.kept_per_cached_token > 0
    other = json.loads(json.dumps(good))
    other["memory_model"]["num_layers"] = 30
    zero = json.loads(json.dumps(good))
    zero["timings"]["bandwidth_bytes_per_s"] = 0.0
    typed = json.loads(json.dumps(good))
    typed["memory_model"]["per_token"] = "lots"
    for text, said in ((json.dumps(other), "written for another model's shape"),
                       (json.dumps(zero), "bandwidth positive"), (json.dumps(typed), "must be numbers"),
                       (json.dumps(good)[:200], "not a profile written by `alchemist profile`"),
                       ("[1, 2]", "not a profile written by `alchemist profile`")):
        with pytest.raises(ValueError, match=f"offload.profile .*{said}"):
            offloader_from(text)
    write_profile(good, tmp_path / "unused.json")
    trainer.close()


def test_a_calibration_whose_longer_run_measured_no_slower_still_costs_tokens():
    """A busy machine's start logged "recompute 0.0 us/token" (a README pass): the fit's
    slope floored at 1e-12, every length then costing the short run's time."""
    from offload.calibration import fit_linear

    assert fit_linear([(64, 0.002), (256, 0.005)]) == pytest.approx((0.001, 0.003 / 192))
    for longer in (0.0019, 0.002, 0.0020001, 0.00201):  # no slower, or hardly (a review)
        fixed, per_token = fit_linear([(64, 0.002), (256, longer)])
        assert per_token == pytest.approx(longer / 256 / 2) and fixed + per_token * 4096 > 8 * longer
