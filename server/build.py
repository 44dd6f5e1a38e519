"""The composition root: the one place that builds the engine, the trainer, the
offloader and the arbiter, and connects them through their protocols (engine/hooks.py).

    LLMEngine ── recorder ─────▶ Recorder ──entries──▶ ActivationCache ◀── Trainer
        │   ├── memory_guard ──▶ ActivationOffloader ◀── segment_sink (the runner)
        │   └── observers ─────▶ ServingMetrics, Recorder       (on the device thread)
    AsyncEngine ── idle_hook ──▶ Arbiter ──slices──▶ Trainer

Nothing else constructs or rewires another part; tests and benchmarks build through
`build_trainer` and `build_stack` too.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

from engine.async_engine import AsyncEngine
from engine.llm_engine import LLMEngine
from engine.malloc_tuning import HeapWarmer
from offload.build import build_offloader
from offload.config import OffloadConfig
from server.config import AlchemistConfig
from server.metrics import ServingMetrics
from trainer.adapter import attach_lora, lora_parameters, merge_all
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.arbiter import Arbiter
from trainer.cache import ActivationCache
from trainer.config import TrainConfig
from trainer.forward import recompute_segment
from trainer.frozen import ServedAdapter, merge_frozen_adapter
from trainer.grpo import GRPOMethod
from trainer.methods import CPTMethod, DPOMethod, TrainingMethod
from trainer.rewards import RewardScorer, load_reward_function
from trainer.optimizer import AdapterOptimizer
from trainer.recorder import Recorder
from trainer.stash import WeightStash
from trainer.status import TrainingStats
from trainer.trainer import Trainer

logger = logging.getLogger(__name__)


def default_method(config: TrainConfig) -> TrainingMethod:
    if config.mode == "cpt":
        return CPTMethod()
    if config.mode == "dpo":
        return DPOMethod(config.dpo_beta, config.dpo_reference)
    if config.mode == "grpo":
        return GRPOMethod(config.grpo_beta, config.grpo_clip_eps, recompute_tokens=config.max_record_tokens)
    raise ValueError("the trainer needs train.mode cpt, dpo or grpo (or a custom method)")


def build_trainer(engine: LLMEngine, config: TrainConfig, offload: OffloadConfig | None = None,
                  method: TrainingMethod | None = None, init_lora_weights: bool | str = True) -> Trainer:
    """Wraps the engine's model with LoRA and connects a trainer to the engine: the
    recorder decides and receives recordings, the offloader (with a device budget)
    places them; `method` overrides the mode's (a custom method)."""
    method = method or default_method(config)
    peft_model = attach_lora(engine.model, config, init_lora_weights)
    optimizer = AdapterOptimizer(lora_parameters(peft_model), config.learning_rate, config.max_grad_norm)
    cache = ActivationCache(config.cache_bytes, config.cache_full_policy, config.label_timeout_s,
                            max_label_entries=config.max_label_entries)
    stats = TrainingStats()
    if config.merged_serving:
        merge_all(peft_model)  # merged serving weights are built now, while nobody is waiting
    # with merged serving, decode never touches the base layers' packed weights; pack
    # them now rather than in the first recorded prefill
    for module in engine.model.modules():
        if hasattr(module, "ensure_packed"):
            module.ensure_packed()
    offloader = None
    if offload is not None and offload.device_budget_bytes > 0:  # calibrated on the serving path just built
        offloader = build_offloader(engine.model, offload, engine.max_model_len,
                                    functools.partial(recompute_segment, engine.runner))
        optimizer.zero_grad()  # calibration ran a backward
        engine.runner.segment_sink = engine.memory_guard = offloader
    stash = WeightStash(peft_model)
    engine.runner.stale_resolver = stash.resolve
    # recordings in host memory land on pre-faulted pages (engine/malloc_tuning.py)
    warmer = HeapWarmer() if engine.runner.device.type == "cpu" else None
    trainer = Trainer(config, method, engine.runner, peft_model, optimizer, cache, stats, engine.tokenizer,
                      engine.max_model_len, lambda: engine.num_steps, offloader=offloader, stash=stash,
                      warmer=warmer)
    if config.reward_function:
        decode = functools.partial(engine.tokenizer.decode, skip_special_tokens=False)
        trainer.rewards = RewardScorer(load_reward_function(config.reward_function), config.reward_timeout_s,
                                       cache, stats, trainer.submit_feedback, decode)
    recorder = Recorder(config, method, cache, lambda: optimizer.version, stats, offloader, warmer,
                        trainer.rewards)
    engine.recorder = recorder
    engine.observers.append(recorder)
    return trainer


@dataclass
class Stack:
    """Everything the server runs, built and connected."""

    name: str
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServingMetrics
    # None when training is off
    trainer: Trainer | None
    arbiter: Arbiter | None
    # the saved adapter served frozen (training off), if any
    served_adapter: ServedAdapter | None = None


def build_stack(config: AlchemistConfig, model, tokenizer, name: str) -> Stack:
    served_adapter = None
    if config.train.mode == "off":  # a saved adapter, if one is named, is served frozen
        model, served_adapter = merge_frozen_adapter(model, config.adapter)
        if served_adapter is not None and served_adapter.name:
            name = served_adapter.name
    elif config.adapter.lora_module:
        raise ValueError("adapter.lora_module (--lora-modules) serves an adapter frozen, with training off; "
                         "to train from a saved adapter, resume with --adapter-dir")
    engine = LLMEngine(model, tokenizer, config)
    metrics = ServingMetrics(name, engine.cache_info())
    engine.observers.append(metrics)
    trainer = arbiter = None
    if config.train.mode != "off":
        trainer = build_trainer(engine, config.train, config.offload)
        logger.info("online training: %s, LoRA rank %d, learning rate %g", config.train.mode,
                    config.train.lora_rank, config.train.learning_rate)
        if config.adapter.dir:
            trainer.enable_checkpoints(AdapterCheckpointer(AdapterStore(config.adapter.dir, config.adapter.keep),
                                                           config.adapter.save_every))
        arbiter = Arbiter(trainer, config.arbiter)
    async_engine = AsyncEngine(engine, idle_hook=arbiter)
    if trainer is not None and trainer.rewards is not None:
        trainer.rewards.on_scored = async_engine.notify_threadsafe
    metrics.add_engine(async_engine, arbiter, config.arbiter.policy)
    if trainer is not None:
        metrics.add_trainer(trainer)
    return Stack(name, engine, async_engine, metrics, trainer, arbiter, served_adapter)
