"""The head segment (final norm and LM head over the vocabulary) runs in row chunks, one
slice each: the gradients equal those of the head in one piece, for CPT and DPO on both
paths, and a job has one head slice per chunk."""

import pytest

from tests.test_training import gradients_of, label, make_trainer, relative_difference, serve

LONG_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 4) + " What is the capital of France?"


def job_gradients(mode: str, path: str, head_chunk_rows: int):
    trainer = make_trainer(mode=mode, head_chunk_rows=head_chunk_rows)
    serve(trainer, "r", prompt=LONG_PROMPT, max_tokens=8)
    entry = trainer.cache.get("r")
    if mode == "dpo":
        label(trainer, "r", chosen="Paris, of course. It is a lovely city on the Seine.")
    job = getattr(trainer.method, f"{path}_job")(entry, trainer.context)
    return gradients_of(trainer, job), len(entry.prompt_token_ids)


@pytest.mark.parametrize("path", ["reuse", "recompute"])
@pytest.mark.parametrize("mode", ["cpt", "dpo"])
def test_chunked_head_gives_the_gradients_of_the_whole_head(mode, path):
    whole, prompt_len = job_gradients(mode, path, 100_000)
    chunked, _ = job_gradients(mode, path, 3)
    assert prompt_len > 3 * 4  # many chunks
    assert relative_difference(chunked, whole) <= 1e-5


def count_slices(job) -> int:
    slices = 0
    while True:
        try:
            next(job)
        except StopIteration:
            return slices
        slices += 1


def test_a_cpt_job_has_one_head_slice_per_chunk():
    counts = {}
    for rows in (4, 100_000):
        trainer = make_trainer(head_chunk_rows=rows)
        serve(trainer, "r", prompt=LONG_PROMPT)
        entry = trainer.cache.get("r")
        counts[rows] = count_slices(trainer.method.reuse_job(entry, trainer.context))
        targets = len(entry.prompt_token_ids) - 1
    assert counts[4] - counts[100_000] == -(-targets // 4) - 1
