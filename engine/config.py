"""Configuration: one frozen dataclass per component, built from TOML and CLI flags.

`configs/default.toml` holds the defaults (mirrored by the dataclass defaults, so the
engine is usable without the file); `load_config` layers a user file, then environment
variables (`ALCHEMIST_<SECTION>_<KEY>`, e.g. `ALCHEMIST_SERVER_API_KEY`), then flag
overrides on top, key by key, and rejects unknown sections or keys.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "configs" / "default.toml"


@dataclass(frozen=True)
class ModelConfig:
    # local Hugging Face model directory; "" selects the embedded SmolLM2-135M-Instruct
    model: str = ""
    # the name clients put in the "model" field; "" derives it from the model
    served_model_name: str = ""
    # auto | float32 | bfloat16 | float16
    dtype: str = "auto"
    # auto | cpu | cuda | cuda:N
    device: str = "auto"
    # upper bound on prompt + completion tokens of one sequence
    max_model_len: int = 2048
    # on CPU, run frozen linear layers through oneDNN with prepacked weights (engine/packed_linear.py)
    packed_linear: bool = True


@dataclass(frozen=True)
class CacheConfig:
    # tokens per KV block
    block_size: int = 16
    # bytes of KV cache preallocated for all layers, K and V together
    kv_cache_bytes: int = 1 << 30


@dataclass(frozen=True)
class SchedulerConfig:
    # sequences running at once (decode batch size bound)
    max_num_seqs: int = 16
    # tokens computed in one engine step, prefill chunks and decodes together
    max_num_batched_tokens: int = 2048


TRAIN_MODES = ("off", "cpt", "dpo")


@dataclass(frozen=True)
class TrainConfig:
    # off | cpt (continual pre-training on prompts) | dpo (preference alignment from feedback)
    mode: str = "off"
    learning_rate: float = 1e-4
    # LoRA rank (the paper's 8), scale alpha, and modules; empty: every linear layer of the decoder
    lora_rank: int = 8
    lora_alpha: int = 16
    target_modules: tuple[str, ...] = ()
    # DPO sigmoid loss temperature
    dpo_beta: float = 0.1
    # a DPO entry whose feedback has not arrived this many seconds after the response is evicted
    label_timeout_s: float = 300.0
    # bytes of recorded activations the activation cache may hold
    cache_bytes: int = 2 << 30
    # when a new recording does not fit: drop_new (the paper's) or evict_oldest
    cache_full_policy: str = "drop_new"
    # fraction of requests whose prefill is recorded (1: every request)
    record_fraction: float = 1.0
    # prompts longer than this are served but not recorded
    max_record_tokens: int = 2048
    # an entry recorded under an older adapter version: recompute it, or drop it
    stale_policy: str = "recompute"
    # gradient clipping (max global norm over LoRA parameters)
    max_grad_norm: float = 1.0
    # entries whose gradients are accumulated into one optimizer step
    entries_per_step: int = 1
    # seed for the adapter's initialization and the record-fraction draw
    seed: int = 0
    # on CPU, serve through merged (base + adapter) weights, rebuilt in idle slices after
    # each optimizer step: training mode then serves as fast as no adapter, for one more
    # copy of the adapted weights in memory
    merged_serving: bool = True

    def __post_init__(self) -> None:
        if self.mode not in TRAIN_MODES:
            raise ValueError(f"train.mode must be one of {TRAIN_MODES}, got {self.mode!r}")
        if self.cache_full_policy not in ("drop_new", "evict_oldest"):
            raise ValueError(f"train.cache_full_policy must be drop_new or evict_oldest, got {self.cache_full_policy!r}")
        if self.stale_policy not in ("recompute", "drop"):
            raise ValueError(f"train.stale_policy must be recompute or drop, got {self.stale_policy!r}")
        if not 0.0 <= self.record_fraction <= 1.0:
            raise ValueError(f"train.record_fraction must be in [0, 1], got {self.record_fraction}")
        for name in ("learning_rate", "dpo_beta", "label_timeout_s", "max_grad_norm"):
            if not getattr(self, name) > 0:
                raise ValueError(f"train.{name} must be positive, got {getattr(self, name)}")
        for name in ("lora_rank", "lora_alpha", "cache_bytes", "max_record_tokens", "entries_per_step"):
            _check_positive(self, name)
        object.__setattr__(self, "target_modules", tuple(self.target_modules))


ARBITER_POLICIES = ("idle", "slo")


@dataclass(frozen=True)
class ArbiterConfig:
    # idle: train only when no request is runnable (the paper's); slo: also between decode
    # steps while the measured time per output token stays under tpot_slo_ms
    policy: str = "idle"
    tpot_slo_ms: float = 100.0

    def __post_init__(self) -> None:
        if self.policy not in ARBITER_POLICIES:
            raise ValueError(f"arbiter.policy must be one of {ARBITER_POLICIES}, got {self.policy!r}")
        if not self.tpot_slo_ms > 0:
            raise ValueError(f"arbiter.tpot_slo_ms must be positive, got {self.tpot_slo_ms}")


@dataclass(frozen=True)
class AdapterConfig:
    # where the adapter is saved (PEFT format, one directory per version); "" keeps it in memory only
    dir: str = ""
    # save every this many adapter versions (and always at shutdown)
    save_every: int = 10
    # saved versions kept on disk (older ones are deleted)
    keep: int = 5

    def __post_init__(self) -> None:
        _check_positive(self, "save_every", "keep")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # when set, every /v1/* route requires "Authorization: Bearer <api_key>" (/health and /metrics stay open)
    api_key: str = field(default="", repr=False)
    # when set, the adapter routes (/v1/adapters*) require this key instead of api_key
    admin_key: str = field(default="", repr=False)
    # requests waiting beyond max_num_seqs running; more get 429
    max_queued_requests: int = 256
    # request bodies larger than this get 413
    max_body_bytes: int = 4 << 20

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        _check_positive(self, "max_body_bytes")
        if not isinstance(self.max_queued_requests, int) or self.max_queued_requests < 0:
            raise ValueError(f"server.max_queued_requests must be a non-negative integer, "
                             f"got {self.max_queued_requests!r}")


OFFLOAD_POLICIES = ("hedged", "load", "recompute")


@dataclass(frozen=True)
class OffloadConfig:
    # bytes the recorded activations and a serving step's transient memory may use on the
    # device together; 0: unlimited (no offloader: every recorded layer stays resident)
    device_budget_bytes: int = 0
    # the preallocated (pinned on CUDA) host pool freed layers are copied into
    host_budget_bytes: int = 2 << 30
    # how freed layers come back for backward: hedged (per layer, load or recompute,
    # whichever the measured costs favour), load (from the host copy), recompute
    policy: str = "hedged"
    # reloads issued this many layers ahead of the backward that needs them
    prefetch_layers: int = 2
    # a file written by `alchemist profile` (calibrated maps and timings); empty: calibrate at start
    profile: str = ""
    # when layers are copied to the host pool: "recording" (each layer as it is recorded,
    # on the copy stream — the paper's: freeing is then free), "freeing" (only the layers
    # freed, when they are), auto: recording on CUDA (a separate copy engine), freeing on
    # CPU (where the copy takes the cores the prefill runs on)
    copy_to_host: str = "auto"

    def __post_init__(self) -> None:
        if self.policy not in OFFLOAD_POLICIES:
            raise ValueError(f"offload.policy must be one of {OFFLOAD_POLICIES}, got {self.policy!r}")
        if self.copy_to_host not in ("auto", "recording", "freeing"):
            raise ValueError(f"offload.copy_to_host must be auto, recording or freeing, got {self.copy_to_host!r}")
        for name in ("device_budget_bytes", "host_budget_bytes", "prefetch_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"offload.{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class AlchemistConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    arbiter: ArbiterConfig = field(default_factory=ArbiterConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    server: ServerConfig = field(default_factory=ServerConfig)

    def __post_init__(self) -> None:
        _check_positive(self.model, "max_model_len")
        _check_positive(self.cache, "block_size", "kv_cache_bytes")
        _check_positive(self.scheduler, "max_num_seqs", "max_num_batched_tokens")


def _check_positive(section: Any, *names: str) -> None:
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(section).__name__}.{name} must be a positive integer, got {value!r}")


_SECTIONS = {f.name: f for f in dataclasses.fields(AlchemistConfig)}


def _merge(base: dict[str, dict[str, Any]], layer: dict[str, Any], origin: str) -> None:
    for section, values in layer.items():
        if section not in _SECTIONS:
            raise ValueError(f"{origin}: unknown section [{section}]; known: {sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: [{section}] must be a table")
        known = {f.name: f for f in dataclasses.fields(_SECTIONS[section].default_factory)}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"{origin}: unknown key {section}.{key}; known: {sorted(known)}")
            base.setdefault(section, {})[key] = value


ENV_PREFIX = "ALCHEMIST_"


def _parse_env_value(name: str, text: str, default: Any) -> Any:
    try:
        if isinstance(default, bool):
            if text.lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError
            return text.lower() in ("1", "true", "yes", "on")
        if isinstance(default, int):
            return int(text)
        if isinstance(default, float):
            return float(text)
        if isinstance(default, tuple):
            return tuple(item.strip() for item in text.split(",") if item.strip())
    except ValueError:
        raise ValueError(f"environment: {name}={text!r} is not a valid {type(default).__name__}") from None
    return text


def config_from_env(environ: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """`ALCHEMIST_<SECTION>_<KEY>=value` variables as a config layer (values parsed by the
    key's type; lists comma-separated). A variable naming a known section with an unknown
    key is an error; other `ALCHEMIST_*` variables (e.g. `ALCHEMIST_CACHE`) are not config."""
    environ = os.environ if environ is None else environ
    layer: dict[str, dict[str, Any]] = {}
    for name, text in environ.items():
        if not name.startswith(ENV_PREFIX):
            continue
        rest = name[len(ENV_PREFIX):].lower()
        section = next((s for s in _SECTIONS if rest.startswith(s + "_")), None)
        if section is None:
            continue
        key = rest[len(section) + 1:]
        defaults = _SECTIONS[section].default_factory()
        if not hasattr(defaults, key):
            known = sorted(f"{ENV_PREFIX}{section.upper()}_{f.name.upper()}"
                           for f in dataclasses.fields(defaults))
            raise ValueError(f"environment: unknown variable {name}; known for [{section}]: {known}")
        layer.setdefault(section, {})[key] = _parse_env_value(name, text, getattr(defaults, key))
    return layer


def load_config(
    path: str | Path | None = None,
    overrides: dict[str, dict[str, Any]] | None = None,
    environ: dict[str, str] | None = None,
) -> AlchemistConfig:
    """Defaults from configs/default.toml, then the file at `path`, then `ALCHEMIST_*`
    environment variables (`environ`, default os.environ), then `overrides`
    ({"section": {"key": value}}; None values are ignored, so unset CLI flags pass through)."""
    merged: dict[str, dict[str, Any]] = {}
    if DEFAULT_CONFIG_PATH.exists():
        _merge(merged, tomllib.loads(DEFAULT_CONFIG_PATH.read_text()), str(DEFAULT_CONFIG_PATH))
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"config file not found: {path}")
        _merge(merged, tomllib.loads(path.read_text()), str(path))
    _merge(merged, config_from_env(environ), "environment")
    if overrides:
        cleaned = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in overrides.items()}
        _merge(merged, cleaned, "command line")
    return AlchemistConfig(**{s: _SECTIONS[s].default_factory(**kv) for s, kv in merged.items()})
