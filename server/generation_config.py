"""Sampling defaults from the model's generation config, as vLLM applies them
(`--generation-config`, default `auto`): a request that leaves temperature, top_p, top_k,
min_p or repetition_penalty out is sampled with the model's value rather than OpenAI's
default; a value the request sends always wins.

- `auto`: the model's generation config (transformers' GenerationConfig, from its
  generation_config.json). The embedded SmolLM2-135M-Instruct ships as a GGUF without
  one; its model card recommends temperature 0.2 and top_p 0.9, and those are its defaults
  (at OpenAI's temperature 1 the 135M model answers nonsense).
- `vllm`: OpenAI's defaults (temperature 1, top_p 1, no top_k, min_p or repetition penalty).
- a folder: the generation_config.json in it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from engine.sampling_params import InvalidParameter, SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_MODES = ("auto", "vllm")
# what a generation config may set that a request leaves out (vLLM's names, and HF's)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# SmolLM2-135M-Instruct's model card (huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct)
EMBEDDED_RECOMMENDED = {"temperature": 0.2, "top_p": 0.9}


def sampling_defaults(setting: str, model=None, embedded: bool = False) -> dict[str, float | int]:
    """The defaults `setting` (auto | vllm | a folder) gives requests for `model` (whose
    `generation_config` is read under `auto`); `embedded`: it is the embedded model.
    Raises ValueError for a folder without a generation config or values out of range."""
    if setting == "vllm":
        return {}
    if setting == "auto":
        defaults = dict(EMBEDDED_RECOMMENDED) if embedded else {}
        defaults.update(_sampling_fields(getattr(model, "generation_config", None)))
    else:
        defaults = _sampling_fields(_read_folder(setting))
    try:
        SamplingParams(**defaults)
    except InvalidParameter as exc:
        raise ValueError(f"the generation config ({setting}) sets {exc}") from None
    return defaults


def _sampling_fields(config) -> dict[str, float | int]:
    """The sampling fields a GenerationConfig sets (those that differ from its own defaults)."""
    if config is None:
        return {}
    diff = config.to_diff_dict()
    return {name: diff[name] for name in SAMPLING_FIELDS if diff.get(name) is not None}


def _read_folder(path: str):
    from transformers import GenerationConfig

    if not (Path(path) / "generation_config.json").is_file():
        raise ValueError(f"--generation-config must be auto, vllm or a folder holding generation_config.json; "
                         f"got {path!r}")
    return GenerationConfig.from_pretrained(path)


def log_defaults(defaults: dict, setting: str) -> None:
    """Says at startup which defaults requests get, as vLLM does."""
    if defaults:
        logger.info("sampling defaults from the model's generation config (%s), for the fields a request leaves "
                    "out: %s; --generation-config vllm uses OpenAI's (temperature 1, top_p 1)", setting,
                    ", ".join(f"{k}={v}" for k, v in defaults.items()))
    else:
        logger.info("sampling defaults: OpenAI's (temperature 1, top_p 1)%s",
                    "" if setting == "vllm" else "; the model's generation config sets none")
