"""Rendering engine outputs as OpenAI response bodies: pure functions and accumulators,
no I/O (server/streams.py streams them; tests/test_responses.py checks them alone).

`tokens` (server/token_shown.py) is how a token is shown: its text and raw bytes;
logprobs below the floor are clamped, since JSON cannot carry -inf (vLLM reports the
same floor).
"""

from __future__ import annotations

import codecs

from engine.outputs import RequestOutput, TokenLogprob
from server.reasoning import ReasoningSplitter
from server.token_shown import TokenShown
from server.tool_calls import ToolCallParser

MIN_LOGPROB = -9999.0


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens`: prompt tokens whose K/V came from the prefix cache."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def finish_reason(reason: str | None, called_tools: bool = False) -> str | None:
    """OpenAI has no "abort": a whole answer cut short says "stop" (a stream gives a choice
    the server aborted no finish reason: server/streams.py); one that ended on its own
    after calling tools (but not one `tool_choice` named) says "tool_calls"."""
    if reason == "stop" and called_tools:
        return "tool_calls"
    return "stop" if reason == "abort" else reason


def assistant_message(text: str, parser: ToolCallParser | None,
                      splitter: ReasoningSplitter | None = None) -> tuple[dict, bool]:
    """A whole choice's `message`, and whether it ends as "tool_calls"; with a parser (tools
    were offered), its tool calls split from its text; with a splitter, its reasoning."""
    reasoning = None
    if splitter is not None:
        reasoning, text = splitter.split(text, final=True)
        reasoning = reasoning if splitter.began else None  # an answer that began with reasoning has it, if empty
    if parser is None:
        message = {"role": "assistant", "content": text if text or reasoning is None else None}
        return _with_reasoning(message, splitter, reasoning), False
    content, _ = parser.feed(text)
    rest, _ = parser.finish()
    content += rest
    empty = parser.calls or parser.forced or reasoning is not None
    message = {"role": "assistant", "content": content if content or not empty else None}
    if parser.calls:
        message["tool_calls"] = [call.as_openai() for call in parser.calls]
    return _with_reasoning(message, splitter, reasoning), parser.ends_as_tool_calls


def _with_reasoning(message: dict, splitter: ReasoningSplitter | None, reasoning: str | None) -> dict:
    """`message` with its reasoning as vLLM names it, and under its earlier name (DeepSeek's)."""
    if splitter is not None:
        message["reasoning"] = message["reasoning_content"] = reasoning
    return message


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


def chat_logprobs(tokens: TokenShown, logprobs: list[TokenLogprob]) -> list[dict]:
    """`choices[i].logprobs.content` of a chat completion."""
    def entry(token_id, value):
        return {"token": tokens.text(token_id), "logprob": clamp_logprob(value),
                "bytes": list(tokens.raw_bytes(token_id))}

    return [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
            for lp in logprobs]


class TextOffsets:
    """A choice's `text_offset`s: each token's counts the characters the tokens before it
    completed, so a token holding part of a UTF-8 character (shown as U+FFFD) adds none
    until the one that completes it. A stream keeps one per choice across its chunks,
    whose tokens may split a character between them."""

    def __init__(self, start: int = 0):
        self.offset = start
        self._characters = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of the token whose bytes are `raw`; moves past what they complete."""
        at = self.offset
        self.offset += len(self._characters.decode(raw))
        return at


def completion_logprobs(tokens: TokenShown, logprobs: list[TokenLogprob | None], token_ids: list[int],
                        offsets: TextOffsets) -> dict:
    """`choices[i].logprobs` of a text completion; `offsets` carries on from the choice's
    tokens before these."""
    texts, values, tops, text_offsets = [], [], [], []
    for token_id, lp in zip(token_ids, logprobs):
        text = tokens.name(token_id)
        texts.append(text)
        text_offsets.append(offsets.advance(tokens.raw_bytes(token_id)))
        if lp is None:
            values.append(None)
            tops.append(None)
        else:
            values.append(clamp_logprob(lp.logprob))
            top: dict[str, float] = {}
            for t, v in [*lp.top, (token_id, lp.logprob)]:  # best first: two tokens of one name keep the better
                top.setdefault(tokens.name(t), clamp_logprob(v))
            tops.append(top)
    return {"tokens": texts, "token_logprobs": values, "top_logprobs": tops, "text_offset": text_offsets}


class Choices:
    """Accumulates the incremental outputs of `count` choices (text, tokens, logprobs,
    finish reasons); choice k of prompt p is `p * n + index`."""

    def __init__(self, count: int, n: int):
        self.n = n
        self.texts = [""] * count
        self.token_ids: list[list[int]] = [[] for _ in range(count)]
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
        self.reasons: list[str | None] = [None] * count
        self.stop_reasons: list = [None] * count
        # prompt index -> its prompt logprobs (position 0 is None)
        self.prompt_logprobs: dict[int, list] = {}
        # prompt index -> its prompt tokens read from the prefix cache
        self.cached_tokens: dict[int, int] = {}

    def add(self, output: RequestOutput, prompt_index: int = 0) -> None:
        if output.prompt_logprobs is not None:
            self.prompt_logprobs[prompt_index] = output.prompt_logprobs
        self.cached_tokens[prompt_index] = output.metrics.num_cached_tokens
        for c in output.outputs:
            k = prompt_index * self.n + c.index
            self.texts[k] += c.text
            self.token_ids[k].extend(c.token_ids)
            if c.logprobs:
                self.logprobs[k].extend(c.logprobs)
            if c.finish_reason:
                self.reasons[k], self.stop_reasons[k] = c.finish_reason, c.stop_reason

    @property
    def completion_tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)

    @property
    def num_cached_tokens(self) -> int:
        return sum(self.cached_tokens.values())


def chat_completion(request_id: str, model: str, created: int, choices: Choices, num_prompt_tokens: int,
                    tokens: TokenShown, with_logprobs: bool, parsers: list[ToolCallParser] | None = None,
                    splitters: list[ReasoningSplitter] | None = None) -> dict:
    """A whole `chat.completion` body; `parsers`: one per choice when tools were offered;
    `splitters`: one per choice with a reasoning parser."""
    rendered = []
    for i, text in enumerate(choices.texts):
        message, called_tools = assistant_message(text, parsers[i] if parsers else None,
                                                  splitters[i] if splitters else None)
        rendered.append({
            "index": i,
            "message": message,
            "logprobs": {"content": chat_logprobs(tokens, choices.logprobs[i])} if with_logprobs else None,
            "finish_reason": finish_reason(choices.reasons[i], called_tools),
            "stop_reason": choices.stop_reasons[i],
        })
    return {"id": request_id, "object": "chat.completion", "created": created, "model": model,
            "choices": rendered,
            "usage": usage(num_prompt_tokens, choices.completion_tokens, choices.num_cached_tokens)}


def text_completion(request_id: str, model: str, created: int, choices: Choices,
                    prompts: list[tuple[list[int], str]], tokens: TokenShown, echo: bool,
                    with_logprobs: bool) -> dict:
    """A whole `text_completion` body (`echo`: each choice starts with its prompt)."""
    n = choices.n
    rendered = []
    for k in range(len(choices.texts)):
        prompt_ids, prompt_text = prompts[k // n]
        text, lp = choices.texts[k], None
        if echo:
            text = prompt_text + text
        if with_logprobs:
            ids, values = choices.token_ids[k], choices.logprobs[k]
            if echo:
                ids = prompt_ids + ids
                values = list(choices.prompt_logprobs.get(k // n) or [None] * len(prompt_ids)) + values
            lp = completion_logprobs(tokens, values, ids, TextOffsets())
        rendered.append({"index": k, "text": text, "logprobs": lp, "finish_reason": finish_reason(choices.reasons[k]),
                         "stop_reason": choices.stop_reasons[k]})
    prompt_tokens = sum(len(ids) for ids, _ in prompts)
    return {"id": request_id, "object": "text_completion", "created": created, "model": model,
            "choices": rendered, "usage": usage(prompt_tokens, choices.completion_tokens, choices.num_cached_tokens)}


def chunk(request_id: str, obj: str, model: str, created: int, choices: list[dict],
          usage_value: dict | None = None, include_usage: bool = False) -> dict:
    """One streamed chunk (`chat.completion.chunk` or `text_completion`); with
    `include_usage` it carries a `usage` field (null unless given)."""
    data = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if include_usage:
        data["usage"] = usage_value
    return data
