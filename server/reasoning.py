"""A thinking model's reasoning apart from its answer: `--reasoning-parser` (vLLM's flag).

Qwen3 and DeepSeek-R1 (and the models distilled from it) write their reasoning between
`<think>` and `</think>`, then the answer. With a parser named, a chat completion's message
carries the reasoning as `reasoning` (vLLM's field; `reasoning_content`, its earlier name
and DeepSeek's, beside it) and the answer alone as `content`, whole or streamed as deltas
of either; tool calls are parsed from the answer only. The split follows the text:

- a reasoning begins where the answer's first text is `<think>`, or at once where the
  prompt ends inside one (DeepSeek-R1's template opens it; Qwen3's opens and closes an
  empty one when `enable_thinking` is false, so that its answer is all content);
- it ends at `</think>`; an answer cut short before it (by `max_tokens`) is all reasoning;
- newlines next to the tags are dropped, as Qwen3's template drops them when it splits
  an assistant message it is given back.

Both parsers' names split the same way (vLLM's differ only where a model writes no tags).
Nothing changes in what is generated or trained: the ledger, labels and exports keep the
text as generated, tags included.
"""

from __future__ import annotations

REASONING_PARSERS = ("qwen3", "deepseek_r1")
OPEN, CLOSE = "<think>", "</think>"


def opens_reasoning(prompt_tail: str) -> bool:
    """Whether a prompt ending in `prompt_tail` leaves a `<think>` open for the answer."""
    return prompt_tail.rstrip().endswith(OPEN)


def _held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held until the next text)."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningSplitter:
    """One choice's text, fed as it is decoded, split into (reasoning, content) pieces."""

    def __init__(self, in_reasoning: bool):
        # "start": not yet known whether the answer opens with <think>; "reasoning"; "content"
        self._state = "reasoning" if in_reasoning else "start"
        self._pending = ""  # text held back: a tag's possible beginning, or newlines next to a tag
        self._after_tag = in_reasoning  # newlines right after a tag are dropped
        self.began = in_reasoning  # whether the answer began with reasoning (empty, or cut short, as it may be)

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the content that `text` (and what was held back) completes."""
        text = self._pending + text
        self._pending = ""
        reasoning = content = ""
        while text:
            if self._state == "start":
                stripped = text.lstrip()
                if stripped.startswith(OPEN):
                    text, self._state, self._after_tag, self.began = stripped[len(OPEN):], "reasoning", True, True
                elif OPEN.startswith(stripped):  # whitespace, or a beginning of the tag: wait
                    self._pending = text
                    return reasoning, content
                else:
                    self._state = "content"
            elif self._state == "reasoning":
                if self._after_tag:
                    text = text.lstrip("\n")
                    self._after_tag = not text
                    if not text:
                        break
                end = text.find(CLOSE)
                if end >= 0:
                    reasoning += text[:end].rstrip("\n")
                    text, self._state, self._after_tag = text[end + len(CLOSE):], "content", True
                    continue
                keep = _held_back(text, CLOSE)
                body = text[:len(text) - keep]
                trailing = len(body) - len(body.rstrip("\n"))  # newlines that may precede </think>
                self._pending = body[len(body) - trailing:] + text[len(text) - keep:]
                reasoning += body[:len(body) - trailing]
                break
            else:
                if self._after_tag:
                    text = text.lstrip("\n")
                    self._after_tag = not text
                content += text
                break
        return reasoning, content

    def split(self, text: str, final: bool = False) -> tuple[str, str]:
        """`feed`, and `finish` too where `text` is the choice's last."""
        reasoning, content = self.feed(text)
        if final:
            more, rest = self.finish()
            reasoning, content = reasoning + more, content + rest
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back, once the choice has ended."""
        pending, self._pending = self._pending, ""
        if self._state == "reasoning":
            return pending.rstrip("\n"), ""
        return "", pending  # an answer that began as "<think>" might have, and did not
