"""Tiny random models of each supported family and a tiny tokenizer, built in-process.

No download: a byte-level BPE tokenizer is trained on a few sentences, given ChatML
special tokens and a chat template; models are 2 layers, hidden 64, with that vocabulary.
"""

from __future__ import annotations

import os

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config,
                          Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

FAMILIES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma3_text")
# ALCHEMIST_TEST_DEVICE=cuda runs the tests built on tiny models on a GPU (the bring-up
# of `bench/gpu.sh`); the default is the CPU that CI has
TEST_DEVICE = torch.device(os.environ.get("ALCHEMIST_TEST_DEVICE", "cpu"))

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, how are you today? I am fine, thank you.",
    "Online learning trains a LoRA adapter on what the server just served.",
    "Continuous batching lets new requests join the running batch at every step.",
    "Numbers 0 1 2 3 4 5 6 7 8 9 and symbols ! ? , . : ; - _ ( ) [ ] { } \" '",
    "é è à ü ö 日本語 emoji 🙂",
]

_tokenizer_cache: PreTrainedTokenizerFast | None = None


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    global _tokenizer_cache
    if _tokenizer_cache is None:
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=special,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        tok.train_from_iterator(_CORPUS * 20, trainer)
        _tokenizer_cache = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>", pad_token="<|endoftext|>",
            unk_token="<|endoftext|>")
        _tokenizer_cache.chat_template = CHAT_TEMPLATE
    return _tokenizer_cache


def tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32, hidden_size: int = 64,
               num_layers: int = 2, max_positions: int = 512):
    tok = tiny_tokenizer()
    common = dict(vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                  num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                  eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, pad_token_id=tok.pad_token_id,
                  tie_word_embeddings=False)
    config_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "gemma3_text": (Gemma3TextConfig, Gemma3ForCausalLM),
    }[family]
    extra = {"sliding_window": None} if family in ("mistral", "phi3") else {}
    if family == "qwen3":  # heads wider than hidden / heads, as Qwen3's are (its q/k norms act on them)
        extra["head_dim"] = 2 * hidden_size // common["num_attention_heads"]
    if family == "gemma3_text":  # a window short enough that the tests' prompts pass it; both kinds of layer;
        # attention scaled by a scalar of its own, not by the heads' width (as some Gemma 3 models are)
        head_dim = hidden_size // common["num_attention_heads"]
        extra.update(head_dim=head_dim, query_pre_attn_scalar=head_dim + 8, sliding_window=8,
                     layer_types=(["sliding_attention", "full_attention"] * num_layers)[:num_layers])
    torch.manual_seed(seed)
    config = config_cls(**common, **extra)
    model = model_cls(config).to(dtype).eval()
    # A larger init than the default std 0.02 gives peaked logits, so greedy decoding does
    # not hinge on float rounding between batched and unbatched matmuls.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.15)
    return model.to(TEST_DEVICE)
