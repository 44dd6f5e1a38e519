"""Response rendering alone (server/responses.py): no server, no model."""

from engine.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from server.responses import (MIN_LOGPROB, Choices, TextOffsets, chat_completion, chat_logprobs,
                              completion_logprobs, finish_reason, text_completion, usage)
from server.token_shown import TokenShown

class _Tokenizer:
    """Three tokens, and two that hold a character's bytes (byte-level BPE's pieces: é is C3 A9)."""
    pieces = {1: "Hel", 2: "lo", 3: "!", 4: "Ã", 5: "©"}

    def decode(self, ids):
        return "".join("\ufffd" if i in (4, 5) else self.pieces[i] for i in ids)

    def convert_ids_to_tokens(self, token_id):
        return self.pieces[token_id]


TEXT = TokenShown(_Tokenizer())


def output(index: int, text: str, ids: list[int], reason=None, logprobs=None, prompt_logprobs=None):
    return RequestOutput("r", [CompletionOutput(index, text, ids, logprobs, reason)], reason is not None,
                         RequestMetrics(0.0, None, None, 2, len(ids)), prompt_logprobs)


def test_usage_and_finish_reasons():
    assert usage(3, 4, 2) == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7,
                              "prompt_tokens_details": {"cached_tokens": 2}}
    assert finish_reason("abort") == "stop" and finish_reason("length") == "length" and finish_reason(None) is None


def test_logprobs_are_clamped_and_carry_bytes():
    rendered = chat_logprobs(TEXT, [TokenLogprob(1, float("-inf"), [(2, -0.5)])])
    assert rendered == [{"token": "Hel", "logprob": MIN_LOGPROB, "bytes": [72, 101, 108],
                         "top_logprobs": [{"token": "lo", "logprob": -0.5, "bytes": [108, 111]}]}]
    partial = chat_logprobs(TEXT, [TokenLogprob(4, -1.0, [])])  # OpenAI's bytes: the token's own, not U+FFFD's
    assert partial == [{"token": "\ufffd", "logprob": -1.0, "bytes": [0xC3], "top_logprobs": []}]
    legacy = completion_logprobs(TEXT, [None, TokenLogprob(2, -1.0, [(3, -2.0)])], [1, 2], TextOffsets(5))
    assert legacy == {"tokens": ["Hel", "lo"], "token_logprobs": [None, -1.0],
                      "top_logprobs": [None, {"!": -2.0, "lo": -1.0}], "text_offset": [5, 8]}


def test_a_text_offset_counts_the_characters_the_tokens_before_it_completed():
    """OpenAI's text_offset indexes the text: the two halves of é (each named by its byte)
    start where é does, and the token after them one character later."""
    rendered = completion_logprobs(TEXT, [None] * 4, [1, 4, 5, 3], TextOffsets())
    assert rendered["tokens"] == ["Hel", "bytes:\\xc3", "bytes:\\xa9", "!"] and rendered["text_offset"] == [0, 3, 3, 4]
    assert "Helé!"[rendered["text_offset"][3]:] == "!"


def test_tokens_that_hold_part_of_a_character_keep_names_and_values_of_their_own():
    """An outside pass: both halves of é were named U+FFFD, so in `top_logprobs` one key
    held whichever came last — the chosen token's value overwritten by a worse one's, so a
    client's "was it the greedy token?" (lm-evaluation-harness's) read the wrong value."""
    rendered = completion_logprobs(TEXT, [TokenLogprob(4, -0.1, [(4, -0.1), (5, -2.0), (1, -3.0)])], [4],
                                   TextOffsets())
    assert rendered["tokens"] == ["bytes:\\xc3"]
    assert rendered["top_logprobs"] == [{"bytes:\\xc3": -0.1, "bytes:\\xa9": -2.0, "Hel": -3.0}]
    top = rendered["top_logprobs"][0]
    assert max(top, key=top.get) == rendered["tokens"][0]


def test_a_character_split_between_stream_chunks_is_counted_once():
    """A stream renders each chunk's tokens apart: é's first byte ends one chunk and its
    second opens the next, and the choice's offsets carry on as if they were one call."""
    offsets = TextOffsets()
    first = completion_logprobs(TEXT, [None] * 2, [1, 4], offsets)
    second = completion_logprobs(TEXT, [None] * 2, [5, 3], offsets)
    assert first["text_offset"] + second["text_offset"] == [0, 3, 3, 4]


def test_chat_completion_accumulates_deltas_per_choice():
    choices = Choices(2, 2)
    choices.add(output(0, "Hel", [1]))
    choices.add(output(1, "!", [3], reason="stop"))
    choices.add(output(0, "lo", [2], reason="length"))
    body = chat_completion("chatcmpl-1", "m", 7, choices, 2, TEXT, with_logprobs=False)
    assert [c["message"]["content"] for c in body["choices"]] == ["Hello", "!"]
    assert [c["finish_reason"] for c in body["choices"]] == ["length", "stop"]
    assert body["usage"] == usage(2, 3) and body["object"] == "chat.completion" and body["created"] == 7


def test_text_completion_echoes_the_prompt_with_its_logprobs():
    choices = Choices(1, 1)
    prompt_lps = [None, TokenLogprob(2, -0.25)]
    choices.add(output(0, "!", [3], reason="stop", logprobs=[TokenLogprob(3, -1.5)], prompt_logprobs=prompt_lps))
    body = text_completion("cmpl-1", "m", 7, choices, [([1, 2], "Hello")], TEXT, echo=True, with_logprobs=True)
    choice = body["choices"][0]
    assert choice["text"] == "Hello!"
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -1.5]
    assert choice["logprobs"]["text_offset"] == [0, 3, 5]
