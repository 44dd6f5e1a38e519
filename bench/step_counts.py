"""What a serving step costs a GPU, counted on any machine: host syncs and attention shapes.

On a GPU a decode step is bound by the host unless it is built for it (DESIGN.md, "On a
GPU: the decode step"). Two things that make it so can be counted on the CPU:

- **Host syncs.** A read of tensor data by the host (`.item()`, `.tolist()`, `.cpu()`,
  `.numpy()`, `bool()`/`int()`/`float()` of a tensor, an explicit synchronize) waits for
  the device; a tensor built from host data (`torch.tensor` of a list, `torch.from_numpy`,
  indexing with a Python list, a copy or a move to a device from a host tensor) is a
  host-to-device copy on a GPU, which
  blocks unless it comes from pinned memory. `HostSyncCounter` counts both, per call.
- **Attention shapes.** Fused attention kernels (cuDNN's on sm90) build a graph per input
  shape; a step whose shapes were never seen pays that build. `AttentionShapes` records
  the distinct shapes of every attention call.

`arrival_trace` is a seeded trace with Poisson arrivals of prompts and outputs of
log-normal lengths, replayed step by step on an engine (`replay_trace`); `alchemist
bench steps` prints its counts.
"""

from __future__ import annotations

import contextlib
import random
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from bench.traces import lognormal_length, poisson_times

_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")
_BUILDERS = ("tensor", "as_tensor", "from_numpy")


def _has_list(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, list) for item in items)


@dataclass
class HostSyncCounter:
    """Counts host reads of tensor data and tensors built from host data while active;
    `sites` keeps, per kind, the calls by name, for a failing test to show."""

    reads: int = 0
    built: int = 0
    sites: Counter = field(default_factory=Counter)

    def _read(self, name: str) -> None:
        self.reads += 1
        self.sites[f"read {name}"] += 1

    def _build(self, name: str) -> None:
        self.built += 1
        self.sites[f"built {name}"] += 1

    @contextlib.contextmanager
    def counting(self):
        originals: list[tuple[object, str, object]] = []

        def patch(owner, name, wrapper):
            originals.append((owner, name, getattr(owner, name)))
            setattr(owner, name, wrapper)

        def reader(name, original):
            def wrapped(tensor, *args, **kwargs):
                self._read(name)
                return original(tensor, *args, **kwargs)
            return wrapped

        def builder(name, original):
            def wrapped(*args, **kwargs):
                self._build(name)
                return original(*args, **kwargs)
            return wrapped

        def indexer(name, original):
            def wrapped(tensor, index, *args):
                if _has_list(index):
                    self._build(f"{name} with a list")
                return original(tensor, index, *args)
            return wrapped

        def copier(original):
            def wrapped(tensor, source, *args, **kwargs):
                if isinstance(source, torch.Tensor) and source.device.type == "cpu" and not source.requires_grad \
                        and tensor.data_ptr() != source.data_ptr():
                    self._build("copy_ from the host")
                return original(tensor, source, *args, **kwargs)
            return wrapped

        def mover(original):
            def wrapped(tensor, *args, **kwargs):
                moved = original(tensor, *args, **kwargs)
                # a host tensor copied (to a device, or to the CPU "device" when asked to copy)
                if tensor.device.type == "cpu" and (moved.device.type != "cpu" or kwargs.get("copy")):
                    self._build("to(device) from the host")
                return moved
            return wrapped

        for name in _READS:
            patch(torch.Tensor, name, reader(name, getattr(torch.Tensor, name)))
        for name in _BUILDERS:
            patch(torch, name, builder(name, getattr(torch, name)))
        patch(torch.Tensor, "__getitem__", indexer("index", torch.Tensor.__getitem__))
        patch(torch.Tensor, "__setitem__", indexer("index assignment", torch.Tensor.__setitem__))
        patch(torch.Tensor, "copy_", copier(torch.Tensor.copy_))
        patch(torch.Tensor, "to", mover(torch.Tensor.to))
        if torch.cuda.is_available():
            patch(torch.cuda, "synchronize", builder("synchronize", torch.cuda.synchronize))
        try:
            yield self
        finally:
            for owner, name, original in reversed(originals):
                setattr(owner, name, original)


@dataclass
class AttentionShapes:
    """The distinct (query, key, value, mask) shapes of the attention calls made while active."""

    shapes: Counter = field(default_factory=Counter)

    @contextlib.contextmanager
    def recording(self):
        original = F.scaled_dot_product_attention

        def recorded(query, key, value, attn_mask=None, *args, **kwargs):
            mask = None if attn_mask is None else tuple(attn_mask.shape)
            self.shapes[(tuple(query.shape), tuple(key.shape), tuple(value.shape), mask)] += 1
            return original(query, key, value, attn_mask, *args, **kwargs)

        F.scaled_dot_product_attention = recorded
        try:
            yield self
        finally:
            F.scaled_dot_product_attention = original

    @property
    def distinct(self) -> int:
        return len(self.shapes)


def _is_view(func) -> bool:
    return any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns)


def _copied(args, out) -> bool:
    """Whether an op that may return an alias of its input (`to`, `contiguous`, `reshape`
    in inference mode) returned new memory instead: a cast or a copy, which launches."""
    if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
        return False
    return out.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr()


@dataclass
class AtenOps:
    """Counts the aten ops dispatched while active — each a kernel launch on a GPU —
    views apart (they launch nothing)."""

    ops: Counter = field(default_factory=Counter)
    views: int = 0

    @contextlib.contextmanager
    def counting(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                if _is_view(func) and not _copied(args, out):
                    counter.views += 1
                else:
                    counter.ops[str(func.overloadpacket.__name__)] += 1
                return out

        with Mode():
            yield self

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def decode_layer_ops(engine, layer: int = 0, streams: int = 4) -> AtenOps:
    """The aten ops of decoder layer `layer` in a decode step of `streams` greedy requests
    (their prefills run first). Layer 0 also builds the step's attention mask."""
    from engine.sampling_params import SamplingParams

    for i in range(streams):
        engine.add_request(f"layer-ops-{i}", [5 + i, 7, 9], SamplingParams(temperature=0.0, max_tokens=6, min_tokens=6))
    engine.step()
    counter, run_layer = AtenOps(), engine.runner.run_layer
    graphs = engine.runner.decode_graphs  # a replayed CUDA graph dispatches no ops: count the eager step it holds
    replaying, graphs.enabled = graphs.enabled, False

    def counted(index, *args, **kwargs):
        if index != layer:
            return run_layer(index, *args, **kwargs)
        with counter.counting():
            return run_layer(index, *args, **kwargs)

    engine.runner.run_layer = counted
    try:
        engine.step()
    finally:
        engine.runner.run_layer = run_layer
        graphs.enabled = replaying
    return counter


@dataclass
class TraceArrival:
    step: int
    prompt: list[int]
    max_tokens: int


def arrival_trace(vocab_size: int, steps: int = 400, rate_per_step: float = 0.12, seed: int = 0,
                  max_prompt: int = 200, max_output: int = 96) -> list[TraceArrival]:
    """Poisson arrivals over `steps` engine steps; prompts (random ids) and outputs of
    log-normal length, as bench/traces.make_trace draws them for a server."""
    rng = random.Random(seed)
    arrivals = []
    for t in poisson_times(rate_per_step, steps, rng):
        prompt_len = lognormal_length(rng, 40, 0.8, 4, max_prompt)
        output = lognormal_length(rng, 32, 0.6, 4, max_output)
        arrivals.append(TraceArrival(int(t), [rng.randrange(3, vocab_size) for _ in range(prompt_len)], output))
    return arrivals


@dataclass
class TraceCounts:
    steps: int
    decode_steps: int
    distinct_attention_shapes: int
    # per decode-only step: the most host reads and built tensors any one of them made
    max_reads_per_decode_step: int
    max_built_per_decode_step: int
    reads_sites: dict[str, int]


def replay_trace(engine, arrivals: list[TraceArrival], sampling) -> TraceCounts:
    """Steps `engine` through the trace (`sampling(max_tokens)` gives each request's
    SamplingParams) and counts attention shapes over every step, host syncs per
    decode-only step (every scheduled sequence computing one token). The engine lays its
    steps out as on a GPU (shapes bucketed, `exact_step_shapes`)."""
    engine.runner.exact_shapes = False
    shapes = AttentionShapes()
    pending = sorted(arrivals, key=lambda a: a.step)
    step = decode_steps = max_reads = max_built = 0
    sites: Counter = Counter()
    with shapes.recording():
        while pending or engine.has_unfinished():
            while pending and pending[0].step <= step:
                arrival = pending.pop(0)
                engine.add_request(f"trace-{step}-{len(pending)}", arrival.prompt, sampling(arrival.max_tokens))
            decode_only = engine.has_unfinished() and _decode_only(engine)
            counter = HostSyncCounter()
            with counter.counting():
                engine.step()
            if decode_only:
                decode_steps += 1
                max_reads, max_built = max(max_reads, counter.reads), max(max_built, counter.built)
                sites.update(counter.sites)
            step += 1
    return TraceCounts(step, decode_steps, shapes.distinct, max_reads, max_built, dict(sites))


def _decode_only(engine) -> bool:
    """Whether the next step is all decodes: nothing waits, every running sequence has one token pending."""
    scheduler = engine.scheduler
    return not scheduler.waiting and all(seq.num_pending_tokens == 1 for seq in scheduler.running)


def decode_step_counts(engine, prompts: list[list[int]], params, warmup_steps: int = 3) -> HostSyncCounter:
    """The host syncs of one decode-only step of `prompts` (all prefilled first), laid out
    as on a GPU (padded to its buckets)."""
    engine.runner.exact_shapes = False
    for i, prompt in enumerate(prompts):
        engine.add_request(f"count-{i}", prompt, params)
    for _ in range(warmup_steps):
        engine.step()
    assert _decode_only(engine) and len(engine.scheduler.running) == len(prompts), "not a decode-only step"
    counter = HostSyncCounter()
    with counter.counting():
        engine.step()
    for rid in engine.request_ids():
        engine.abort_request(rid)
    return counter


def run_steps_bench(config, steps: int = 400, seed: int = 0, json_path: str | None = None) -> dict:
    """`alchemist bench steps`: on the configured model, the attention shapes of a
    `steps`-step trace with arrivals, and the host syncs of a decode step at 8 and 32
    streams (temperature 1 with `min_tokens`, and greedy)."""
    import dataclasses
    import json

    from bench.report import write_json
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load
    from engine.sampling_params import SamplingParams

    config = dataclasses.replace(config, scheduler=dataclasses.replace(
        config.scheduler, max_num_seqs=max(config.scheduler.max_num_seqs, 32)))
    model, tokenizer, name = load(config.model)
    engine = LLMEngine.for_model(model, tokenizer, config)
    trace = arrival_trace(engine.vocab_size, steps=steps, seed=seed,
                          max_prompt=min(200, config.model.max_model_len // 4))
    counts = replay_trace(engine, trace, lambda n: SamplingParams(temperature=1.0, max_tokens=n, min_tokens=min(n, 4)))
    result = {"model": name, "device": str(engine.runner.device), "trace_steps": counts.steps,
              "trace_requests": len(trace), "decode_steps": counts.decode_steps,
              "distinct_attention_shapes": counts.distinct_attention_shapes,
              "trace_max_host_reads_per_decode_step": counts.max_reads_per_decode_step,
              "trace_max_host_built_per_decode_step": counts.max_built_per_decode_step}
    prompts = [[(7 * i + j) % (engine.vocab_size - 3) + 3 for j in range(12)] for i in range(32)]
    for label, params in (("temperature_min_tokens", SamplingParams(temperature=1.0, max_tokens=32, min_tokens=16)),
                          ("greedy", SamplingParams(temperature=0.0, max_tokens=32))):
        for streams in (8, 32):
            counter = decode_step_counts(engine, prompts[:streams], params)
            result[f"{label}_{streams}_streams"] = {"host_reads": counter.reads, "host_built": counter.built,
                                                    "sites": dict(counter.sites)}
    print(json.dumps(result, indent=2))
    write_json(result, json_path)
    return result
