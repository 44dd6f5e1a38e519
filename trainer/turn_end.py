"""The token a chat template ends an assistant's turn with.

A label's text trains with the end the served answer had, where it had one; where it had
none (cut by `max_tokens`, or given before it finished), a chat's label ends as the
template ends a turn, and a plain prompt's with the tokenizer's end of sequence. The two
differ for Gemma (`<end_of_turn>` against `<eos>`) and Phi-3 (`<|end|>` against
`<|endoftext|>`): trained with the tokenizer's, a chat model would learn to end its turns
with a token its template never writes. The same end closes an eval set's chat probes.
"""

from __future__ import annotations

USER, ASSISTANT = {"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}


def chat_turn_end(tokenizer) -> int | None:
    """The first special token the template writes in an assistant's turn past where the
    generation prompt ends (its text has none); None where the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) is None:
        return None
    try:
        opened = tokenizer.apply_chat_template([USER], add_generation_prompt=True, tokenize=True,
                                               return_dict=True)["input_ids"]
        whole = tokenizer.apply_chat_template([USER, ASSISTANT], tokenize=True, return_dict=True)["input_ids"]
    except Exception:  # noqa: BLE001 - the template's own errors (jinja2's, ValueError): no end to learn
        return None
    shared = next((i for i, (a, b) in enumerate(zip(opened, whole)) if a != b), min(len(opened), len(whole)))
    # the named special tokens, and those only added as special (Gemma's <end_of_turn>, Phi-3's <|end|>)
    special = set(tokenizer.all_special_ids) | {i for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                                                if token.special}
    return next((token for token in whole[shared:] if token in special), None)


def label_end(served: list[int] | None, prompt_ids: list[int], end_token_ids: frozenset[int],
              turn_end: int | None, eos: int | None) -> list[int]:
    """What a label's text ends with: the served answer's end token where it ended on one
    (Gemma's `<end_of_turn>`, Llama 3's `<|eot_id|>` under a base tokenizer); else the chat
    turn's end for a prompt the template rendered (it holds that token, after the user's
    turn); else the tokenizer's end of sequence: both sides of a pair end alike."""
    if served and served[-1] in end_token_ids:
        return [served[-1]]
    if turn_end is not None and turn_end in prompt_ids:
        return [turn_end]
    return [eos] if eos is not None else []
