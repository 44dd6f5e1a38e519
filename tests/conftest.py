"""Shared fixtures: tiny engines and in-process servers; `gpu` tests skip without CUDA."""

from __future__ import annotations

import os
import weakref

import pytest
import torch

from server.config import AlchemistConfig

from engine.config import CacheConfig, ModelConfig, SchedulerConfig

from offload.config import OffloadConfig
from engine.llm_engine import LLMEngine
from engine.hooks import EngineHooks
from server.build import build_training_engine
from tests.tiny import tiny_model, tiny_tokenizer
from trainer.entries import EntryState

# One intra-op thread unless OMP_NUM_THREADS says otherwise: the models here are tiny, so a
# second thread buys little, and on a shared 2-core CI machine whose other core is busy it
# makes every op wait for a descheduled thread (the suite ran 7-20x slower so).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def make_config(max_model_len: int = 256, block_size: int = 4, kv_cache_bytes: int = 4 << 20,
                max_num_seqs: int = 8, max_num_batched_tokens: int = 64,
                offload: OffloadConfig | None = None, fork_choices: bool = True,
                enable_prefix_caching: bool = True) -> AlchemistConfig:
    return AlchemistConfig(
        offload=offload or OffloadConfig(),
        model=ModelConfig(max_model_len=max_model_len),
        cache=CacheConfig(block_size=block_size, kv_cache_bytes=kv_cache_bytes,
                          enable_prefix_caching=enable_prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                  fork_choices=fork_choices),
    )


def make_engine(family: str = "llama", observers: tuple = (), **config_kwargs) -> LLMEngine:
    """A tiny engine; `observers` receive its steps and outputs."""
    return LLMEngine.for_model(tiny_model(family), tiny_tokenizer(), make_config(**config_kwargs),
                               EngineHooks(observers=tuple(observers)))


@pytest.fixture
def tokenizer():
    return tiny_tokenizer()


def encode(text: str) -> list[int]:
    return tiny_tokenizer()(text)["input_ids"]


# the engine each test trainer was built on (the trainer itself holds only its parts)
_ENGINES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def make_training(config, family: str = "llama", offload: OffloadConfig | None = None,
                  dtype: torch.dtype = torch.float32, num_layers: int = 2, fork_choices: bool = True,
                  **training_options):
    """A tiny engine with online training (`build_training_engine`); the training's
    engine is remembered for `engine_of`."""
    engine, training = build_training_engine(tiny_model(family, dtype=dtype, num_layers=num_layers), tiny_tokenizer(),
                                             make_config(offload=offload, fork_choices=fork_choices),
                                             config, offload=offload, **training_options)
    _ENGINES[training] = engine
    return training


def engine_of(trainer) -> LLMEngine:
    return _ENGINES[trainer]


def run_into_a_backward(training) -> None:
    """Runs slices until the job in progress has consumed part of its entry's recording."""
    def consumed(entry) -> bool:
        return entry.recording is not None and any(segment is None for segment in entry.recording.segments)

    for _ in range(1000):
        if any(consumed(e) for e in training.cache.entries() if e.state is EntryState.TRAINING):
            return
        assert training.run_slice()
    raise AssertionError("no backward began")
