"""Executes one scheduled step on the model, layer by layer. No policy here.

The step's new tokens of all sequences are packed into one (1, T) row; the runner calls
the model's parts in order — embedding, each decoder layer, final norm, LM head — so that
later stages can record, preempt and offload per layer. The LM head runs only on the
rows that are sampled (each sequence's last token when its pending tokens are done) and
on the prompt rows whose logprobs were asked for.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field

import torch

from engine.attention import cache_keyword, use_engine_attention
from engine.decode_graphs import CaptureReport, DecodeGraphs
from engine.fused_norm import install_fused_rms_norm
from engine.fused_rope import LayerTables, RotaryTables, SignedRotary, install_fused_rope
from engine.gated_mlp import install_gated_mlp
from engine.packed_linear import install_packed_linear
from engine.kv_cache import AttentionGroup, AttentionMetadata, KVCacheSpec, PagedKVCache, StepKV
from engine.outputs import TokenLogprob
from engine.paged_decode import BlockTooSmall, PagedDecode, compile_paged_decode
from engine.recording import LayerSegment, RecordedPrefill, SavedTensorTracker, SegmentSink
from engine.sampler import SampledToken, Sampler, top_logprobs
from engine.saved_bytes_memo import RecordingShape, SavedBytesMemo
from engine.scheduler import ScheduledSequence, SchedulerOutput
from engine.step_inputs import HostStaging, StepBuckets, exact_step_shapes, layout_step, training_buckets

logger = logging.getLogger(__name__)

# prompt-logprob rows pushed through the LM head at once (bounds a (rows, vocab) tensor)
_PROMPT_LOGPROB_CHUNK = 256


@dataclass
class ModelOutput:
    # seq_id -> the token sampled for it this step
    sampled: dict[int, SampledToken] = field(default_factory=dict)
    # seq_id -> logprobs of prompt tokens computed this step, in prompt order
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # the graph of a recorded prefill step
    recording: RecordedPrefill | None = None
    # seq_id -> the sampled logits row of a sequence whose choices fork it this step
    fork_logits: dict[int, torch.Tensor] = field(default_factory=dict)


@dataclass
class _PackedStep:
    input_ids: torch.Tensor  # (T,)
    positions: torch.Tensor  # (T,)
    metadata: AttentionMetadata
    # packed row of each sampled sequence's last token (on the host and on the device),
    # and which scheduled entry it is
    sample_rows: list[int]
    sample_index: torch.Tensor
    sample_entries: list[ScheduledSequence]
    # (entry, packed rows, prompt token positions whose logprob those rows give)
    prompt_logprob_rows: list[tuple[ScheduledSequence, list[int], list[int]]]
    # a decode-only step padded to static shapes (rows past the sequences' are padding)
    static: bool = False


def run_to_end(generator):
    """Exhausts a generator and returns its return value."""
    while True:
        try:
            next(generator)
        except StopIteration as stop:
            return stop.value


def _collected(tracker: SavedTensorTracker, segment: int) -> list:
    """The saved tensors attributed to `segment` that autograd still holds."""
    return [saved for ref in tracker.collected.pop(segment, []) if (saved := ref()) is not None]


def decoder_parts(model):
    """(embed_tokens, layers, norm, rotary_emb, lm_head) of a causal LM."""
    base = model.model
    return base.embed_tokens, base.layers, base.norm, base.rotary_emb, model.lm_head


class ModelRunner:
    def __init__(self, model, kv_spec: KVCacheSpec, num_blocks: int, sampler: Sampler, packed_linear: bool = True,
                 max_num_seqs: int = 256, max_model_len: int = 8192, enforce_eager: bool = False,
                 decode_attention: str = "auto"):
        """`max_num_seqs`, `max_model_len`: the largest decode step (its CUDA graphs'
        shapes); `enforce_eager`: no CUDA graphs (engine/decode_graphs.py);
        `decode_attention`: "gather" (the decode rows' K/V copied out of the pool for
        SDPA), "flex" (read in place, engine/paged_decode.py) or "auto" (flex on a GPU)."""
        self.model = model
        self.device = next(model.parameters()).device
        use_engine_attention(model)
        install_fused_rms_norm(model)
        install_fused_rope(model)
        install_gated_mlp(model)
        if packed_linear:
            install_packed_linear(model)
        self.embed, self.layers, self.norm, rotary, self.lm_head = decoder_parts(model)
        self._cache_keyword = cache_keyword(self.layers[0])
        self.rotary = SignedRotary(rotary, getattr(model.config, "layer_types", None))
        self.kv_cache = PagedKVCache(kv_spec, num_blocks, self.device)
        self.block_size = kv_spec.block_size
        self.buckets = StepBuckets(kv_spec.block_size)
        self.training_buckets = training_buckets(self.device, kv_spec.block_size, max_model_len)
        self.exact_shapes = exact_step_shapes(self.device)
        self.staging = HostStaging(self.device)
        self._block_offsets = torch.arange(kv_spec.block_size, device=self.device)
        self.decode_batches = self.buckets.all_batches(max_num_seqs)
        self.decode_keys = self.buckets.all_keys(max_model_len)
        self.decode_attention = decode_attention
        self.paged_decode = decode_attention == "flex" or (decode_attention == "auto" and self.device.type == "cuda")
        self.decode_graphs = DecodeGraphs(self, self.decode_batches[-1], self.decode_keys[-1], enforce_eager,
                                          self.paged_decode)
        self.sampler = sampler
        # when set, recorded prefills are measured by this tracker (benchmarks measure a
        # recording and the training on it together); otherwise each gets its own
        self.record_tracker: SavedTensorTracker | None = None
        # set where recorded graphs save activations only and nothing offloads them: a
        # shape measured before is recorded without saved-tensor hooks (engine/saved_bytes_memo.py)
        self.saved_bytes_memo: SavedBytesMemo | None = None

    def _pack(self, step: SchedulerOutput, buckets: StepBuckets | None,
              recorded: bool = False) -> _PackedStep:
        """The step's inputs, built on the host and copied in one go (engine/step_inputs.py);
        with `buckets`, attention's batch, query and key lengths are rounded up to them
        (the packed rows, which the linear layers see, never are). `recorded`: the first
        sequence is a recorded prefill, its own attention group; the decodes riding along
        gather their K/V from the pool (never the paged reading, compiled for serving's
        shapes without autograd)."""
        ids: list[int] = []
        sample_rows, sample_entries, prompt_rows = [], [], []
        for entry in step.scheduled:
            seq, start = entry.seq, entry.seq.num_computed_tokens
            end = start + entry.num_new_tokens
            first_row = len(ids)
            ids.extend(seq.token_id_at(p) for p in range(start, end))
            if entry.completes_pending and len(seq.output_token_ids) < seq.max_tokens:
                sample_rows.append(len(ids) - 1)
                sample_entries.append(entry)
            if seq.wants_prompt_logprobs:
                # the logits at position p score prompt token p + 1
                targets = [p + 1 for p in range(start, end)
                           if len(seq.prompt_logprobs) <= p + 1 < seq.num_prompt_tokens]
                if targets:
                    prompt_rows.append((entry, [first_row + t - 1 - start for t in targets], targets))
        scheduled = step.scheduled
        layout = layout_step([e.num_new_tokens for e in scheduled], [e.seq.num_computed_tokens for e in scheduled],
                             [e.seq.block_ids for e in scheduled], ids, sample_rows, buckets, self.block_size,
                             self.kv_cache.scratch_slot, first_alone=recorded, exact_shapes=self.exact_shapes)
        inputs = self.staging.upload(**layout.arrays)
        groups = []
        for g, (batch, num_keys) in enumerate(layout.shapes):
            table, query_index, query_positions = inputs[f"table{g}"], inputs[f"query_index{g}"], \
                inputs[f"query_positions{g}"]
            if self.paged_decode and not recorded and buckets is not None and query_index.shape[1] == 1:
                # every step's table as wide as the longest context's: one compiled shape per batch bucket
                table = torch.nn.functional.pad(table, (0, self.decode_keys[-1] // self.block_size - table.shape[1]))
                paged = PagedDecode(table, query_positions[:, 0], self.block_size, self.kv_cache.num_blocks + 1)
                groups.append(AttentionGroup(query_index, query_positions, num_keys, paged=paged))
                continue
            slots = (table.unsqueeze(-1) * self.block_size + self._block_offsets).view(batch, -1)
            groups.append(AttentionGroup(query_index, query_positions, num_keys, slots[:, :num_keys],
                                         causal=layout.causal[g]))
        metadata = AttentionMetadata(groups, inputs["output_index"], inputs["slot_mapping"])
        return _PackedStep(inputs["input_ids"], inputs["positions"], metadata, sample_rows, inputs["sample_rows"],
                           sample_entries, prompt_rows, layout.static)

    def cache_info(self) -> dict[str, str]:
        """The KV cache's shape, as vLLM's `cache_config_info` metric labels it."""
        spec = self.kv_cache.spec
        return {"block_size": str(spec.block_size), "num_blocks": str(self.kv_cache.num_blocks),
                "bytes_per_token": str(spec.bytes_per_token), "dtype": str(spec.dtype)}

    def attention_metadata(self, lengths: list[int], starts: list[int]) -> AttentionMetadata:
        """Packed sequences' metadata for a forward outside a serving step (LayerwiseModel)."""
        return AttentionMetadata.packed(lengths, starts, self.device, self.training_buckets)

    def shared_prefix_metadata(self, prefix_len: int, suffix_lengths: list[int]) -> AttentionMetadata:
        """A prompt and its suffixes in one pack (LayerwiseModel)."""
        return AttentionMetadata.shared_prefix(prefix_len, suffix_lengths, self.device, self.training_buckets)

    def iter_layers(self, hidden: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata, past,
                    leaves: list[torch.Tensor] | None = None, outputs: list[torch.Tensor] | None = None,
                    position_embeddings: RotaryTables | LayerTables | None = None):
        """Generator over the decoder layers, yielding after each one (a training slice);
        returns the last layer's output. hidden: (1, T, hidden) -> (1, T, hidden).

        With `leaves`/`outputs` given, each layer's input is made a fresh autograd leaf
        (one segment per layer) and the leaves and outputs are appended to them."""
        position_ids = positions.unsqueeze(0)
        if position_embeddings is None:
            position_embeddings = self.rotary(hidden, position_ids)
        for index in range(len(self.layers)):
            if leaves is not None:
                hidden = hidden.detach().requires_grad_()
                leaves.append(hidden)
            hidden = self.run_layer(index, hidden, position_ids, metadata, past, position_embeddings)
            if outputs is not None:
                outputs.append(hidden)
            yield
        return hidden

    def run_layer(self, index: int, hidden: torch.Tensor, position_ids: torch.Tensor, metadata: AttentionMetadata,
                  past, position_embeddings: RotaryTables | LayerTables) -> torch.Tensor:
        """Decoder layer `index` on (1, T, hidden)."""
        out = self.layers[index](hidden, attention_mask=metadata, position_ids=position_ids,
                                 position_embeddings=position_embeddings.of_layer(index), **{self._cache_keyword: past})
        return out[0] if isinstance(out, tuple) else out

    def run_layers(self, *args, **kwargs) -> torch.Tensor:
        """`iter_layers` run to the end."""
        return run_to_end(self.iter_layers(*args, **kwargs))

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor,
                       metadata: AttentionMetadata) -> torch.Tensor:
        """Runs embedding, decoder layers and final norm on a step's (T,) packed rows; returns (T, hidden)."""
        hidden = self.embed(input_ids.unsqueeze(0))  # (1, T, hidden)
        hidden = self.run_layers(hidden, positions, metadata, StepKV(self.kv_cache, metadata))
        return self.norm(hidden)[0]

    def capture_decode_graphs(self) -> CaptureReport | None:
        """Captures the decode step's CUDA graphs for every batch and key bucket (a GPU
        without `enforce_eager`), once the model is final: adapters attached. Paged decode
        attention is compiled first (a GPU); if it cannot be, decode gathers its K/V."""
        if self.paged_decode and self.device.type == "cuda":
            config = self.model.config
            error = compile_paged_decode(self.kv_cache.keys[0], self.kv_cache.values[0], config.num_attention_heads,
                                         self.decode_batches, self.decode_keys[-1] // self.block_size,
                                         self.block_size, getattr(config, "sliding_window", None))
            if error is not None:  # asked for by name: an error; under auto, small blocks are a choice
                log = logger.error if self.decode_attention == "flex" else \
                    logger.info if isinstance(error, BlockTooSmall) else logger.warning
                log("paged decode attention (FlexAttention) is off, decode gathers its K/V instead: %s", error)
                self.paged_decode = self.decode_graphs.paged = False
        return self.decode_graphs.capture_all(self.decode_batches, self.decode_keys)

    def execute(self, step: SchedulerOutput, segment_sink: SegmentSink | None = None,
                stale_resolver=None, recording_weights=None) -> ModelOutput:
        """`segment_sink` receives a recorded prefill's layer segments as they complete
        (the offloader); `stale_resolver` resolves weights changed since a recording was
        made (SavedTensorTracker.resolve_stale); `recording_weights(version)`: the
        weights a prefill recorded under that adapter version runs with (None: the live)."""
        if step.recorded:
            output = self._execute_recorded(step, segment_sink, stale_resolver, recording_weights)
        else:
            with torch.inference_mode():
                output = self._execute(step)
        if step.forks:
            with torch.inference_mode():
                self._fork(step, output)
        return output

    def _fork(self, step: SchedulerOutput, output: ModelOutput) -> None:
        """The forked choices' own copies of their prompt's last block (now written), and
        their first tokens, sampled from their parent's last prompt row."""
        self.kv_cache.copy_blocks([copy for fork in step.forks for copy in fork.block_copies])
        for fork in step.forks:
            row = output.fork_logits.pop(fork.parent.seq_id)
            rows = row.unsqueeze(0).expand(len(fork.children), -1).contiguous()
            for child, token in zip(fork.children, self.sampler.sample(rows, fork.children)):
                output.sampled[child.seq_id] = token

    def _execute_recorded(self, step: SchedulerOutput, segment_sink: SegmentSink | None,
                          stale_resolver, recording_weights=None) -> ModelOutput:
        """A recorded prefill: one sequence's prompt (after what the prefix cache gave it,
        whose K/V it reads from the pool) with autograd on (LoRA only; base weights are frozen),
        kept as per-layer segments plus a head segment. Other sequences' decodes ride along:
        one GEMM per linear layer over all rows, their attention on the pool and their
        logits without autograd; no gradient reaches them (`bench recording`, beside_decodes*)."""
        weights = (recording_weights(step.scheduled[0].seq.record.adapter_version) if recording_weights is not None
                   else contextlib.nullcontext())
        with weights:
            return self._record_prefill(step, segment_sink, stale_resolver)

    def _record_prefill(self, step: SchedulerOutput, segment_sink: SegmentSink | None,
                        stale_resolver) -> ModelOutput:
        """`_execute_recorded` once the recorded version's weights are in place."""
        assert all(entry.num_new_tokens == 1 for entry in step.scheduled[1:]), "only decodes ride along"
        packed = self._pack(step, self.training_buckets, recorded=True)
        seq = step.scheduled[0].seq
        num_prompt = step.scheduled[0].num_new_tokens
        tracker = self.record_tracker or SavedTensorTracker()
        tracker.resolve_stale = stale_resolver
        saved_sizes: list[int] = []
        bytes_before = tracker.live_bytes
        leaves, outs = [], []
        cached = seq.num_computed_tokens  # the prompt's beginning the prefix cache gave it (RecordSpec)
        past = StepKV(self.kv_cache, packed.metadata, recorded_rows=num_prompt, cached_rows=cached)
        rows = packed.input_ids.shape[0]  # the prompt's, then the riders'
        placement = segment_sink.begin_recording(num_prompt, rows) if segment_sink is not None else None
        all_rows = seq.record.all_logit_rows
        memo = self.saved_bytes_memo if self.record_tracker is None and placement is None else None
        memo = memo if memo is not None and memo.applies() else None
        known = shape = None
        if memo is not None:
            group = packed.metadata.groups[0]
            shape = RecordingShape(rows, len(step.scheduled) - 1, group.query_index.shape[1],
                                   group.num_keys, all_rows, cached)
            known = memo.lookup(shape)
        try:
            tracker.new_storage_sizes = saved_sizes
            with torch.enable_grad(), tracker.hooks() if known is None else contextlib.nullcontext():
                with torch.no_grad():
                    hidden = self.embed(packed.input_ids.unsqueeze(0))
                rotary = self.rotary(hidden, packed.positions.unsqueeze(0))
                if placement is not None:
                    placement.keep(*rotary.tensors())
                layers = self.iter_layers(hidden, packed.positions, packed.metadata, past, leaves, outs, rotary)
                hidden = self._record_layers(layers, tracker, placement, leaves, outs, past)
                head_leaf = hidden[:, :num_prompt].detach().requires_grad_()
                normed = self.norm(head_leaf)[0]  # (T, hidden): the recorded prompt's rows
                logits = self.lm_head(normed if all_rows else normed[-1:])
            segments = [LayerSegment(leaf, out, *past.recorded[i]) for i, (leaf, out) in enumerate(zip(leaves, outs))]
            saved_bytes = tracker.live_bytes - bytes_before if known is None else known.total
            if known is None and memo is not None:
                memo.measured(shape, saved_bytes, saved_sizes)
            recording = RecordedPrefill(list(seq.prompt_token_ids), seq.record.adapter_version, segments,
                                        head_leaf, logits, all_rows, rows, saved_bytes,
                                        saved_sizes if known is None else known.sizes, placement, cached,
                                        past.prefix_grads(), past.prefix_bytes)
            if placement is not None:
                placement.finish(recording, _collected(tracker, len(segments)))
        except BaseException:
            if placement is not None:
                placement.release()
            raise
        finally:
            tracker.segment = tracker.collected = tracker.new_storage_sizes = None
        output = ModelOutput(recording=recording)
        with torch.inference_mode():
            self._sample_recorded_step(step, packed, logits, hidden, output)
        return output

    def _sample_recorded_step(self, step: SchedulerOutput, packed: _PackedStep, logits: torch.Tensor,
                              hidden: torch.Tensor, output: ModelOutput) -> None:
        """The recorded prompt's first token, from its recorded logits' last row, and the
        riders' next tokens (a chunked prompt's last token may ride too, and fork), from
        their rows of the last layer's output: one draw, so one host read for the step."""
        entries = packed.sample_entries
        prompt_samples = bool(entries) and entries[0] is step.scheduled[0]  # scheduled first, sampled first
        rows, seqs = [], [entry.seq for entry in entries]
        if prompt_samples:
            rows.append(logits[-1:].detach())
        if len(seqs) > prompt_samples:
            riders = packed.sample_index[1 if prompt_samples else 0:]
            rows.append(self.lm_head(self.norm(hidden[0].detach().index_select(0, riders))))
        if not seqs:
            return
        drawn = torch.cat(rows)  # a copy: no view keeps the recorded logits alive
        parents = {fork.parent.seq_id for fork in step.forks}
        for row, (sampled, token) in enumerate(zip(seqs, self.sampler.sample(drawn, seqs))):
            output.sampled[sampled.seq_id] = token
            if sampled.seq_id in parents:
                output.fork_logits[sampled.seq_id] = drawn[row]

    @staticmethod
    def _record_layers(layers, tracker: SavedTensorTracker, placement, leaves, outs, past) -> torch.Tensor:
        """Runs the recorded layers, attributing each saved tensor to its layer and handing
        each finished segment to `placement` (the offloader may copy it out at once)."""
        tracker.collected = {} if placement is not None else None
        index = tracker.segment = 0
        while True:
            try:
                next(layers)
            except StopIteration as stop:
                return stop.value  # the tracker's segment is now the head's (num_layers)
            if placement is not None:
                placement.add_segment(index, LayerSegment(leaves[index], outs[index], *past.recorded[index]),
                                      _collected(tracker, index))
            index = tracker.segment = index + 1

    def _execute(self, step: SchedulerOutput) -> ModelOutput:
        packed = self._pack(step, self.buckets)
        forward = self.decode_graphs.forward if packed.static else self.forward_hidden
        hidden = forward(packed.input_ids, packed.positions, packed.metadata)
        output = ModelOutput()
        if packed.sample_rows:
            logits = self.lm_head(hidden.index_select(0, packed.sample_index))  # (N, V)
            seqs = [entry.seq for entry in packed.sample_entries]
            for seq, token in zip(seqs, self.sampler.sample(logits, seqs)):
                output.sampled[seq.seq_id] = token
            parents = {fork.parent.seq_id for fork in step.forks}
            for row, seq in enumerate(seqs):
                if seq.seq_id in parents:
                    output.fork_logits[seq.seq_id] = logits[row]
        for entry, rows, targets in packed.prompt_logprob_rows:
            seq, results = entry.seq, []
            for i in range(0, len(rows), _PROMPT_LOGPROB_CHUNK):
                chunk_rows = rows[i:i + _PROMPT_LOGPROB_CHUNK]
                logprobs = self.lm_head(hidden[chunk_rows]).float().log_softmax(-1)
                token_ids = torch.tensor([seq.prompt_token_ids[t] for t in targets[i:i + _PROMPT_LOGPROB_CHUNK]],
                                         device=logprobs.device)
                results.extend(top_logprobs(logprobs, token_ids, seq.params.prompt_logprobs))
            output.prompt_logprobs[seq.seq_id] = results
        return output
