"""CUDA-graph decode: the inference-mode decode forward captured once per shape, replayed.

A decode-only step is already static in shape (engine/step_inputs.py): its rows are
padded to the batch bucket b (padded rows read token 0 at position 0, attend to one
masked key and write their K/V to the cache's scratch slot) and its keys to the key
bucket S. With paged decode attention (engine/paged_decode.py) the keys are not part of
the shape, the block table is, padded to the longest: one graph per b. `DecodeGraphs`
keeps static input buffers of the largest shape, captures the forward (embedding,
decoder layers, final norm) for each (b, S) into CUDA graphs sharing
one memory pool, largest first (vLLM's and nano-vllm's way), and per step copies the
step's inputs into the buffers' first b rows and replays. The LM head and the sampler
run after it, eagerly, on the sampled rows only.

A graph reads every tensor by address, so whatever serving reads must change in place:
the KV pools do; LoRA parameters change in place under the optimizer and a rollback;
the weight stash swaps parameters only inside training slices, never across a serving
step. Mixed steps (a prefill chunk beside decodes), the recorded prefill and every
autograd path run eagerly. On the CPU, or with `model.enforce_eager`, nothing is
captured: the same padded step runs eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.kv_cache import AttentionGroup, AttentionMetadata
from engine.paged_decode import PagedDecode

logger = logging.getLogger(__name__)


@dataclass
class CaptureReport:
    graphs: int
    seconds: float
    # device memory the graphs' pool and the static buffers hold
    memory_bytes: int


class DecodeGraphs:
    def __init__(self, runner, max_batch: int, max_keys: int, enforce_eager: bool, paged: bool = False):
        """`runner`: the ModelRunner whose `forward_hidden` is captured; `max_batch`,
        `max_keys`: the largest batch and key buckets a decode step can have; `paged`:
        decode attention reads the pool in place (engine/paged_decode.py), so a graph's
        shape is its batch alone, captured with room for the longest block table."""
        self.runner = runner
        self.enabled = runner.device.type == "cuda" and not enforce_eager
        self.max_batch, self.max_keys = max_batch, max_keys
        self.paged = paged
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.replays = 0
        self._pool = None
        self._buffers: dict[str, torch.Tensor] | None = None

    def _static(self) -> dict[str, torch.Tensor]:
        if self._buffers is None:
            device, rows, scratch = self.runner.device, self.max_batch, self.runner.kv_cache.scratch_slot
            hidden_size = self.runner.model.config.hidden_size
            dtype = next(self.runner.model.parameters()).dtype
            self._buffers = {
                "input_ids": torch.zeros(rows, dtype=torch.long, device=device),
                "positions": torch.zeros(rows, dtype=torch.long, device=device),
                "slot_mapping": torch.full((rows,), scratch, dtype=torch.long, device=device),
                "query_positions": torch.full((rows, 1), -1, dtype=torch.long, device=device),
                "key_slots": torch.zeros(rows, 0 if self.paged else self.max_keys, dtype=torch.long, device=device),
                "block_table": torch.zeros(rows, self.max_keys // self.runner.block_size if self.paged else 0,
                                           dtype=torch.long, device=device),
                "rows": torch.arange(rows, device=device),
                "hidden": torch.zeros(rows, hidden_size, dtype=dtype, device=device),
            }
        return self._buffers

    def _forward(self, batch: int, num_keys: int) -> None:
        """The decode forward on the static buffers' first `batch` rows (what is captured)."""
        static = self._static()
        rows = static["rows"][:batch]
        if self.paged:
            paged = PagedDecode(static["block_table"][:batch], static["query_positions"][:batch, 0],
                                self.runner.block_size, self.runner.kv_cache.num_blocks + 1)
            group = AttentionGroup(rows.view(batch, 1), static["query_positions"][:batch], num_keys, paged=paged)
        else:
            group = AttentionGroup(rows.view(batch, 1), static["query_positions"][:batch], num_keys,
                                   static["key_slots"][:batch, :num_keys])
        metadata = AttentionMetadata([group], rows, static["slot_mapping"][:batch])
        static["hidden"][:batch] = self.runner.forward_hidden(static["input_ids"][:batch],
                                                              static["positions"][:batch], metadata)

    def _capture(self, batch: int, num_keys: int) -> torch.cuda.CUDAGraph:
        self._forward(batch, num_keys)  # warm-up: lazy initialisations happen outside the graph
        torch.cuda.synchronize(self.runner.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(batch, num_keys)
        if self._pool is None:
            self._pool = graph.pool()
        self.graphs[(batch, num_keys)] = graph
        return graph

    def capture_all(self, batches: list[int], key_lengths: list[int]) -> CaptureReport | None:
        """Captures every (batch, keys) shape, largest first (the first sizes the pool);
        returns the time and memory it took (None when graphs are off)."""
        if not self.enabled:
            return None
        device = self.runner.device
        torch.cuda.synchronize(device)
        free_before = torch.cuda.mem_get_info(device)[0]
        started = time.perf_counter()
        key_lengths = [self.max_keys] if self.paged else sorted(key_lengths, reverse=True)
        shapes = [(b, k) for b in sorted(batches, reverse=True) for k in key_lengths]
        # the capture stream and the graphs' pool belong to the current device: the model's
        with torch.inference_mode(), torch.cuda.device(device):
            for batch, num_keys in shapes:
                try:
                    self._capture(batch, num_keys)
                except RuntimeError:  # e.g. a model whose forward reads the host: it runs eagerly
                    logger.exception("capturing the decode step (batch %d, %d keys) failed: decode runs eagerly",
                                     batch, num_keys)
                    self.graphs.clear()
                    self.enabled = False
                    break
        torch.cuda.synchronize(device)
        report = CaptureReport(len(self.graphs), time.perf_counter() - started,
                               free_before - torch.cuda.mem_get_info(device)[0])
        logger.info("captured %d CUDA graphs of the decode step in %.1f s, %.0f MiB", report.graphs, report.seconds,
                    report.memory_bytes / 2**20)
        return report

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """(b, hidden) of a padded decode-only step: replayed when its shape was captured,
        run eagerly otherwise (graphs off, or a shape beyond the captured ones)."""
        group = metadata.single
        batch, num_keys = group.query_index.shape[0], group.num_keys
        graph = self.graphs.get((batch, self.max_keys if self.paged else num_keys)) if self.enabled else None
        if graph is None:
            return self.runner.forward_hidden(input_ids, positions, metadata)
        static = self._static()
        static["input_ids"][:batch].copy_(input_ids)
        static["positions"][:batch].copy_(positions)
        static["slot_mapping"][:batch].copy_(metadata.slot_mapping)
        static["query_positions"][:batch].copy_(group.query_positions)
        if self.paged:
            static["block_table"][:batch].copy_(group.paged.block_table)
        else:
            static["key_slots"][:batch, :num_keys].copy_(group.key_slots)
        with torch.cuda.device(self.runner.device):
            graph.replay()
        self.replays += 1
        return static["hidden"][:batch]
