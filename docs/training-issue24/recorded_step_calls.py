"""Python calls of a prefill step on the embedded model (the CPU's merged path, DPO mode),
counted by cProfile (the same on every machine): a 100-token prompt prefilled plain and
recorded, alone and with three decoding requests riding along in its step. A recorded
step's extra calls are host time that a GPU waits for, and that this CPU spends besides
the compute. Run from the repository root (and in a worktree of an older tree, with that
tree first on PYTHONPATH, to compare):

    PYTHONPATH=. .venv/bin/python docs/training-issue24/recorded_step_calls.py
"""

import cProfile
import pstats

from bench.recording import embedded_training_engine
from bench.traces import synthetic_tokens
from engine.sampling_params import SamplingParams
from server.config import AlchemistConfig
from trainer.feedback import FeedbackLabel

DECODES = 3


def prefill_calls(engine, trainer, tokenizer, request_id: str, recorded: bool, riders: int, seed: int) -> int:
    """The Python calls of the step that prefills a 100-token prompt beside `riders` decodes."""
    prompt = synthetic_tokens(tokenizer, 100, seed)
    for d in range(riders):  # prefilled first, so that they decode when the prompt arrives
        engine.add_request(f"{request_id}-decode{d}", prompt[: 50 + d],
                           SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
        engine.step()
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=2, temperature=0.0), train=recorded)
    profile = cProfile.Profile()
    profile.enable()
    engine.step()
    profile.disable()
    for d in range(riders):
        engine.abort_request(f"{request_id}-decode{d}")
    while engine.has_unfinished():
        engine.step()
    if recorded:
        trainer.feedback.submit(FeedbackLabel(request_id, "A short and friendly answer.", None, 0))
    trainer.train_until_idle()
    return sum(stat[1] for stat in pstats.Stats(profile).stats.values())


def main() -> None:
    engine, trainer, tokenizer = embedded_training_engine(AlchemistConfig())
    counts = {}
    for riders in (0, DECODES):
        for recorded in (False, True):
            for warm in range(2):  # the shapes, the saved-bytes memo, the merged copies after training
                prefill_calls(engine, trainer, tokenizer, f"warm-{riders}-{recorded}-{warm}", recorded, riders, warm)
            counts[riders, recorded] = prefill_calls(engine, trainer, tokenizer, f"r-{riders}-{recorded}", recorded,
                                                     riders, 7)
    for riders in (0, DECODES):
        plain, recorded = counts[riders, False], counts[riders, True]
        print(f"{riders} riders: plain {plain:,}, recorded {recorded:,} Python calls per step "
              f"(recorded / plain {recorded / plain:.2f}x)")


if __name__ == "__main__":
    main()
