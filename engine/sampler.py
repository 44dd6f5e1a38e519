"""Turns each sequence's next-token logits into a token, per that sequence's parameters.

Order of processing (vLLM's): penalties and min_tokens on the logits, then greedy argmax
or temperature -> top-k -> top-p -> min-p -> a draw. A sequence with a seed draws from its
own generator, so its tokens do not depend on what else is in the batch. Logprobs are
reported from the model's raw distribution, before any of this processing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprob
from engine.structured import mask_disallowed
from engine.sequence import Sequence


@dataclass
class SampledToken:
    token_id: int
    # None unless the sequence asked for logprobs
    logprob: TokenLogprob | None
    # the token's raw log-prob, for sequences that track their cumulative log-prob
    logprob_value: float | None = None


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, k: int) -> list[TokenLogprob]:
    """logprobs: (N, V) log-softmax rows; token_ids: (N,) -> a TokenLogprob per row."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in chosen]
    if k > 0:
        values, indices = logprobs.topk(k, dim=-1)
        tops = [list(zip(i, v)) for i, v in zip(indices.tolist(), values.tolist())]
    return [TokenLogprob(t, lp, top) for t, lp, top in zip(token_ids.tolist(), chosen, tops)]


def _apply_penalties(logits: torch.Tensor, seq: Sequence) -> None:
    """logit_bias, then repetition/presence/frequency penalties, in place on one row (V,)."""
    params = seq.params
    if params.logit_bias:
        ids = torch.tensor(list(params.logit_bias), device=logits.device)
        logits[ids] += torch.tensor(list(params.logit_bias.values()), dtype=logits.dtype, device=logits.device)
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(seq.prompt_token_ids + seq.output_token_ids, device=logits.device).unique()
        values = logits[seen]
        logits[seen] = torch.where(values > 0, values / params.repetition_penalty,
                                   values * params.repetition_penalty)
    if seq.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(seq.output_token_ids, device=logits.device),
                                minlength=logits.shape[-1])[: logits.shape[-1]].to(logits.dtype)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(logits.dtype)


def _truncate(logits: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on one row (V,); returns filtered logits."""
    params = seq.params
    logits = logits / params.temperature
    if params.top_k == -1 and params.top_p == 1.0 and params.min_p == 0.0:
        return logits
    sorted_logits, order = logits.sort(descending=True)
    remove = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if params.top_k != -1:
        remove[params.top_k:] = True
    probs = sorted_logits.softmax(-1)
    if params.top_p < 1.0:
        remove |= (probs.cumsum(-1) - probs) >= params.top_p  # keep tokens until top_p is reached
    if params.min_p > 0.0:
        remove |= probs < params.min_p * probs[0]
    remove[0] = False
    filtered = torch.full_like(logits, float("-inf"))
    filtered[order[~remove]] = sorted_logits[~remove]
    return filtered


class Sampler:
    def __init__(self, eos_token_ids: set[int]):
        self.eos_token_ids = eos_token_ids

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[SampledToken]:
        """logits: (N, V), one row per sequence, in the model's dtype; never modified."""
        logits = logits.float()
        if any(s.params.uses_penalties or len(s.output_token_ids) < s.params.min_tokens or s.matcher is not None
               for s in seqs):
            logits = logits.clone()  # the rows are edited below
        raw_logprobs = None
        if any(s.params.logprobs is not None or s.track_logprob for s in seqs):
            raw_logprobs = logits.log_softmax(-1)
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        greedy_rows = []
        for row, seq in enumerate(seqs):
            params = seq.params
            needs_min_tokens = len(seq.output_token_ids) < params.min_tokens
            if params.uses_penalties or needs_min_tokens:
                if params.uses_penalties:
                    _apply_penalties(logits[row], seq)
                if needs_min_tokens:
                    banned = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
                    logits[row, list(banned)] = float("-inf")
            if seq.matcher is not None:  # after the log-probs are taken: they stay the model's own
                mask_disallowed(seq.matcher, logits[row])
            if params.greedy:
                greedy_rows.append(row)
            else:
                probs = _truncate(logits[row], seq).softmax(-1)
                token_ids[row] = torch.multinomial(probs, 1, generator=seq.generator)[0]
        if greedy_rows:
            rows = torch.tensor(greedy_rows, device=logits.device)
            token_ids[rows] = logits[rows].argmax(-1)
        results = [SampledToken(t, None) for t in token_ids.tolist()]
        for seq, result in zip(seqs, results):
            if seq.matcher is not None:
                seq.matcher.consume_token(result.token_id)
        if raw_logprobs is not None:
            for row, seq in enumerate(seqs):
                if seq.track_logprob:
                    results[row].logprob_value = raw_logprobs[row, results[row].token_id].item()
                if seq.params.logprobs is not None:
                    results[row].logprob = top_logprobs(
                        raw_logprobs[row:row + 1], token_ids[row:row + 1], seq.params.logprobs)[0]
        return results
