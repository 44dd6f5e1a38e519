"""The engine's configuration: model, KV cache and scheduler, one frozen dataclass each.

The other packages keep their sections beside them (`trainer/config.py`,
`offload/config.py`, `server/config.py`); `server/config.py` assembles them all into
`AlchemistConfig` and loads it from TOML, the environment and flags.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

LOAD_FORMATS = ("auto", "dummy")
DECODE_ATTENTION = ("auto", "gather", "flex")

@dataclass(frozen=True)
class ModelConfig:
    # local Hugging Face model directory; "" selects the embedded SmolLM2-135M-Instruct
    model: str = ""
    # the name clients put in the "model" field ("" derives it from the model); several,
    # comma-separated (vLLM's --served-model-name takes a list): each is accepted, and a
    # response names the one its request gave; the first is /metrics' model_name
    served_model_name: str = ""
    # auto | float32 | bfloat16 | float16
    dtype: str = "auto"
    # auto | cpu | cuda | cuda:N
    device: str = "auto"
    # upper bound on prompt + completion tokens of one sequence
    max_model_len: int = 2048
    # on CPU, run frozen linear layers through oneDNN with prepacked weights (engine/packed_linear.py)
    packed_linear: bool = True
    # on a GPU, run the decode step eagerly instead of replaying CUDA graphs (vLLM's
    # --enforce-eager; engine/decode_graphs.py)
    enforce_eager: bool = False
    # how decode rows read the KV cache: gather (their K/V copied out of the block pool for
    # SDPA), flex (read in place through their block tables by FlexAttention, compiled on
    # a GPU; engine/paged_decode.py), or auto: flex on a GPU, gather on the CPU
    decode_attention: str = "auto"
    # local tokenizer directory; "" uses the model directory's own (or, for a directory
    # holding no tokenizer, the embedded model's)
    tokenizer: str = ""
    # auto: the weights in the model directory; dummy: random weights from its config.json
    # (vLLM's --load-format dummy), for speed and memory figures on a real model's shape
    load_format: str = "auto"
    # defaults for the sampling fields a request leaves out (vLLM's --generation-config):
    # auto, the model's generation config (server/generation_config.py); vllm, OpenAI's
    # (temperature 1, top_p 1); or a folder holding a generation_config.json
    generation_config: str = "auto"
    # seeds the random number generators once the server is built (vLLM's --seed): requests
    # without a seed of their own sample the same tokens on every start given the same
    # traffic, and another seed draws others; -1: not seeded here (torch's generators
    # start from their own default). The adapter's first weights follow train.seed
    seed: int = -1

    def __post_init__(self) -> None:
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"model.load_format must be one of {', '.join(LOAD_FORMATS)}; got {self.load_format!r}")
        if self.decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"model.decode_attention must be one of {', '.join(DECODE_ATTENTION)}; "
                             f"got {self.decode_attention!r}")
        if not isinstance(self.generation_config, str) or not self.generation_config:
            raise ValueError(f"model.generation_config must be auto, vllm or a folder; got {self.generation_config!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < -1:
            raise ValueError(f"model.seed must be an integer, at least 0 (-1: none); got {self.seed!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):
            raise ValueError(f"model.device must be auto, cpu, cuda or cuda:N; got {self.device!r}")


@dataclass(frozen=True)
class CacheConfig:
    # tokens per KV block
    block_size: int = 16
    # bytes of KV cache preallocated for all layers, K and V together
    kv_cache_bytes: int = 1 << 30
    # automatic prefix caching (vLLM's --enable-prefix-caching, on by default there too): a
    # prompt that begins with blocks of tokens computed before under the same weights takes
    # their K/V instead of computing them again (engine/block_pool.py)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    # sequences running at once (decode batch size bound)
    max_num_seqs: int = 16
    # tokens computed in one engine step, prefill chunks and decodes together
    max_num_batched_tokens: int = 2048
    # a request's n choices share one prefill (they fork choice 0's KV blocks); off, each
    # choice prefills the prompt itself (the plain path `alchemist bench serving --n` compares)
    fork_choices: bool = True
    # running decodes ride along in a recorded prefill's forward (one GEMM per linear layer
    # over all rows, no gradient for theirs), as they share a plain prefill's step; on, the
    # recorded prefill takes its step alone and they take the next, before any other
    recorded_prefill_alone: bool = False


@dataclass(frozen=True)
class EngineConfig:
    """What `LLMEngine` reads (AlchemistConfig is one, with the other packages' sections)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        check_positive(self.model, "max_model_len")
        check_positive(self.cache, "block_size", "kv_cache_bytes")
        check_positive(self.scheduler, "max_num_seqs", "max_num_batched_tokens")


def check_positive(section: Any, *names: str) -> None:
    """Each of `names` is a positive integer; the error names the setting as a TOML does
    (`ModelConfig.max_model_len` is `model.max_model_len`)."""
    for name in names:
        value = getattr(section, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            prefix = type(section).__name__.removesuffix("Config").lower()
            raise ValueError(f"{prefix}.{name} must be a positive integer, got {value!r}")


