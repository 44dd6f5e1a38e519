"""The custom-method example: a subclassed entry and loss train through both paths."""

import importlib.util
import sys
from pathlib import Path

from trainer.config import TrainConfig
from engine.model_runner import run_to_end
from engine.sampling_params import SamplingParams
from tests.test_training import PROMPT, relative_difference
from tests.conftest import engine_of, make_training
from tests.tiny import tiny_tokenizer
from trainer.adapter import lora_gradients
from trainer.entries import EntryState

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "custom_method.py"


def load_example():
    spec = importlib.util.spec_from_file_location("custom_method", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules["custom_method"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_user_turn_mask_marks_only_the_users_words():
    example = load_example()
    tok = tiny_tokenizer()
    text = tok.apply_chat_template([{"role": "system", "content": "Be brief."},
                                    {"role": "user", "content": "Hello there"}], add_generation_prompt=True,
                                   tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    mask = example.user_turn_mask(tok, ids)
    assert tok.decode([t for t, m in zip(ids, mask) if m]) == "Hello there"


def test_custom_method_trains_with_equal_gradients_on_both_paths():
    example = load_example()
    tok = tiny_tokenizer()
    trainer = make_training(TrainConfig(mode="cpt", lora_rank=4), method=example.UserTurnCPT(tok),
                            init_lora_weights=False)
    engine = engine_of(trainer)
    chat = tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False)
    ids = tok(chat, add_special_tokens=False)["input_ids"]
    engine.add_request("a", ids, SamplingParams(max_tokens=3), train=True)
    while engine.has_unfinished():
        engine.step()
    entry = trainer.cache.get("a")
    assert isinstance(entry, example.UserTurnEntry) and 0 < sum(entry.user_mask) < len(ids)
    trainer.optimizer.zero_grad()
    run_to_end(trainer.method.reuse_job(entry, trainer.context))
    reuse = lora_gradients(trainer.peft_model)
    trainer.optimizer.zero_grad()
    run_to_end(trainer.method.recompute_job(entry, trainer.context))
    recompute = lora_gradients(trainer.peft_model)
    trainer.optimizer.zero_grad()
    assert relative_difference(reuse, recompute) <= 1e-4
    trainer.cache.end(entry, EntryState.TRAINED)  # its graph was used above
    engine.add_request("b", ids, SamplingParams(max_tokens=3), train=True)
    while engine.has_unfinished():
        engine.step()
    trainer.train_until_idle()
    assert trainer.optimizer.version == 1 and trainer.stats.failed_jobs == 0
