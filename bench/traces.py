"""Synthetic workloads the benchmarks share: Poisson request traces, chat prompts, and
token sequences of an exact length cut from a fixed English passage."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

WORDS = ("online learning lets a deployed language model improve from the requests it serves while the "
         "quick brown fox jumps over the lazy dog and the curious cat counts clouds drifting across the "
         "afternoon sky as users ask questions about history science cooking travel and code").split()

PASSAGE = (
    "Online learning lets a deployed language model improve from the requests it serves. Each prompt that "
    "arrives is processed once by the serving engine, and the activations of that pass can be kept and reused "
    "to train a small adapter when the server is idle, instead of running the same computation again in a "
    "separate training cluster. Users may also tell the server which of two answers they prefer, and the model "
    "can learn from that feedback as well. The quick brown fox jumps over the lazy dog while the curious cat "
    "watches from the window, counting the clouds that drift slowly across the afternoon sky. "
)

QUESTIONS = [
    "What is the capital of France?", "Write a haiku about the sea.", "Explain gravity to a child.",
    "List three fruits and their colors.", "How do I boil an egg?", "What is 17 times 23?",
    "Name a famous painter and one of their works.", "Why is the sky blue?", "Give me a tip for learning Python.",
    "What does a compiler do?", "Describe a cat in two sentences.", "What is photosynthesis?",
    "Suggest a name for a bakery.", "How far is the Moon?", "What is the largest ocean?", "Tell me a fun fact.",
]


@dataclass
class TraceRequest:
    # seconds after the trace starts
    arrival_s: float
    prompt: str
    output_tokens: int


def poisson_times(rate: float, horizon: float, rng: random.Random):
    """Arrival times of a Poisson process at `rate` per unit of time, over [0, horizon)."""
    t = rng.expovariate(rate)
    while t < horizon:
        yield t
        t += rng.expovariate(rate)


def lognormal_length(rng: random.Random, median: float, sigma: float, low: int, high: int) -> int:
    return int(min(max(rng.lognormvariate(math.log(median), sigma), low), high))


def make_trace(rate: float, seconds: float, seed: int, at_least_one: bool = False) -> list[TraceRequest]:
    """Poisson arrivals at `rate` per second; log-normal prompt (words) and output lengths.
    `at_least_one`: a trace that draws no arrival is one request at 0 s instead."""
    rng = random.Random(seed)

    def request(t: float) -> TraceRequest:
        prompt_words = lognormal_length(rng, 60, 0.8, 8, 400)
        output = lognormal_length(rng, 48, 0.6, 8, 160)
        return TraceRequest(t, " ".join(rng.choice(WORDS) for _ in range(prompt_words)), output)

    trace = [request(t) for t in poisson_times(rate, seconds, rng)]
    return trace or ([request(0.0)] if at_least_one else [])


def synthetic_tokens(tokenizer, count: int, offset: int) -> list[int]:
    """`count` token ids of the passage, starting at a point that depends on `offset`."""
    ids = tokenizer(PASSAGE * (count // 40 + 4), add_special_tokens=False)["input_ids"]
    start = (offset * 37) % 200
    return ids[start:start + count]


def chat_questions(count: int, offset: int = 0, extra_words: int = 0) -> list[str]:
    """`count` distinct questions, from number `offset` on, each followed by `extra_words`
    words of filler (so that rounds of a benchmark can differ in length, not only in text)."""
    questions = []
    for i in range(offset, offset + count):
        question = QUESTIONS[i % len(QUESTIONS)] + (f" (#{i // len(QUESTIONS)})" if i >= len(QUESTIONS) else "")
        if extra_words:
            question += " " + " ".join(WORDS[(i + w) % len(WORDS)] for w in range(extra_words))
        questions.append(question)
    return questions


def chat_prompts(tokenizer, count: int, offset: int = 0, extra_words: int = 0) -> list[list[int]]:
    """The token ids of `chat_questions`, each a single-turn chat rendered with the model's template."""
    prompts = []
    for question in chat_questions(count, offset, extra_words):
        text = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                             tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return prompts
