"""The composition root: the one place that builds the engine, the trainer, the
offloader and the arbiter, and connects them through their protocols (engine/hooks.py).
Every part is handed its collaborators at construction, with two assignments into a
built part that the order forces: the runner's saved-bytes memo (it depends on the LoRA
layers, attached after the runner is built) and rank 0's replicated save journal (the
checkpointer's saves at start go through the plain one, before the replicas' rounds
start). The order is forced by who runs the model first:

    model ─▶ ModelRunner ─▶ LoRA (PEFT) ─▶ offloader, calibrated by running the model
          ─▶ training parts (stash, cache, trainer, recorder, …) ─▶ LLMEngine(runner, hooks)
          ─▶ Arbiter ─▶ AsyncEngine(engine, idle_hook=arbiter)

    LLMEngine ── recorder ─────▶ Recorder ──entries──▶ ActivationCache ◀── Trainer
        │   ├── memory_guard, segment_sink ──▶ ActivationOffloader
        │   ├── stale_resolver ──────────────▶ WeightStash
        │   └── observers ─────▶ ServingMetrics, Recorder       (on the device thread)
    AsyncEngine ── idle_hook ──▶ Arbiter ──items──▶ OnlineTraining (Maintenance, Trainer)

Nothing in the library packages constructs or rewires another part; tests and
benchmarks build through `build_training_engine` and `build_stack` too (a benchmark may
swap a measurement tracker or the offloader's policy between its rounds). The metrics
register their collectors of the async engine and of training once those exist.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.hooks import EngineHooks, EngineObserver, Wakeup
from engine.llm_engine import LLMEngine, build_runner
from engine.model_runner import ModelRunner
from engine.packed_linear import PackedLinear
from engine.malloc_tuning import HeapWarmer
from engine.saved_bytes_memo import SavedBytesMemo
from offload.build import build_offloader
from offload.config import OffloadConfig
from server.config import AlchemistConfig
from server.metrics import ServingMetrics
from trainer.adapter import LeanLoraLinear, attach_lora, lora_parameters, merge_all, records_through_merged
from trainer.adapter_store import AdapterCheckpointer, AdapterStore
from trainer.arbiter import Arbiter
from trainer.cache import ActivationCache
from trainer.cache_budget import size_cache
from trainer.eval_gate import EvalGate
from trainer.eval_set import load_eval_set
from trainer.config import TrainConfig
from trainer.intake import FeedbackIntake
from trainer.forward import recompute_segment
from trainer.frozen import ServedAdapter, merge_frozen_adapter
from trainer.grpo import GRPOMethod
from trainer.ledger import Ledger
from trainer.ledger_db import LEDGER_FILE
from trainer.lifecycle import AdapterLifecycle
from trainer.maintenance import Maintenance
from trainer.dpo import DPOMethod
from trainer.methods import CPTMethod, TrainContext, TrainingMethod
from trainer.online import OnlineTraining
from trainer.rewards import RewardScorer, load_reward_function
from trainer.optimizer import AdapterOptimizer
from trainer.recorder import Recorder
from trainer.replay import replay_ledger
from trainer.replica_fates import ReplicatedSaveJournal
from trainer.replicated import ROUND_TIMEOUT_S, Replica, ReplicaSync
from trainer.serving_copy import build_serving_copies
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


def _recordings_save_activations_only(model) -> bool:
    """Whether every adapted layer's LoRA product under autograd comes from its group's
    training copy (trainer/training_copy.py), so that a recorded graph saves activations
    only, never a LoRA weight (engine/saved_bytes_memo.py)."""
    adapted = [module for module in model.modules() if isinstance(module, LeanLoraLinear)]
    return bool(adapted) and all(module.serving_group is not None and module.serving_group.training is not None
                                 and module.plain_adapter() for module in adapted)


def _saved_bytes_memo(model, config: TrainConfig) -> SavedBytesMemo | None:
    """Recordings without saved-tensor hooks where they save activations only: always, with
    every adapted layer on its training copy; with merged serving on the CPU, whenever
    every adapted layer's merged copy is current (not just after an optimizer step)."""
    if _recordings_save_activations_only(model):
        return SavedBytesMemo()
    adapted = [module for module in model.modules() if isinstance(module, LeanLoraLinear)]
    if config.merged_serving and adapted and all(module.can_merge() for module in adapted):
        dtype = adapted[0].base_layer.weight.dtype  # the model's: the hidden states' a recorded forward reads
        return SavedBytesMemo(applies=functools.partial(records_through_merged, adapted, dtype))
    return None


def build_training(runner: ModelRunner, tokenizer, max_model_len: int, config: TrainConfig,
                   offload: OffloadConfig | None = None, method: TrainingMethod | None = None,
                   init_lora_weights: bool | str = True, checkpointer: AdapterCheckpointer | None = None,
                   wakeup: Wakeup | None = None, heap_warming: bool = True,
                   ledger: Ledger | None = None, replica: Replica | None = None) -> OnlineTraining:
    """Wraps the runner's model with LoRA and builds online training around it: the
    recorder decides and receives recordings, the offloader (with a device budget)
    places them; `method` overrides the mode's (a custom method); `checkpointer` saves
    versions (an adapter directory); `wakeup` wakes the serving loop when a reward
    function's rewards arrive; `heap_warming`: pre-fault the heap for recordings (on the
    CPU; a benchmark turns it off to measure what it saves); `ledger`: the feedback
    ledger (an adapter directory), whose unfinished labels are taken back before serving;
    `replica`: this process's place among data-parallel replicas (torch.distributed is
    initialised): every replica starts from rank 0's adapter and their steps are combined.
    The engine is built after, with `OnlineTraining.engine_hooks()`."""
    method, model = method or default_method(config), runner.model
    peft_model = attach_lora(model, config, init_lora_weights)
    optimizer = AdapterOptimizer(lora_parameters(peft_model), config.learning_rate, config.max_grad_norm,
                                 given=checkpointer.mark.give if checkpointer is not None else None)
    replicas = ReplicaSync(optimizer.params, replica.rank, wakeup or (lambda: None)) if replica is not None else None
    model_dtype = next(model.parameters()).dtype
    budget = size_cache(config.cache_bytes, runner.device, model.config, model_dtype)
    logger.info("activation cache: %.2f GiB (%s), about %d prompt tokens of recordings", budget.budget_bytes / 2**30,
                budget.source, budget.tokens)
    cache = ActivationCache(budget.budget_bytes, config.cache_full_policy, config.label_timeout_s,
                            max_label_entries=config.max_label_entries, journal=ledger)
    stats = TrainingStats()
    # PEFT keeps a float32 adapter: on a float32 model its own path is already the model's dtype
    train_in_model_dtype = config.lora_compute_dtype == "model" and model_dtype != torch.float32
    serving_copies = build_serving_copies(runner.layers, lambda module: isinstance(module, LeanLoraLinear),
                                          model_dtype, train_in_model_dtype)
    runner.saved_bytes_memo = _saved_bytes_memo(model, config)
    if config.merged_serving:
        merge_all(peft_model)  # merged serving weights are built now, while nobody is waiting
    # with merged serving, decode never touches the base layers' packed weights; pack
    # them now rather than in the first recorded prefill
    for module in model.modules():
        if isinstance(module, PackedLinear):
            module.ensure_packed()
    offloader = None
    if offload is not None and offload.device_budget_bytes > 0:  # calibrated on the serving path just built
        offloader = build_offloader(model, offload, max_model_len, functools.partial(recompute_segment, runner))
        optimizer.zero_grad()  # calibration ran a backward
    stash = WeightStash(peft_model, offloader.param_keys if offloader is not None else None,
                        [group.training for group in serving_copies if group.training is not None])
    if offloader is not None:
        for group in serving_copies:
            if group.training is not None:
                group.training.count_as_weights(offloader.param_keys)
    # recordings in host memory land on pre-faulted pages (engine/malloc_tuning.py)
    warmer = HeapWarmer() if heap_warming and runner.device.type == "cpu" else None
    maintenance = Maintenance(cache, peft_model, config.merged_serving, stats, warmer, serving_copies,
                              trim_slack_bytes=config.trim_slack_mib << 20)
    gate = build_gate(runner, peft_model, tokenizer, max_model_len, config)
    lifecycle = AdapterLifecycle(peft_model, optimizer, cache, stash, maintenance, stats, method.name, checkpointer,
                                 gate, ledger)
    context = TrainContext(runner, peft_model, offloader, config.head_chunk_rows, config.one_backward_sweep)
    trainer = Trainer(config, method, context, optimizer, cache, stats, stash, lifecycle, offloader, replicas)
    feedback = FeedbackIntake(method, cache, stats, tokenizer, max_model_len, ledger, runner.sampler.eos_token_ids)
    rewards = None
    if config.reward_function:
        decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
        rewards = RewardScorer(load_reward_function(config.reward_function), config.reward_timeout_s, cache, stats,
                               feedback.submit, decode, wakeup or (lambda: None))
    recorder = Recorder(config, method, cache, lifecycle.serving_version, lambda: optimizer.version, stats, offloader,
                        warmer, rewards, ledger, recording_paused=lambda: not lifecycle.can_record())
    known = lifecycle.known_version()  # every node's ledger: a number served anywhere is not given again
    lifecycle.resume(known if replicas is None else replicas.largest(known))  # before anything is served
    if replicas is not None:  # rank 0's adapter (resumed, or initialised) is everyone's
        lifecycle.adopted(replicas.adopt_rank0(lifecycle.adoptable, lambda s: lifecycle.restore(s, s.version)))
        maintenance.merge_all()
        replicas.start(optimizer.version)
        if checkpointer is not None:  # rank 0 saves a version once every replica's fates for it are written
            checkpointer.journal = ReplicatedSaveJournal(replicas.fates, ledger, ROUND_TIMEOUT_S)
    lifecycle.score_baseline()
    if ledger is not None:  # labels not in the resumed version train again; recent requests take feedback
        replay_ledger(ledger, method, cache, optimizer.version, lifecycle.restored_from, config.label_timeout_s,
                      rewards, replica.owns if replica is not None else None)
    return OnlineTraining(config, method, peft_model, optimizer, cache, stats, stash, context, trainer, maintenance,
                          lifecycle, feedback, recorder, offloader, rewards, ledger, replicas)


def build_gate(runner: ModelRunner, peft_model, tokenizer, max_model_len: int, config: TrainConfig) -> EvalGate | None:
    """The eval gate on `config.eval_set`'s probes (None without one). It holds serving on
    the promoted version through the weights serving reads: the merged copies (CPU) and
    the adapter's serving copy (every device; trainer/serving_copy.py)."""
    if not config.eval_set:
        return None
    probes = load_eval_set(config.eval_set, tokenizer, max_model_len)
    return EvalGate(probes, runner, peft_model, config.eval_tolerance, config.eval_max_kl or None,
                    config.eval_kl_prompts, config.head_chunk_rows)


def build_training_engine(model, tokenizer, config: EngineConfig, train: TrainConfig,
                          observers: tuple[EngineObserver, ...] = (), **training_options
                          ) -> tuple[LLMEngine, OnlineTraining]:
    """The engine on `model` with online training plugged in (`build_training`'s options);
    `observers` also receive the engine's outputs (metrics)."""
    runner = build_runner(model, tokenizer, config)
    training = build_training(runner, tokenizer, config.model.max_model_len, train, **training_options)
    return LLMEngine(runner, tokenizer, config, training.engine_hooks(observers)), training


@dataclass
class Stack:
    """Everything the server runs, built and connected."""

    name: str
    engine: LLMEngine
    async_engine: AsyncEngine
    metrics: ServingMetrics
    # None when training is off
    training: OnlineTraining | None
    arbiter: Arbiter | None
    # the saved adapter served frozen (training off), if any
    served_adapter: ServedAdapter | None = None


def build_stack(config: AlchemistConfig, model, tokenizer, name: str, replica: Replica | None = None) -> Stack:
    """`replica`: this process's place among data-parallel replicas (server/replicas.py)."""
    served_adapter = None
    if config.train.mode == "off":  # a saved adapter, if one is named, is served frozen
        model, served_adapter = merge_frozen_adapter(model, config.adapter)
        if served_adapter is not None and served_adapter.name:
            name = served_adapter.name
    elif config.adapter.lora_module:
        raise ValueError("adapter.lora_module (--lora-modules) serves an adapter frozen, with training off; "
                         "to train from a saved adapter, resume with --adapter-dir")
    elif config.adapter.version != -1:
        raise ValueError(f"adapter.version ({config.adapter.version}) picks the saved version served frozen, with "
                         "training off; training resumes from the newest (roll back to another with "
                         "POST /v1/adapters/rollback once it has started)")
    runner = build_runner(model, tokenizer, config)
    metrics = ServingMetrics(name, runner.cache_info())
    training = arbiter = None
    wakeup = Wakeup()
    hooks = EngineHooks(observers=(metrics,))
    if config.train.mode != "off":
        checkpointer, ledger = build_saving(config, replica)
        try:
            training = build_training(runner, tokenizer, config.model.max_model_len, config.train, config.offload,
                                      checkpointer=checkpointer, wakeup=wakeup, ledger=ledger, replica=replica)
        except BaseException:
            if ledger is not None:
                ledger.close()
            raise
        logger.info("online training: %s, LoRA rank %d, learning rate %g", config.train.mode,
                    config.train.lora_rank, config.train.learning_rate)
        hooks = training.engine_hooks(hooks.observers)
        arbiter = Arbiter(training, config.arbiter)
    engine = LLMEngine(runner, tokenizer, config, hooks)
    async_output = config.server.async_output == "on" or (config.server.async_output == "auto"
                                                           and runner.device.type == "cuda")
    async_engine = AsyncEngine(engine, idle_hook=arbiter, wakeup=wakeup, async_output=async_output)
    metrics.add_engine(async_engine, arbiter, config.arbiter.policy)
    if training is not None:
        metrics.add_trainer(training)
    return Stack(name, engine, async_engine, metrics, training, arbiter, served_adapter)


def build_saving(config: AlchemistConfig, replica: Replica | None) -> tuple[AdapterCheckpointer | None, Ledger | None]:
    """The adapter directory's checkpointer and feedback ledger (None, None without one).
    Among replicas only rank 0 saves versions, and the replicas of a node write its one
    ledger (SQLite, WAL): the node's first replica creates it, then the others open it."""
    if not config.adapter.dir:
        return None, None
    root = Path(config.adapter.dir)
    store = AdapterStore(root, config.adapter.keep) if replica is None or replica.rank == 0 else None
    ledger = None
    if config.ledger.enabled:
        if replica is None:
            ledger = Ledger(root / LEDGER_FILE, config.ledger)
        else:
            import torch.distributed as dist

            for opens in (replica.local_rank == 0, replica.local_rank != 0):
                dist.barrier()
                if opens:
                    root.mkdir(parents=True, exist_ok=True)  # another node's directory
                    ledger = Ledger(root / LEDGER_FILE, config.ledger)
    checkpointer = None
    if store is not None:
        checkpointer = AdapterCheckpointer(store, config.adapter.save_every, ledger)
    return checkpointer, ledger
