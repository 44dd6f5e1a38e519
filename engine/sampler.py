"""Turns each sequence's next-token logits into a token, per that sequence's parameters.

One batched pass on the device, with one host read per call (the sampled ids, and the
log-probs asked for, read back together). Each sequence's parameters become rows of
per-dtype host arrays copied to the device at once (engine/step_inputs.py): the batch
size changes the arrays' lengths, not the number of copies.

Order of processing (vLLM's): logit bias and the repetition/presence/frequency penalties,
then the bans of `min_tokens` (EOS and stop tokens) and the structured-output mask, then
greedy argmax or temperature -> top-k -> top-p -> min-p -> a draw. A draw is the argmax
of probs / E with E ~ Exp(1) per token (the exponential race, as vLLM draws): a sequence
with a seed draws its E from its own generator, so its tokens do not depend on what else
is in the batch. Logprobs are reported from the model's raw distribution, before any of
this processing; the values a trainable request tracks for its trainer are taken at its
`logprob_temperature` (GRPO's: the sampling temperature, as TRL's trainer takes them).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from engine.outputs import TokenLogprob
from engine.sequence import Sequence
from engine.step_inputs import HostStaging
from engine.structured import disallowed_tokens, fill_allowed_tokens, token_bitmask


@dataclass
class SampledToken:
    token_id: int
    # None unless the sequence asked for logprobs
    logprob: TokenLogprob | None
    # the token's log-prob at the sequence's `logprob_temperature`, for sequences that track it
    logprob_value: float | None = None


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logprobs: (N, V) log-softmax rows; token_ids: (N,) -> a TokenLogprob per row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids.tolist(), chosen, tops)]


def _pairs(rows_and_ids: list[tuple[int, list[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """[(row, token ids)] -> (rows, ids) flat int64 arrays, for an index_put on (N, V)."""
    rows = np.concatenate([np.full(len(ids), row, dtype=np.int64) for row, ids in rows_and_ids])
    ids = np.concatenate([np.asarray(ids, dtype=np.int64) for _, ids in rows_and_ids])
    return rows, ids


def _host_inputs(seqs: list[Sequence], eos_token_ids: set[int], vocab_size: int,
                 mask_vocab: int) -> dict[str, np.ndarray]:
    """The batch's sampling parameters as host arrays, only those some sequence uses."""
    params = [seq.params for seq in seqs]
    arrays: dict[str, np.ndarray] = {}
    if any(not p.greedy for p in params):
        arrays["temperature"] = np.array([p.temperature for p in params], dtype=np.float32)  # 0: greedy
    if any(not p.greedy and (p.top_k != -1 or p.top_p < 1.0 or p.min_p > 0.0) for p in params):
        # a top_k past the vocabulary keeps all of it (and might not fit an int64)
        arrays["top_k"] = np.array([vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params],
                                   dtype=np.int64)
        arrays["top_p"] = np.array([p.top_p for p in params], dtype=np.float32)
        arrays["min_p"] = np.array([p.min_p for p in params], dtype=np.float32)
    biased = [(row, p) for row, p in enumerate(params) if p.logit_bias]
    if biased:
        arrays["bias_rows"], arrays["bias_ids"] = _pairs([(row, list(p.logit_bias)) for row, p in biased])
        arrays["bias_values"] = np.array([v for _, p in biased for v in p.logit_bias.values()], dtype=np.float32)
    repeated = [(row, seq.prompt_token_ids + seq.output_token_ids) for row, seq in enumerate(seqs)
                if seq.params.repetition_penalty != 1.0]
    if repeated:
        arrays["repetition"] = np.array([p.repetition_penalty for p in params], dtype=np.float32)
        arrays["seen_rows"], arrays["seen_ids"] = _pairs(repeated)
    counted = [(row, seq.output_token_ids) for row, seq in enumerate(seqs)
               if seq.output_token_ids and (seq.params.presence_penalty or seq.params.frequency_penalty)]
    if counted:
        arrays["presence"] = np.array([p.presence_penalty for p in params], dtype=np.float32)
        arrays["frequency"] = np.array([p.frequency_penalty for p in params], dtype=np.float32)
        arrays["output_rows"], arrays["output_ids"] = _pairs(counted)
    banned = [(row, sorted(set(seq.params.stop_token_ids) | (set() if seq.params.ignore_eos else eos_token_ids)))
              for row, seq in enumerate(seqs) if len(seq.output_token_ids) < seq.params.min_tokens]
    banned = [(row, ids) for row, ids in banned if ids]
    if banned:
        arrays["ban_rows"], arrays["ban_ids"] = _pairs(banned)
    tracked_at = [(row, seq.logprob_temperature) for row, seq in enumerate(seqs)
                  if seq.track_logprob and seq.logprob_temperature != 1.0]
    if tracked_at:  # only those rows pay the pass over the vocabulary (all of them: no row picked)
        arrays["tracked_temperature"] = np.array([t for _, t in tracked_at], dtype=np.float32)
        if len(tracked_at) < len(seqs):
            arrays["tracked_rows"] = np.array([row for row, _ in tracked_at], dtype=np.int64)
    if any(seq.matcher is not None for seq in seqs):
        bitmask = token_bitmask(len(seqs), mask_vocab)  # (sampling reads its first `vocab_size` bits)
        for row, seq in enumerate(seqs):
            if seq.matcher is not None:  # after the log-probs are taken: they stay the model's own
                fill_allowed_tokens(seq.matcher, bitmask[row])
        arrays["bitmask"] = bitmask
    return arrays


def _processed(logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Logit bias, penalties, bans and the structured-output mask, out of place. (N, V)."""
    if "bias_rows" in inputs:
        logits = logits.index_put((inputs["bias_rows"], inputs["bias_ids"]), inputs["bias_values"], accumulate=True)
    if "seen_rows" in inputs:
        seen = torch.zeros_like(logits, dtype=torch.bool).index_put_(
            (inputs["seen_rows"], inputs["seen_ids"]), torch.ones((), dtype=torch.bool, device=logits.device))
        penalty = inputs["repetition"].unsqueeze(1)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    if "output_rows" in inputs:
        counts = torch.zeros_like(logits).index_put_(
            (inputs["output_rows"], inputs["output_ids"]), torch.ones((), device=logits.device), accumulate=True)
        logits = logits - inputs["frequency"].unsqueeze(1) * counts \
            - inputs["presence"].unsqueeze(1) * (counts > 0).to(logits.dtype)
    if "ban_rows" in inputs:
        logits = logits.index_put((inputs["ban_rows"], inputs["ban_ids"]), logits.new_full((), float("-inf")))
    if "bitmask" in inputs:
        logits = logits.masked_fill(disallowed_tokens(inputs["bitmask"], logits.shape[-1]), float("-inf"))
    return logits


def truncated(logits: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """Top-k, top-p and min-p on temperature-scaled rows (N, V); removed tokens get −inf.
    Top-p reads what top-k left, renormalised, as vLLM and transformers do. Disabled per
    row by top_k = V, top_p = 1, min_p = 0."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(logits.shape[-1], device=logits.device)
    top_p = inputs["top_p"].unsqueeze(1)
    remove = ranks >= inputs["top_k"].unsqueeze(1)
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(-1)
    remove |= ((probs.cumsum(-1) - probs) >= top_p) & (top_p < 1.0)  # keep tokens until top_p is reached
    remove |= probs < inputs["min_p"].unsqueeze(1) * probs[:, :1]
    remove[:, 0] = False
    return torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(remove, float("-inf")))


def _drawn(logits: torch.Tensor, inputs: dict[str, torch.Tensor], seqs: list[Sequence]) -> torch.Tensor:
    """(N,) tokens drawn from the processed logits (N, V), or their argmax for greedy rows."""
    greedy = logits.argmax(-1)
    if "temperature" not in inputs:
        return greedy
    temperature = inputs["temperature"].unsqueeze(1)
    greedy_rows = temperature == 0.0
    scaled = logits / torch.where(greedy_rows, 1.0, temperature)
    if "top_k" in inputs:
        scaled = truncated(scaled, inputs)
    probs = scaled.softmax(-1)
    race = torch.empty_like(probs).exponential_()
    for row, seq in enumerate(seqs):
        if seq.generator is not None and not seq.params.greedy:
            race[row].exponential_(generator=seq.generator)
    # an exponential draw of exactly 0 would win with any probability, even a removed token's
    drawn = probs.div_(race.clamp_(min=torch.finfo(race.dtype).tiny)).argmax(-1)
    return torch.where(greedy_rows[:, 0], greedy, drawn)


def _at_temperature(logits: torch.Tensor, raw_logprobs: torch.Tensor, token_ids: torch.Tensor,
                    rows: torch.Tensor | None, temperature: torch.Tensor) -> torch.Tensor:
    """(N, 1): each sampled token's raw log-prob, and on `rows` (None: every row) its log-prob
    with the logits over that row's `temperature` (one pass over the vocabulary for those rows alone)."""
    ids, temperature = token_ids.unsqueeze(1), temperature.unsqueeze(1)
    if rows is None:
        return logits.gather(1, ids) / temperature - (logits / temperature).logsumexp(-1, keepdim=True)
    picked = logits.index_select(0, rows)
    values = picked.gather(1, ids.index_select(0, rows)) / temperature \
        - (picked / temperature).logsumexp(-1, keepdim=True)
    return raw_logprobs.gather(1, ids).index_put((rows,), values)


class Sampler:
    def __init__(self, eos_token_ids: set[int], grammar_vocab: int = 0):
        self.eos_token_ids = eos_token_ids
        # tokens a grammar's mask covers (engine/structured.py, `mask_vocab`): the tokenizer's, where it
        # has more than the logits (an added special token past the model's vocabulary); 0: the logits'
        self.grammar_vocab = grammar_vocab
        self._staging: HostStaging | None = None
        # runs once, just before the next blocking read of sampled ids, when the step's
        # device work is queued (the async engine delivers the step before's outputs there)
        self.before_read_back: Callable[[], None] | None = None

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """logits: (N, V), one row per sequence, in the model's dtype; never modified."""
        if self._staging is None or self._staging.device != logits.device:
            self._staging = HostStaging(logits.device)
        host = _host_inputs(seqs, self.eos_token_ids, logits.shape[-1], max(self.grammar_vocab, logits.shape[-1]))
        inputs = self._staging.upload(**host) if host else {}
        logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) \
            if any(s.params.logprobs is not None or s.track_logprob for s in seqs) else None
        token_ids = _drawn(_processed(logits, inputs), inputs, seqs)
        tracked = None
        if "tracked_temperature" in inputs:  # rows tracked at their sampling temperature (GRPO's), the others raw
            tracked = _at_temperature(logits, raw_logprobs, token_ids, inputs.get("tracked_rows"),
                                      inputs["tracked_temperature"])
        results = self._read_back(token_ids, raw_logprobs, tracked, seqs)
        for seq, result in zip(seqs, results):
            if seq.matcher is not None:
                seq.matcher.consume_token(result.token_id)
        return results

    def _read_back(self, token_ids: torch.Tensor, raw_logprobs: torch.Tensor | None, tracked: torch.Tensor | None,
                   seqs: list[Sequence]) -> list[SampledToken]:
        """The sampled ids, with their log-probs and the top alternatives asked for, in one
        host read (ids are exact in float64), once everything it reads is queued. `tracked`:
        (N, 1), the tracked values where they are not the raw log-probs."""
        if raw_logprobs is None:
            self._queued()
            return [SampledToken(t, None) for t in token_ids.tolist()]
        k = max(s.params.logprobs or 0 for s in seqs)
        ids = token_ids.unsqueeze(1)
        columns = [ids.double(), raw_logprobs.gather(1, ids).double()]
        if tracked is not None:
            columns.append(tracked.double())
        tracked_column, first_top = len(columns) - 1, len(columns)
        if k:
            values, indices = raw_logprobs.topk(k, dim=-1)
            columns += [values.double(), indices.double()]
        rows = torch.cat(columns, 1)
        self._queued()
        results = []
        for row, seq in zip(rows.tolist(), seqs):
            token, value = int(row[0]), row[1]
            logprob = None
            if seq.params.logprobs is not None:
                n, top = seq.params.logprobs, row[first_top:]
                logprob = TokenLogprob(token, value, [(int(i), v) for i, v in zip(top[k:k + n], top[:n])])
            results.append(SampledToken(token, logprob, row[tracked_column] if seq.track_logprob else None))
        return results

    def _queued(self) -> None:
        if self.before_read_back is not None:
            callback, self.before_read_back = self.before_read_back, None
            callback()
