"""Structured outputs: grammar-constrained decoding with llguidance.

A request's grammar (llguidance's format: JSON schemas, regexes, Lark grammars) is checked
once when the request is made (`InvalidParameter` naming `response_format` if it does not
compile) and gives each of its sequences a matcher. Before a token is drawn, the matcher's
mask of allowed next tokens sets every other logit to −inf; after, the drawn token advances
the matcher. The mask applies to the sampling distribution only: the log-probs reported
and recorded for training are the model's own (engine/sampler.py). llguidance was chosen
by measured per-token cost on this CPU (BENCHMARKS.md, "Structured outputs").
"""

from __future__ import annotations

import json

import torch

from engine.sampling_params import InvalidParameter


def json_schema_grammar(schema: dict) -> str:
    """An llguidance grammar for JSON documents that validate against `schema`, with
    JSON's usual single spaces and no free whitespace (a model left to pad with newlines
    can run out of tokens before the document closes)."""
    import llguidance

    return llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults={"whitespace_flexible": False})


class GrammarCompiler:
    """The tokenizer in llguidance's form, and matchers made from it."""

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance.hf

        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)

    def check(self, grammar: str) -> None:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise InvalidParameter("response_format", f"the response format cannot be enforced: {error}")

    def matcher(self, grammar: str):
        import llguidance

        matcher = llguidance.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise InvalidParameter("response_format", f"the response format cannot be enforced: "
                                   f"{matcher.get_error()}")
        return matcher


def mask_disallowed(matcher, row: torch.Tensor) -> None:
    """Sets the logits of tokens `matcher` does not allow next to −inf, in place. row: (V,)."""
    import llguidance.torch as llt

    bitmask = llt.allocate_token_bitmask(1, row.shape[-1])
    llt.fill_next_token_bitmask(matcher, bitmask, 0)
    llt.apply_token_bitmask_inplace(row.unsqueeze(0), bitmask.to(row.device))
