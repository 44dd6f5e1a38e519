"""Executes one scheduled step on the model, layer by layer. No policy here.

The step's new tokens of all sequences are packed into one (1, T) row; the runner calls
the model's parts in order — embedding, each decoder layer, final norm, LM head — so that
later stages can record, preempt and offload per layer. The LM head runs only on the
rows that are sampled (each sequence's last token when its pending tokens are done) and
on the prompt rows whose logprobs were asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.attention import use_engine_attention
from engine.packed_linear import install_packed_linear
from engine.kv_cache import AttentionMetadata, KVCacheSpec, PagedKVCache, StepKV
from engine.outputs import TokenLogprob
from engine.sampler import SampledToken, Sampler, top_logprobs
from engine.scheduler import ScheduledSequence, SchedulerOutput

# prompt-logprob rows pushed through the LM head at once (bounds a (rows, vocab) tensor)
_PROMPT_LOGPROB_CHUNK = 256


@dataclass
class ModelOutput:
    # seq_id -> the token sampled for it this step
    sampled: dict[int, SampledToken] = field(default_factory=dict)
    # seq_id -> logprobs of prompt tokens computed this step, in prompt order
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


@dataclass
class _PackedStep:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    # packed row of each sampled sequence's last token, and which scheduled entry it is
    sample_rows: list[int]
    sample_entries: list[ScheduledSequence]
    # (entry, packed rows, prompt token positions whose logprob those rows give)
    prompt_logprob_rows: list[tuple[ScheduledSequence, list[int], list[int]]]


def decoder_parts(model):
    """(embed_tokens, layers, norm, rotary_emb, lm_head) of a causal LM."""
    base = model.model
    return base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head


class ModelRunner:
    def __init__(self, model, kv_spec: KVCacheSpec, num_blocks: int, sampler: Sampler, packed_linear: bool = True):
        self.model = model
        self.device = next(model.parameters()).device
        use_engine_attention(model)
        if packed_linear:
            install_packed_linear(model)
        self.embed, self.layers, self.norm, self.rotary, self.lm_head = decoder_parts(model)
        self.kv_cache = PagedKVCache(kv_spec, num_blocks, self.device)
        self.block_size = kv_spec.block_size
        self.sampler = sampler

    def _pack(self, step: SchedulerOutput) -> _PackedStep:
        ids: list[int] = []
        positions: list[int] = []
        query_rows: list[list[int]] = []
        sample_rows, sample_entries, prompt_rows = [], [], []
        for entry in step.scheduled:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            first_row = len(ids)
            ids.extend(seq.token_id_at(p) for p in range(start, end))
            positions.extend(range(start, end))
            query_rows.append(list(range(first_row, len(ids))))
            if entry.completes_pending and len(seq.output_token_ids) < seq.max_tokens:
                sample_rows.append(len(ids) - 1)
                sample_entries.append(entry)
            if seq.wants_prompt_logprobs:
                # the logits at position p score prompt token p + 1
                targets = [p + 1 for p in range(start, end) if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens]
                if targets:
                    prompt_rows.append((entry, [first_row + t - 1 - start for t in targets], targets))
        device = self.device
        batch = len(query_rows)
        q_max = max(len(r) for r in query_rows)
        query_index = torch.zeros(batch, q_max, dtype=torch.long)
        query_positions = torch.full((batch, q_max), -1, dtype=torch.long)
        output_index = torch.empty(len(ids), dtype=torch.long)
        context_lens = []
        block_tables = []
        for b, (rows, entry) in enumerate(zip(query_rows, step.scheduled)):
            n = len(rows)
            query_index[b, :n] = torch.tensor(rows)
            query_positions[b, :n] = torch.tensor(positions[rows[0]:rows[0] + n])
            output_index[rows[0]:rows[0] + n] = torch.arange(b * q_max, b * q_max + n)
            context_lens.append(entry.seq.num_computed_tokens + n)
            block_tables.append(entry.seq.block_ids)
        max_ctx = max(context_lens)
        max_blocks = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.long)
        key_pos = torch.arange(max_ctx)
        key_slots = table[:, key_pos // self.block_size] * self.block_size + key_pos % self.block_size
        pos_tensor = torch.tensor(positions, dtype=torch.long)
        slot_mapping = torch.empty(len(ids), dtype=torch.long)
        for rows, table_row in zip(query_rows, table):
            row_pos = pos_tensor[rows[0]:rows[-1] + 1]
            slot_mapping[rows[0]:rows[-1] + 1] = table_row[row_pos // self.block_size] * self.block_size \
                + row_pos % self.block_size
        metadata = AttentionMetadata(
            slot_mapping=slot_mapping.to(device), query_index=query_index.to(device),
            output_index=output_index.to(device), key_slots=key_slots.to(device),
            query_positions=query_positions.to(device),
        )
        return _PackedStep(torch.tensor(ids, device=device), pos_tensor.to(device), metadata,
                           sample_rows, sample_entries, prompt_rows)

    def forward_hidden(self, packed: _PackedStep) -> torch.Tensor:
        """Runs embedding, decoder layers and final norm; returns (T, hidden)."""
        hidden = self.embed(packed.input_ids.unsqueeze(0))  # (1, T, hidden)
        position_ids = packed.positions.unsqueeze(0)
        position_embeddings = self.rotary(hidden, position_ids)
        past = StepKV(self.kv_cache, packed.metadata)
        for layer in self.layers:
            hidden = layer(hidden, attention_mask=packed.metadata, position_ids=position_ids,
                           past_key_values=past, position_embeddings=position_embeddings)
            if isinstance(hidden, tuple):
                hidden = hidden[0]
        return self.norm(hidden)[0]

    @torch.inference_mode()
    def execute(self, step: SchedulerOutput) -> ModelOutput:
        packed = self._pack(step)
        hidden = self.forward_hidden(packed)
        output = ModelOutput()
        if packed.sample_rows:
            logits = self.lm_head(hidden[packed.sample_rows])  # (N, V)
            seqs = [entry.seq for entry in packed.sample_entries]
            for seq, token in zip(seqs, self.sampler.sample(logits, seqs)):
                output.sampled[seq.seq_id] = token
        for entry, rows, targets in packed.prompt_logprob_rows:
            seq = entry.seq
            results: list[TokenLogprob] = []
            for i in range(0, len(rows), _PROMPT_LOGPROB_CHUNK):
                chunk_rows = rows[i:i + _PROMPT_LOGPROB_CHUNK]
                logprobs = self.lm_head(hidden[chunk_rows]).float().log_softmax(-1)
                token_ids = torch.tensor([seq.prompt_token_ids[t] for t in targets[i:i + _PROMPT_LOGPROB_CHUNK]],
                                         device=logprobs.device)
                results.extend(top_logprobs(logprobs, token_ids, seq.params.prompt_logprobs))
            output.prompt_logprobs[seq.seq_id] = results
        return output
