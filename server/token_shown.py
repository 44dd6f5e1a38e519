"""How a token is shown in logprobs: its text, and its raw bytes (OpenAI's `bytes`, from
which a client rebuilds text whose characters span several tokens).

A token that holds part of a character decodes to U+FFFD; its bytes come from the
vocabulary instead: byte-level BPE pieces (GPT-2's alphabet: Llama 3, Qwen, SmolLM) map
back to bytes, SentencePiece's byte-fallback pieces are `<0xHH>`. Both are computed once
per token and cached.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclass
class TokenShown:
    tokenizer: object
    _text: dict[int, str] = field(default_factory=dict)
    _bytes: dict[int, bytes] = field(default_factory=dict)

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:
            text = self._text[token_id] = self.tokenizer.decode([token_id])
        return text

    def name(self, token_id: int) -> str:
        """The token as a text completion's logprobs name it: its text, or, for a token that
        holds part of a character, `bytes:\\xHH…` (OpenAI's legacy naming) — its text is
        U+FFFD, which would give every such token one name, and one key in `top_logprobs`."""
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text
        raw = self.raw_bytes(token_id)
        return text if raw == text.encode("utf-8") else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def raw_bytes(self, token_id: int) -> bytes:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = self._vocabulary_bytes(token_id)
        return raw

    def _vocabulary_bytes(self, token_id: int) -> bytes:
        text = self.text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id) or ""
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        alphabet = _byte_level_alphabet()
        if piece and all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        return text.encode("utf-8")
