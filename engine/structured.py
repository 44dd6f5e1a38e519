"""Structured outputs: grammar-constrained decoding with llguidance.

A request's `Grammar` (llguidance's format, built here from a JSON schema, a regex, a list
of choices or a Lark/GBNF grammar) is checked once when the request is made
(`InvalidParameter` naming the request field it came from, if it does not compile) and
gives each of its sequences a matcher. Before a token is drawn, the matcher's
mask of allowed next tokens sets every other logit to −inf (a batch's masks are filled on
the host and applied on the device: engine/sampler.py); after, the drawn token advances
the matcher. The mask applies to the sampling distribution only: the log-probs reported
and recorded for training are the model's own (engine/sampler.py). llguidance was chosen
by measured per-token cost on this CPU (BENCHMARKS.md, "Structured outputs").
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

from engine.grammar_limits import check_grammar_size, check_schema_depth, first_line
from engine.sampling_params import InvalidParameter

# JSON's usual single spaces (as Python's json.dumps writes it, and as models saw it in
# training) and no free whitespace: a model left to pad with newlines can run out of
# tokens before the document closes
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class Grammar:
    """What a request's output must follow: an llguidance grammar, the request field that
    asked for it (named in the error if it cannot be enforced), and what kind of
    constraint it is (counted in the metrics: json_schema, regex, choice, grammar, ...)."""

    text: str
    param: str = "response_format"
    kind: str = "json_schema"


def _built(param: str, kind: str, build) -> Grammar:
    try:
        return Grammar(build(), param, kind)
    except InvalidParameter:
        raise
    except Exception as exc:  # noqa: BLE001 - the spec is the client's; say what is wrong with it
        raise InvalidParameter(param, f"{param} cannot be enforced: {first_line(exc)}") from None


def json_schema_grammar(schema: dict, param: str = "response_format", kind: str = "json_schema") -> Grammar:
    """JSON documents that validate against `schema`."""
    import llguidance

    check_schema_depth(schema, param)

    return _built(param, kind, lambda: llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema),
                                                                               defaults=JSON_LAYOUT))


def regex_grammar(pattern: str, param: str) -> Grammar:
    """Text that matches `pattern` whole (Rust's regex syntax, close to Python's)."""
    import llguidance

    return _built(param, "regex", lambda: llguidance.LLMatcher.grammar_from_regex(pattern))


def choice_grammar(choices: list[str], param: str) -> Grammar:
    """Exactly one of `choices`."""
    import llguidance

    if not choices:
        raise InvalidParameter(param, f"{param} must list at least one choice")
    return _built(param, "choice", lambda: llguidance.grammar_from("choice", choices))


def lark_grammar(text: str, param: str, kind: str = "grammar") -> Grammar:
    """A context-free grammar in Lark syntax (llguidance's dialect, which can embed
    `%json {schema}`) or in llama.cpp's GBNF; its start rule is `start` (Lark) or `root` (GBNF)."""
    import llguidance

    check_grammar_size(text, param)
    grammar = _built(param, kind, lambda: llguidance.grammar_from("grammar", text))
    if grammar.text != text:  # GBNF's, converted: as compiled
        check_grammar_size(grammar.text, param)
    return grammar


def check_compiles(grammar: Grammar, refusal: str | None = None) -> None:
    """Raises InvalidParameter for a grammar that does not compile (`GrammarCompiler.check`
    without the tokenizer: for a grammar no request decodes under, such as the text format
    beside a forced tool call); `refusal`: how the error begins (its field's name says
    "cannot be enforced" else)."""
    import llguidance

    error = llguidance.LLMatcher.validate_grammar(grammar.text)
    if error:
        raise InvalidParameter(grammar.param, f"{refusal or grammar.param + ' cannot be enforced'}: "
                                              f"{first_line(error)}")


class GrammarCompiler:
    """The tokenizer in llguidance's form, and matchers made from it."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.model_vocab = vocab_size
        self.vocab_size = mask_vocab(tokenizer, vocab_size)
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=self.vocab_size)

    def check(self, grammar: Grammar):
        """A matcher of `grammar` at its start; raises InvalidParameter for a grammar that
        does not compile, or that no text satisfies (its first mask leaves the matcher in error)."""
        matcher = self.matcher(grammar)
        row = token_bitmask(1, self.vocab_size)[0]
        fill_allowed_tokens(matcher, row)
        if matcher.is_error():  # (a rule defined only by itself: answered with empty text and "stop" before)
            raise InvalidParameter(grammar.param, f"{grammar.param} cannot be satisfied: no text matches it")
        if self.vocab_size > self.model_vocab and not np.unpackbits(row.view(np.uint8), bitorder="little")[
                :self.model_vocab].any():  # only a token past the model's vocabulary (Gemma 3's image token)
            raise InvalidParameter(grammar.param, f"{grammar.param} cannot be satisfied: its first token is none "
                                                  "the model can write")
        return matcher

    def matcher(self, grammar: Grammar):
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar.text)
        if matcher.is_error():
            raise InvalidParameter(grammar.param,
                                   f"{grammar.param} cannot be enforced: {first_line(matcher.get_error())}")
        return matcher


def mask_vocab(tokenizer, vocab_size: int) -> int:
    """How many tokens a grammar's mask covers: the model's vocabulary, or the tokenizer's
    where it is larger (llguidance takes no fewer; sampling reads the model's part)."""
    return max(vocab_size, len(tokenizer))


def token_bitmask(rows: int, vocab_size: int) -> np.ndarray:
    """(rows, ⌈V / 32⌉) int32 bits of allowed tokens, all allowed: llguidance's layout."""
    return np.full((rows, (vocab_size + 31) // 32), -1, dtype=np.int32)


def fill_allowed_tokens(matcher, row: np.ndarray) -> None:
    """Writes the tokens `matcher` allows next into one row of a `token_bitmask`."""
    matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """(rows, words) int32 bitmask, on the device -> (rows, V) bool, True where a token is not allowed."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) >> bits) & 1  # (rows, words, 32)
    return allowed.view(bitmask.shape[0], -1)[:, :vocab_size] == 0
