"""Builds the activation offloader for an engine: the memory model and timings come from
a profile file when one is configured, otherwise from a short calibration now."""

from __future__ import annotations

import logging

import torch

from offload.calibration import calibrate
from offload.config import OffloadConfig
from offload.memory_model import MemoryModel, OffloadingMap
from offload.offloader import ActivationOffloader, RecomputeFn
from offload.profile import load_profile

logger = logging.getLogger(__name__)


def parameter_keys(model: torch.nn.Module) -> set[int]:
    """Storages of the model's parameters and buffers: never activations."""
    return {t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())}


def calibrated_model(model, max_model_len: int, recompute: RecomputeFn,
                     token_lengths: tuple[int, ...] = (64, 256)):
    """(MemoryModel, Timings, measurements) measured on this device now."""
    parameter = next(model.parameters())
    memory = MemoryModel.analytic(model.config, parameter.element_size(), max_model_len)
    timings, measurements = calibrate(recompute, model.config.hidden_size, parameter.device, parameter.dtype,
                                      token_lengths)
    memory.calibrate({m.tokens: m.saved_bytes for m in measurements})
    return memory, timings, measurements


def build_offloader(model, offload: OffloadConfig, max_model_len: int, recompute: RecomputeFn) -> ActivationOffloader:
    if offload.profile:
        memory, timings = load_profile(offload.profile, model.config, next(model.parameters()).element_size())
        source = offload.profile
    else:
        memory, timings, _ = calibrated_model(model, max_model_len, recompute)
        source = "calibration at start"
    device = next(model.parameters()).device
    logger.info("activation offloader: device budget %.1f MiB, host pool %.1f MiB, policy %s; %.0f KiB per "
                "layer-token, %.2f GB/s host->device, recompute %.1f us/token, backward %.1f us/token (%s)",
                offload.device_budget_bytes / 2**20, offload.host_budget_bytes / 2**20, offload.policy,
                memory.per_token / 1024, timings.bandwidth_bytes_per_s / 1e9, timings.recompute_per_token_s * 1e6,
                timings.backward_per_token_s * 1e6, source)
    return ActivationOffloader(offload, device, OffloadingMap(memory, offload.device_budget_bytes), timings,
                               parameter_keys(model), recompute)
