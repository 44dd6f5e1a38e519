"""Per-token cost of grammar-constrained decoding on this CPU: xgrammar, llguidance and
outlines-core, on the embedded model's tokenizer (SmolLM2, 49,152 tokens).

For a JSON schema, each library compiles a matcher; then the tokens of a valid document
are walked one by one: at each step the library computes the mask of allowed next tokens
(and it is applied to a logits row), the document's token is checked against it and
accepted. Reported per library: compile time, and the mean and p99 time per token of
mask + apply + accept — what constrained decoding adds to each decode step of one
sequence. (Issue 14, item 2: pick a maintained library with numbers.)

    PYTHONPATH=/tmp/glibs .venv/bin/python docs/structured-outputs/compare_grammar_libraries.py
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from engine.model_loader import load
from server.config import AlchemistConfig

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "tags": {"type": "array", "items": {"type": "string"}},
    "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                "required": ["city", "zip"]}},
    "required": ["name", "age", "email", "tags", "address"], "additionalProperties": False}
DOCUMENT = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                       "tags": ["mathematician", "writer", "analyst"],
                       "address": {"city": "London", "zip": "W1 1AA"}})


def walk(tokens, vocab_size, fill, accept, apply) -> list[float]:
    logits = torch.randn(1, vocab_size)
    times = []
    for token in tokens:
        started = time.perf_counter()
        mask = fill()
        row = logits.clone()
        apply(row, mask)
        allowed = bool(torch.isfinite(row[0, token]))
        accept(token)
        times.append(time.perf_counter() - started)
        assert allowed, f"token {token} refused"
    return times


def with_xgrammar(tokenizer, vocab_size, tokens):
    import xgrammar as xgr
    started = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - started
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def fill():
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask

    return compile_s, walk(tokens, vocab_size, fill, matcher.accept_token,
                           lambda row, mask: xgr.apply_token_bitmask_inplace(row, mask))


def with_llguidance(tokenizer, vocab_size, tokens):
    import llguidance
    import llguidance.hf
    import llguidance.torch as llt
    started = time.perf_counter()
    llg_tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    matcher = llguidance.LLMatcher(llg_tokenizer, grammar)
    compile_s = time.perf_counter() - started
    bitmask = llt.allocate_token_bitmask(1, vocab_size)

    def fill():
        llt.fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask

    return compile_s, walk(tokens, vocab_size, fill, matcher.consume_token,
                           lambda row, mask: llt.apply_token_bitmask_inplace(row, mask))


def with_outlines_core(tokenizer, vocab_size, tokens):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    started = time.perf_counter()
    byte_decoder = {v: k for k, v in _bytes_to_unicode().items()}
    vocabulary: dict[bytes, list[int]] = {}
    eos = tokenizer.eos_token_id
    for token, token_id in tokenizer.get_vocab().items():
        if token_id == eos or token in tokenizer.all_special_tokens:
            continue
        try:
            vocabulary.setdefault(bytes(byte_decoder[c] for c in token), []).append(token_id)
        except KeyError:
            continue
    index = Index(build_regex_from_schema(json.dumps(SCHEMA)), Vocabulary(eos, vocabulary))
    guide = Guide(index)
    compile_s = time.perf_counter() - started

    def fill():
        allowed = torch.tensor(guide.get_tokens(), dtype=torch.long)
        mask = torch.full((vocab_size,), float("-inf"))
        mask[allowed] = 0.0
        return mask

    return compile_s, walk(tokens, vocab_size, fill, guide.advance, lambda row, mask: row.add_(mask))


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level BPE alphabet (bytes -> printable characters)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


def main() -> None:
    torch.set_num_threads(1)
    model, tokenizer, name = load(AlchemistConfig().model)
    vocab_size = model.config.vocab_size
    tokens = tokenizer(DOCUMENT, add_special_tokens=False)["input_ids"]
    results = {"model": name, "vocab_size": vocab_size, "document_tokens": len(tokens), "libraries": {}}
    for library, run in (("xgrammar", with_xgrammar), ("llguidance", with_llguidance),
                         ("outlines-core", with_outlines_core)):
        try:
            run(tokenizer, vocab_size, tokens)  # warm-up (caches, lazy imports)
            compile_s, times = run(tokenizer, vocab_size, tokens)
        except Exception as exc:  # noqa: BLE001 - a library that fails is a result too
            results["libraries"][library] = {"error": repr(exc)[:300]}
            print(library, "failed:", repr(exc)[:300], flush=True)
            continue
        times_us = sorted(t * 1e6 for t in times)
        row = {"compile_ms": round(compile_s * 1e3, 1), "mean_us_per_token": round(statistics.mean(times_us), 1),
               "median_us_per_token": round(statistics.median(times_us), 1),
               "p99_us_per_token": round(times_us[int(0.99 * (len(times_us) - 1))], 1)}
        results["libraries"][library] = row
        print(library, row, flush=True)
    print(json.dumps(results, indent=2))
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
