"""Incremental detokenization with stop strings.

Decoding one token at a time is wrong for byte-level and SentencePiece tokenizers (a
character may span tokens; a leading space depends on the previous token), so each step
decodes a short window (`prefix_offset:`) and emits only the text past the window's
previously decoded part, waiting while the tail is an incomplete UTF-8 sequence ("\ufffd")
— the scheme vLLM uses.

Streamed text holds back the last `max(len(stop)) - 1` characters until they can no
longer begin a stop string, so a client never sees part of a stop string.
"""

from __future__ import annotations

# prompt tokens decoded as context for the first output token
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], stop: list[str],
                 include_stop_str_in_output: bool, skip_special_tokens: bool):
        self._tokenizer = tokenizer
        self._token_ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._token_ids)
        self._stop = stop
        self._include_stop = include_stop_str_in_output
        self._skip_special = skip_special_tokens
        self._holdback = max((len(s) for s in stop), default=1) - 1
        self.output_text = ""
        self._num_sent_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add a generated token; returns the stop string it completed, if any (the
        output text is then cut at it). Without `check_stop` (`min_tokens` not reached)
        stop strings are not looked for: the text keeps them, as vLLM's does."""
        self._token_ids.append(token_id)
        prefix_text = self._decode(self._token_ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        start = len(self.output_text)
        self.output_text += full_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return self._find_stop(start) if self._stop and check_stop else None

    def _find_stop(self, new_text_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self._stop:
            index = self.output_text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.output_text = self.output_text[: index + len(stop) if self._include_stop else index]
        return stop

    def take_new_text(self, finished: bool) -> str:
        """Text not yet handed out; while running, minus what might begin a stop string."""
        end = len(self.output_text) if finished else max(len(self.output_text) - self._holdback, 0)
        if end <= self._num_sent_chars:
            return ""
        text = self.output_text[self._num_sent_chars:end]
        self._num_sent_chars = end
        return text
