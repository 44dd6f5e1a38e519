"""Incremental detokenization equals a full decode, including characters split across tokens."""

from engine.detokenizer import IncrementalDetokenizer
from tests.tiny import tiny_tokenizer


def test_incremental_text_equals_full_decode_for_multibyte_text():
    tok = tiny_tokenizer()
    prompt = tok("Hello")["input_ids"]
    text = "é è 日本語 emoji 🙂 done"
    ids = tok(text)["input_ids"]
    detok = IncrementalDetokenizer(tok, prompt, [], False, True)
    pieces = []
    for token in ids:
        detok.append(token)
        pieces.append(detok.take_new_text(False))
    pieces.append(detok.take_new_text(True))
    assert "".join(pieces) == tok.decode(ids)
    assert all("\ufffd" not in p for p in pieces)


def test_text_that_could_start_a_stop_string_is_held_back():
    tok = tiny_tokenizer()
    detok = IncrementalDetokenizer(tok, [], ["fox jumps"], False, True)
    streamed = ""
    for token in tok("The quick brown fox jumps over")["input_ids"]:
        stop = detok.append(token)
        streamed += detok.take_new_text(stop is not None)
        if stop:
            break
    assert streamed == "The quick brown "
