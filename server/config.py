"""Configuration: the server's section, and the whole config assembled from every
package's sections, built from TOML, environment variables and CLI flags.

`configs/default.toml` holds the defaults (mirrored by the dataclass defaults, so the
engine is usable without the file); `load_config` layers a user file, then environment
variables (`ALCHEMIST_<SECTION>_<KEY>`, e.g. `ALCHEMIST_SERVER_API_KEY`), then flag
overrides on top, key by key, and rejects unknown sections or keys.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, check_positive
from server.reasoning import REASONING_PARSERS
from offload.config import OffloadConfig
from trainer.config import AdapterConfig, ArbiterConfig, LedgerConfig, TrainConfig

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[1] / "configs" / "default.toml"

logger = logging.getLogger(__name__)


ORIGIN_PATTERN = re.compile(r"[a-z][a-z0-9+.-]*://[^/\s?#]+")


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    # when set, every /v1/* route requires "Authorization: Bearer <api_key>" (/health and /metrics stay open)
    api_key: str = field(default="", repr=False)
    # when set, the adapter routes (/v1/adapters*) require this key instead of api_key
    admin_key: str = field(default="", repr=False)
    # sequences waiting beyond max_num_seqs running (a request: its prompts × n); more get 429
    max_queued_requests: int = 256
    # request bodies larger than this get 413
    max_body_bytes: int = 4 << 20
    # a request's headers must arrive within this many seconds of the connection's opening (or
    # of its first byte), and its body may pause no longer between pieces; else the
    # connection closes (server/read_deadline.py). A request received whole is never timed
    read_timeout_s: float = 30.0
    # on: a serving step's tokens reach the HTTP streams once the next step's device work is
    # queued, so that the event loop's per-token work runs while the device computes (vLLM's
    # async output processing); off: as each step ends; auto: on on a GPU, off on the CPU
    # (whose forward runs on the host: tokens would wait a whole step)
    async_output: str = "auto"
    # the origins (scheme://host[:port], or "*": any) whose web pages may call this server
    # from a browser (CORS); none by default, which is what keeps a page the user opens from
    # posting labels or rollbacks to it (a JSON body from another origin needs a preflight)
    allowed_origins: tuple[str, ...] = ()
    # a thinking model's reasoning apart from its answer in chat completions (server/reasoning.py):
    # "qwen3" or "deepseek_r1", as vLLM's --reasoning-parser; empty: the answer's text as generated
    reasoning_parser: str = ""
    # the Responses API's stored responses (`GET /v1/responses/{id}`, `previous_response_id`), the
    # oldest pruned beyond this many: in the adapter directory beside the ledger when training
    # keeps one there, else in memory. 0: none stored
    max_stored_responses: int = 10_000
    # and at most this many bytes of them (their JSON), the least recently used pruned first
    max_stored_response_bytes: int = 512 << 20

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"server.port must be in 1..65535, got {self.port}")
        # as a browser sends it: scheme://host[:port], no path, no trailing slash (else it never matches), in
        # lower case as browsers write them; "null" is a file:// page's or a sandboxed frame's
        if not all(isinstance(origin, str) and (origin in ("*", "null") or ORIGIN_PATTERN.fullmatch(origin.lower()))
                   for origin in self.allowed_origins):
            raise ValueError(f"server.allowed_origins must be origins as a browser sends them (\"https://host\", "
                             f"\"http://host:port\": no path or trailing slash), \"null\" or \"*\"; got "
                             f"{list(self.allowed_origins)!r}")
        object.__setattr__(self, "allowed_origins", tuple(origin.lower() for origin in self.allowed_origins))
        check_positive(self, "max_body_bytes")
        check_positive(self, "max_stored_response_bytes")
        if not (isinstance(self.read_timeout_s, (int, float)) and not isinstance(self.read_timeout_s, bool)
                and 0 < self.read_timeout_s < float("inf")):
            raise ValueError(f"server.read_timeout_s must be positive and finite, got {self.read_timeout_s!r}")
        if self.async_output not in ("auto", "on", "off"):
            raise ValueError(f"server.async_output must be auto, on or off, got {self.async_output!r}")
        if self.reasoning_parser not in ("", *REASONING_PARSERS):
            raise ValueError(f"server.reasoning_parser must be one of {', '.join(REASONING_PARSERS)} (or empty), "
                             f"got {self.reasoning_parser!r}")
        for name in ("max_queued_requests", "max_stored_responses"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"server.{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class AlchemistConfig(EngineConfig):
    """Every section; the engine's three come from EngineConfig."""

    train: TrainConfig = field(default_factory=TrainConfig)
    arbiter: ArbiterConfig = field(default_factory=ArbiterConfig)
    adapter: AdapterConfig = field(default_factory=AdapterConfig)
    ledger: LedgerConfig = field(default_factory=LedgerConfig)
    offload: OffloadConfig = field(default_factory=OffloadConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


_SECTIONS = {f.name: f for f in dataclasses.fields(AlchemistConfig)}


def _merge(base: dict[str, dict[str, Any]], layer: dict[str, Any], origin: str, typed: bool = False) -> None:
    """Layers `layer` over `base`; `typed` (a TOML file's): each value must have its key's type."""
    for section, values in layer.items():
        if section not in _SECTIONS and not isinstance(values, dict):  # `mode = "dpo"` above every [section]
            homes = [f"[{name}]" for name, f in _SECTIONS.items()
                     if section in {field.name for field in dataclasses.fields(f.default_factory())}]
            raise ValueError(f"{origin}: {section} is outside any section; "
                             + (f"it belongs under {' or '.join(homes)}" if homes else
                                f"the sections are {sorted(_SECTIONS)}"))
        if section not in _SECTIONS:
            raise ValueError(f"{origin}: unknown section [{section}]; known: {sorted(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ValueError(f"{origin}: [{section}] must be a table")
        defaults = _SECTIONS[section].default_factory()
        known = {f.name for f in dataclasses.fields(defaults)}
        for key, value in values.items():
            if key not in known:
                raise ValueError(f"{origin}: unknown key {section}.{key}; known: {sorted(known)}")
            if typed:
                _check_type(origin, f"{section}.{key}", value, getattr(defaults, key))
            base.setdefault(section, {})[key] = value


def _check_type(origin: str, name: str, value: Any, default: Any) -> None:
    """A TOML value of the key's type (TOML has them all: "8000" is a string, not a port)."""
    if isinstance(default, bool):
        ok, kind = isinstance(value, bool), "true or false"
    elif isinstance(default, int):
        ok, kind = isinstance(value, int) and not isinstance(value, bool), "an integer"
    elif isinstance(default, float):
        ok, kind = isinstance(value, (int, float)) and not isinstance(value, bool), "a number"
    elif isinstance(default, str):
        ok, kind = isinstance(value, str), "a string"
    elif isinstance(default, (tuple, list)):
        ok, kind = isinstance(value, list), "a list"
    else:
        return
    if not ok:
        raise ValueError(f"{origin}: {name} must be {kind}, got {value!r}")


ENV_PREFIX = "ALCHEMIST_"
# ALCHEMIST_* variables that are not configuration (the model cache, a replica's agent, the tests' device);
# ALCHEMIST_EXP_* are experiments' instruments (docs/)
NOT_CONFIG_VARIABLES = ("ALCHEMIST_CACHE", "ALCHEMIST_AGENT_PID", "ALCHEMIST_SERVING_MARKS", "ALCHEMIST_TEST_DEVICE")


# settings that are lengths in tokens: `4k` and `32K` as vLLM's flags take them
TOKEN_LENGTHS = ("max_model_len", "max_num_batched_tokens")


def tokens_in(text: str) -> int:
    """4096, 25.6k (1000s) or 32K (1024s, whole numbers only); ValueError otherwise."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG])", text.strip())
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise ValueError(f"{text!r} is not a whole number (e.g. 4096, 4k or 4K)") from None
    number, suffix = match.groups()
    if suffix.islower():
        return int(float(number) * 1000 ** " kmg".index(suffix))
    if "." in number:
        raise ValueError(f"{text!r}: a binary suffix ({suffix}) takes a whole number; {number}{suffix.lower()} is "
                         "in thousands")
    return int(number) * 1024 ** " KMG".index(suffix)


def _parse_env_value(name: str, text: str, default: Any) -> Any:
    if name.lower().endswith(TOKEN_LENGTHS):
        try:
            return tokens_in(text)
        except ValueError as exc:
            raise ValueError(f"environment: {name}: {exc}") from None
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
            if name not in NOT_CONFIG_VARIABLES and not name.startswith(f"{ENV_PREFIX}EXP_"):
                hint = f"; the server reads {ENV_PREFIX}SERVER_{rest.upper()} (`serve` refuses to start while " \
                    "that is unset)" if rest in ("api_key", "admin_key") else ""
                logger.warning("environment: %s is no configuration variable (%s<SECTION>_<KEY>, sections %s), and "
                               "is ignored%s", name, ENV_PREFIX, sorted(_SECTIONS), hint)
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
        _merge(merged, tomllib.loads(DEFAULT_CONFIG_PATH.read_text()), str(DEFAULT_CONFIG_PATH), typed=True)
    given: list[tuple[str, dict[str, Any]]] = []  # the layers above the defaults, as (origin, layer)
    if path is not None:
        path = Path(path)
        if path.is_dir() or not path.exists():
            raise FileNotFoundError(f"config file not found: {path}" + (" (a directory)" if path.is_dir() else ""))
        try:
            given.append((str(path), tomllib.loads(path.read_text())))
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ValueError(f"{path}: {exc}") from None
        _merge(merged, given[-1][1], str(path), typed=True)
    given.append(("environment", config_from_env(environ)))
    _merge(merged, given[-1][1], "environment")
    if overrides:
        flags = {section: {k: v for k, v in values.items() if v is not None} for section, values in overrides.items()}
        given.append(("command line", flags))
        _merge(merged, given[-1][1], "command line")
    config = AlchemistConfig(**{s: _SECTIONS[s].default_factory(**kv) for s, kv in merged.items()})
    _refuse_a_gate_without_its_set(config, given)
    return config


def _refuse_a_gate_without_its_set(config: AlchemistConfig, given: list[tuple[str, dict[str, Any]]]) -> None:
    """A gate's setting given (a flag, the environment, a file) without `train.eval_set`: no
    version would be gated, the operator believing one is (a mistyped --eval-set too)."""
    if config.train.eval_set:
        return
    for origin, layer in given:
        for key in ("eval_tolerance", "eval_max_kl"):
            if key in layer.get("train", {}):
                raise ValueError(f"{origin}: train.{key} (--{key.replace('_', '-')}) sets the eval gate, which runs "
                                 "with train.eval_set (--eval-set FILE); without it no version is gated")


def refuse_a_key_left_unset(config: AlchemistConfig, environ: dict[str, str] | None = None) -> None:
    """`ALCHEMIST_API_KEY=… alchemist serve` (compose's name on the host) would serve every
    route without a key, the operator believing it set one: a start-up error of `serve`
    while the key it stands for (`server.api_key`, `server.admin_key`) is unset in every
    layer (commands that serve nothing, `profile` and the benches, are not refused)."""
    environ = os.environ if environ is None else environ
    for name in environ:
        rest = name[len(ENV_PREFIX):].lower() if name.startswith(ENV_PREFIX) else ""
        if rest in ("api_key", "admin_key") and not getattr(config.server, rest):
            raise ValueError(f"environment: {name} is set, but the server reads its key from {ENV_PREFIX}SERVER_"
                             f"{rest.upper()} (or --{rest.replace('_', '-')}, or server.{rest} in --config): "
                             f"started, it would serve without that key. Set one of those, or unset {name}")


def check_paths(config: AlchemistConfig) -> None:
    """The directory and files the settings name, checked before the model loads: an
    OSError naming the setting (not an `[Errno 17]` from deep in the start, after it)."""
    if config.offload.profile and not Path(config.offload.profile).is_file():
        raise OSError(f"offload.profile (--offload-profile) {config.offload.profile} is no file")
    if not config.adapter.dir or config.train.mode == "off":
        return
    directory = Path(config.adapter.dir)
    if directory.exists() and not directory.is_dir():
        raise OSError(f"adapter.dir (--adapter-dir) {directory} is no directory")
    existing = next(path for path in (directory, *directory.parents) if path.exists())
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise OSError(f"adapter.dir (--adapter-dir) {directory} cannot be written: {existing} is no directory this "
                      "user may write in")
