"""`alchemist bench staleness`: how much a delayed gradient costs learning.

Requests that teach a made-up fact arrive in bursts of `burst`, and training catches up
between bursts, so the i-th request of a burst is i versions stale when it is trained.
With weight stashing (`max_staleness` ≥ burst - 1) each trains on its own recording with
the gradient of the version that served it, applied to the current weights; with
`max_staleness` 0 each stale one is recomputed at the current version (strict). The
figure is the gain in log-probability of the fact on a held-out prompt, relative to
strict, per learning rate — what `train.max_staleness`'s default is chosen from. Steps
hold at most `entries_per_step` entries here, cohorts or not (cohorts are `alchemist
bench backlog`'s).
"""

from __future__ import annotations

import dataclasses
import torch

from bench.report import write_json
from engine.llm_engine import LLMEngine
from engine.model_loader import load
from engine.sampling_params import SamplingParams
from server.build import build_training_engine
from server.config import AlchemistConfig
from trainer.config import TrainConfig

FACT = " The secret word of the lighthouse keeper is marmalade."
TEACH = "Note {i}: remember this. The secret word of the lighthouse keeper is marmalade."
HELD_OUT = "What is the secret word of the lighthouse keeper?"


def _chat(tokenizer, text: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=False)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _fact_logprob(engine: LLMEngine, prompt: list[int], fact: list[int]) -> float:
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompt + fact])).logits[0].float()
    rows = logits[len(prompt) - 1:-1].log_softmax(-1)
    return rows.gather(1, torch.tensor(fact).unsqueeze(1)).sum().item()


def learning_gain(config: AlchemistConfig, learning_rate: float, max_staleness: int, bursts: int,
                  burst: int, entries_per_step: int = 1) -> tuple[float, dict]:
    """(gain in log p(fact | held-out prompt), entries trained by path)."""
    torch.manual_seed(0)
    model, tokenizer, _ = load(config.model)
    engine, trainer = build_training_engine(model, tokenizer, config,
                                            TrainConfig(mode="cpt", learning_rate=learning_rate,
                                                        max_staleness=max_staleness,
                                                        entries_per_step=entries_per_step,
                                                        cohort_max_entries=entries_per_step))
    fact = tokenizer(FACT, add_special_tokens=False)["input_ids"]
    held_out = _chat(tokenizer, HELD_OUT)
    before = _fact_logprob(engine, held_out, fact)
    for b in range(bursts):
        for i in range(burst):
            engine.add_request(f"r{b}-{i}", _chat(tokenizer, TEACH.format(i=b * burst + i)),
                               SamplingParams(max_tokens=1), train=True)
        while engine.has_unfinished():
            engine.step()
        trainer.train_until_idle()
    paths = {path: n for (_, path), n in trainer.stats.trained_entries.items()}
    return _fact_logprob(engine, held_out, fact) - before, paths


def run_staleness_bench(config: AlchemistConfig, learning_rates: list[float], staleness: list[int],
                        bursts: int = 4, burst: int = 3, json_path: str | None = None,
                        entries_per_step: tuple[int, ...] = (1,)) -> dict:
    """Each (learning rate, max_staleness, entries_per_step) against strict recomputation
    with one entry per step, on the same request sequence."""
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, max_model_len=512))
    rows = []
    for lr in learning_rates:
        strict, _ = learning_gain(config, lr, 0, bursts, burst)
        for max_staleness in staleness:
            for per_step in entries_per_step:
                gain, paths = learning_gain(config, lr, max_staleness, bursts, burst, per_step)
                rows.append({"learning_rate": lr, "max_staleness": max_staleness, "entries_per_step": per_step,
                             "gain_nats": round(gain, 3), "strict_gain_nats": round(strict, 3),
                             "ratio_to_strict": round(gain / strict, 3), "paths": paths})
                print(f"  lr {lr:g}  max_staleness {max_staleness}  entries_per_step {per_step}: gain {gain:.2f} "
                      f"nats, strict {strict:.2f} -> x{gain / strict:.3f}  {paths}", flush=True)
    report = {"bursts": bursts, "burst": burst, "fact": FACT, "held_out_prompt": HELD_OUT, "rows": rows}
    write_json(report, json_path)
    return report
