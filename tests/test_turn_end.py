"""What a label's text ends with where the served answer gave no end (trainer/turn_end.py):
a chat's the template's end of turn — Gemma's `<end_of_turn>`, not its tokenizer's `<eos>` —
and a plain prompt's the end of sequence; an eval set's chat probes end alike."""

import copy
import json

import pytest
from tokenizers import AddedToken

from tests.tiny import tiny_tokenizer
from trainer.eval_set import load_eval_set
from trainer.turn_end import chat_turn_end, label_end

GEMMA_LIKE = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
              "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
              "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


@pytest.fixture(scope="module")
def gemma_like():
    """The tiny tokenizer with a chat turn that ends on a special token of its own, not on its eos."""
    tokenizer = copy.deepcopy(tiny_tokenizer())
    # added as special, not named (not in `additional_special_tokens`), as Gemma 3's tokenizer has them
    tokenizer.add_tokens([AddedToken("<start_of_turn>", special=True), AddedToken("<end_of_turn>", special=True)])
    tokenizer.chat_template = GEMMA_LIKE
    return tokenizer


def test_the_turn_end_is_the_templates_not_the_tokenizers_eos(gemma_like):
    turn_end = chat_turn_end(gemma_like)
    assert gemma_like.convert_ids_to_tokens(turn_end) == "<end_of_turn>" != gemma_like.eos_token
    assert chat_turn_end(tiny_tokenizer()) == tiny_tokenizer().eos_token_id  # ChatML: the two are one
    no_template = copy.deepcopy(tiny_tokenizer())
    no_template.chat_template = None
    assert chat_turn_end(no_template) is None


def test_a_label_ends_as_the_answer_did_else_as_its_prompt_says(gemma_like):
    turn_end, eos = chat_turn_end(gemma_like), gemma_like.eos_token_id
    chat = gemma_like.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True,
                                          tokenize=True, return_dict=True)["input_ids"]
    plain = gemma_like("Once upon a time")["input_ids"]
    ends = frozenset({eos, turn_end})
    assert label_end([5, 6, turn_end], plain, ends, turn_end, eos) == [turn_end]  # the served answer's own end
    assert label_end([5, 6, 7], chat, ends, turn_end, eos) == [turn_end]  # cut by max_tokens: a chat turn's
    assert label_end(None, chat, ends, turn_end, eos) == [turn_end]  # not finished
    assert label_end(None, plain, ends, turn_end, eos) == [eos]  # a text completion's
    assert label_end(None, plain, ends, None, None) == []


def test_an_eval_sets_chat_probe_ends_with_the_turn_end(gemma_like, tmp_path):
    path = tmp_path / "probes.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "Hi"}], "chosen": "Hello",
                                "rejected": "Go"}) + "\n" + json.dumps({"prompt": "Once", "chosen": " upon",
                                                                          "rejected": " more"}) + "\n")
    chat, text = load_eval_set(path, gemma_like, 256)
    assert all(r[-1] == chat_turn_end(gemma_like) for r in chat.responses)
    assert all(r[-1] != chat_turn_end(gemma_like) for r in text.responses)
