"""A serving step's inputs: shapes from a few buckets, built on the host, copied at once.

Two things make a GPU step cost more host time than device time (DESIGN.md, "On a GPU:
the decode step"), and both are settled here:

- **Shapes.** Attention's batch, query and key lengths are rounded up to buckets
  (`StepBuckets`), so that a server under traffic reuses a bounded set of attention
  shapes — a fused kernel's graph, or a captured CUDA graph, per shape — instead of one
  new shape per step as contexts grow by a token. Padded sequences and keys are masked.
- **Copies.** Everything a step computes from the host's bookkeeping (token ids,
  positions, cache slots, block tables, sampling parameters) is written into one pinned
  host buffer per dtype through a numpy view and copied to the device in one
  non-blocking copy per dtype (`HostStaging`), as vLLM's input batch does.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# the smallest key-length bucket: below it, a step's attention is cheap whatever its padding
_MIN_KEY_BUCKET = 16
# elements each staging buffer starts with (it doubles when a step needs more)
_STAGING_ELEMENTS = 1 << 16
_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool}


def next_power_of_two(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


@dataclass(frozen=True)
class StepBuckets:
    """Rounds attention's dimensions up to powers of two: batch and query length, and the
    key length (at least `min_keys`, a multiple of the KV block size). With
    `half_octaves`, lengths round up to 2^k or 1.5 x 2^k instead (at most 1.5x padding for
    twice the shapes: recorded prefills and training forwards, whose attention pays for
    padding in compute and in what backward saves), and never past `max_len` (0: none)."""

    block_size: int
    min_keys: int = _MIN_KEY_BUCKET
    half_octaves: bool = False
    max_len: int = 0

    def batch(self, num_seqs: int) -> int:
        return next_power_of_two(num_seqs)

    def query(self, max_query: int) -> int:
        return self._capped(max_query, self._rounded(max_query))

    def keys(self, max_context: int) -> int:
        keys = self._rounded(max(max_context, self.min_keys))
        return self._capped(max_context, -(-keys // self.block_size) * self.block_size)

    def _rounded(self, n: int) -> int:
        size = next_power_of_two(n)
        return size * 3 // 4 if self.half_octaves and size * 3 // 4 >= n else size

    def _capped(self, n: int, size: int) -> int:
        return max(n, min(size, self.max_len)) if self.max_len else size

    def all_batches(self, max_num_seqs: int) -> list[int]:
        """Every batch bucket up to the one holding `max_num_seqs`, ascending."""
        return sorted({self.batch(n) for n in range(1, max_num_seqs + 1)})

    def all_keys(self, max_model_len: int) -> list[int]:
        """Every key bucket up to the one holding `max_model_len`, ascending."""
        buckets, n = [], 1
        while not buckets or buckets[-1] < max_model_len:
            buckets.append(self.keys(n))
            n = buckets[-1] + 1
        return buckets


@dataclass
class StepLayout:
    """A step's inputs as host arrays (named as the runner uploads them), and per
    attention group its (batch, keys) shape."""

    arrays: dict[str, np.ndarray]
    shapes: list[tuple[int, int]]
    # decode-only and bucketed: the rows too are padded to the batch bucket
    static: bool
    # per group: every sequence's queries begin at position 0 (AttentionGroup.causal)
    causal: list[bool]


def attention_kinds(members: np.ndarray, lengths: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """A serving step's sequences (`members`) by the attention group they join: decodes;
    prefills from position 0 (causal); prefills going on from earlier tokens."""
    prefills = members[lengths[members] > 1]
    return [members[lengths[members] == 1], prefills[starts[prefills] == 0], prefills[starts[prefills] > 0]]


def layout_step(lengths: list[int], starts: list[int], block_tables: list[list[int]], token_ids: list[int],
                sample_rows: list[int], buckets: StepBuckets | None, block_size: int,
                scratch_slot: int, first_alone: bool = False, exact_shapes: bool = False) -> StepLayout:
    """Sequence b computes `lengths[b]` tokens from position `starts[b]`, packed in order
    into rows `token_ids`. The decodes form one attention group, the prefills from position 0
    another (causal), and the prefills that go on from earlier tokens (a chunked prompt's
    next chunk, a prompt after its cached beginning) a third — none padded to another's
    queries — each padded to its own bucketed shape (`buckets`; None: one exact group, as a
    recorded prefill runs). With `first_alone` the first sequence is group 0 by itself
    (a recorded prefill, which attends to its own graph-connected K/V) and the others
    follow, grouped as above (decodes riding along in its step). With `exact_shapes` the
    groups are split by kind but keep their exact shapes (`exact_step_shapes`). Otherwise a
    decode-only step also pads its rows to the batch bucket: padded rows read token 0 at
    position 0 and write their K/V to `scratch_slot`."""
    lengths_, starts_ = np.array(lengths), np.array(starts)
    num_rows = len(token_ids)
    row_offsets = np.cumsum(lengths_) - lengths_
    seq_of_row = np.repeat(np.arange(len(lengths_)), lengths_)
    row_in_seq = np.arange(num_rows) - row_offsets[seq_of_row]
    positions = starts_[seq_of_row] + row_in_seq
    rest = np.arange(1 if first_alone else 0, len(lengths_))
    kinds = [rest] if buckets is None else attention_kinds(rest, lengths_, starts_)
    members = ([np.arange(1)] if first_alone else []) + [m for m in kinds if m.size]
    arrays: dict[str, np.ndarray] = {"input_ids": np.array(token_ids, dtype=np.int64), "positions": positions,
                                     "sample_rows": np.array(sample_rows, dtype=np.int64),
                                     "slot_mapping": np.empty(num_rows, dtype=np.int64),
                                     "output_index": np.empty(num_rows, dtype=np.int64)}
    member_of_seq = np.empty(len(lengths_), dtype=np.int64)  # a sequence's place in its group
    shapes, causal, output_offset = [], [], 0
    for g, seqs in enumerate(members):
        batch, q_max = len(seqs), int(lengths_[seqs].max())
        num_keys = int((starts_[seqs] + lengths_[seqs]).max())
        causal.append(bool((starts_[seqs] == 0).all()))
        if buckets is not None and not exact_shapes:
            batch, q_max, num_keys = buckets.batch(batch), buckets.query(q_max), buckets.keys(num_keys)
        table = np.zeros((batch, -(-num_keys // block_size)), dtype=np.int64)
        for b, seq in enumerate(seqs):
            blocks = block_tables[seq][:table.shape[1]]
            table[b, :len(blocks)] = blocks
        member_of_seq[seqs] = np.arange(len(seqs))
        rows = np.flatnonzero(np.isin(seq_of_row, seqs))
        b, r, p = member_of_seq[seq_of_row[rows]], row_in_seq[rows], positions[rows]
        query_index = np.zeros((batch, q_max), dtype=np.int64)
        query_index[b, r] = rows
        query_positions = np.full((batch, q_max), -1, dtype=np.int64)
        query_positions[b, r] = p
        arrays["slot_mapping"][rows] = table[b, p // block_size] * block_size + p % block_size
        arrays["output_index"][rows] = output_offset + b * q_max + r
        output_offset += batch * q_max
        arrays.update({f"table{g}": table, f"query_index{g}": query_index, f"query_positions{g}": query_positions})
        shapes.append((batch, num_keys))
    static = buckets is not None and not exact_shapes and not first_alone and bool((lengths_ == 1).all())
    if static:
        batch = shapes[0][0]
        pad = batch - num_rows
        for name, fill in (("input_ids", 0), ("positions", 0), ("slot_mapping", scratch_slot)):
            arrays[name] = np.concatenate([arrays[name], np.full(pad, fill, dtype=np.int64)])
        arrays["output_index"] = np.arange(batch, dtype=np.int64)
        arrays["query_index0"] = arrays["output_index"].reshape(batch, 1)
    return StepLayout(arrays, shapes, static, causal)


class HostStaging:
    """Copies named host arrays to the device, one copy per dtype.

    Each dtype has a host buffer (pinned on CUDA) written through a numpy view made once,
    so that filling it reads no tensor; `upload` copies the used part to a fresh device
    tensor (non-blocking from pinned memory) and returns views of it by name. Before a
    buffer is written again, the copy that last read it has finished (a CUDA event)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pin = device.type == "cuda"
        self._host: dict[np.dtype, tuple[torch.Tensor, np.ndarray]] = {}
        self._copied: dict[np.dtype, torch.cuda.Event] = {}

    def _buffer(self, dtype: np.dtype, size: int) -> tuple[torch.Tensor, np.ndarray]:
        held = self._host.get(dtype)
        if held is None or held[1].size < size:
            capacity = max(size, 2 * held[1].size if held is not None else _STAGING_ELEMENTS)
            tensor = torch.empty(capacity, dtype=_TORCH_DTYPES[dtype], pin_memory=self._pin)
            held = self._host[dtype] = (tensor, tensor.numpy())
        return held

    def upload(self, **arrays: np.ndarray) -> dict[str, torch.Tensor]:
        groups: dict[np.dtype, list[tuple[str, np.ndarray]]] = {}
        for name, array in arrays.items():
            groups.setdefault(array.dtype, []).append((name, array))
        out: dict[str, torch.Tensor] = {}
        for dtype, named in groups.items():
            size = sum(array.size for _, array in named)
            event = self._copied.pop(dtype, None)
            if event is not None:
                event.synchronize()
            host, view = self._buffer(dtype, size)
            offset = 0
            for _, array in named:
                view[offset:offset + array.size] = array.ravel()
                offset += array.size
            copied = host[:size].to(self.device, non_blocking=self._pin, copy=True)
            if self._pin:  # recorded on the stream that copies: the device's current one
                self._copied[dtype] = torch.cuda.Event()
                self._copied[dtype].record(torch.cuda.current_stream(self.device))
            offset = 0
            for name, array in named:
                out[name] = copied[offset:offset + array.size].view(array.shape)
                offset += array.size
        return out


def exact_step_shapes(device: torch.device) -> bool:
    """Whether serving steps run at their exact shapes. A GPU builds a fused kernel's graph,
    and captures a CUDA graph, per shape, so it rounds batch, query and key lengths up to
    buckets; the CPU builds none, and the padding is compute: a 300-token prompt attends as
    512 x 512, five decoding streams run as eight rows over keys rounded to a power of two."""
    return device.type != "cuda"


def training_buckets(device: torch.device, block_size: int, max_model_len: int) -> StepBuckets | None:
    """The shapes of recorded prefills' and training forwards' attention. On a GPU each
    new shape builds a fused kernel's graph (cuDNN's on sm90) in the middle of a request
    or a training slice: half-octave buckets. The CPU has none to build, and runs them
    unpadded (padding costs compute and grows what a recording saves): None."""
    if device.type != "cuda":
        return None
    return StepBuckets(block_size, half_octaves=True, max_len=max_model_len)
