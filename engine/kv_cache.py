"""The engine-owned paged KV cache.

Each layer has one K and one V tensor of shape (num_blocks * block_size, KVH, D): a pool
of fixed-size blocks. A sequence owns a list of blocks (its block table); token position
`p` lives in slot `block_ids[p // block_size] * block_size + p % block_size`. Blocks are
allocated as a sequence grows and freed when it finishes or is preempted, so memory
follows the tokens actually held, not max_model_len per sequence. Blocks are reference
counted: the samples of one request share their prompt's full blocks (a fork, see
engine/scheduler.py), and a block returns to the pool when its last holder lets go;
prompts that begin alike share their full blocks through the prefix cache
(engine/block_pool.py).

Memory per token: 2 (K, V) * num_layers * num_kv_heads * head_dim * dtype bytes
(SmolLM2-135M in float32: 2 * 30 * 3 * 64 * 4 = 46,080 bytes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from engine.direct_apply import direct_apply
from engine.paged_decode import PagedDecode
from engine.step_inputs import StepBuckets


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @classmethod
    def from_model_config(cls, config, dtype: torch.dtype, block_size: int) -> "KVCacheSpec":
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return cls(config.num_hidden_layers, kv_heads, head_dim, dtype, block_size)

    @property
    def bytes_per_token(self) -> int:
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize

    def num_blocks_for(self, budget_bytes: int) -> int:
        return budget_bytes // (self.bytes_per_token * self.block_size)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class PagedKVCache:
    """The K/V block pool of every layer, and one scratch block past the allocator's
    blocks, where the padded rows of a static-shape step write their K/V."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, device: torch.device):
        self.spec = spec
        self.num_blocks = num_blocks
        self.scratch_slot = num_blocks * spec.block_size
        shape = ((num_blocks + 1) * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.keys = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
        self.values = [torch.zeros(shape, dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]

    @property
    def memory_bytes(self) -> int:
        return self.num_blocks * self.spec.block_size * self.spec.bytes_per_token

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copies each (source, destination) block's K/V in every layer: a forked
        sequence's own copy of its prompt's last, partial block."""
        if not copies:
            return
        size = self.spec.block_size
        device = self.keys[0].device
        src = torch.tensor([b * size + i for b, _ in copies for i in range(size)], device=device)
        dst = torch.tensor([b * size + i for _, b in copies for i in range(size)], device=device)
        for pool in (*self.keys, *self.values):
            pool.index_copy_(0, dst, pool[src])


@dataclass
class AttentionGroup:
    """Sequences whose attention runs as one call: b sequences padded to q query rows and
    S keys. A serving step has up to three — its decodes (q = 1), its prefills from position
    0 and those going on from earlier tokens —
    each with b, q and S rounded up to buckets (engine/step_inputs.py), so that decodes
    never pad to a prefill's length; the extra sequences, rows and keys are masked."""

    # (b, q) packed index of each sequence's query rows; padding points at row 0
    query_index: torch.Tensor
    # (b, q) absolute position of each query row; padding rows get -1
    query_positions: torch.Tensor
    # S: key positions per sequence (0 .. S-1), at least the group's longest context
    num_keys: int
    # (b, S) cache slot of each key position (a serving step), or packed row of the forward's
    # own K/V (AttentionMetadata.shared_prefix); padding points at slot 0 (masked)
    key_slots: torch.Tensor | None = None
    # a decode group that reads the pool in place instead (engine/paged_decode.py): no key_slots
    paged: PagedDecode | None = None
    # every sequence's queries are its positions 0, 1, …, so `mask` is SDPA's causal mask
    # (top-left): attention runs as the causal kernel, which skips the blocks above the
    # diagonal, instead of reading a mask (padding rows, whose outputs no row gathers,
    # then see more keys than `mask` gives them)
    causal: bool = False

    def __post_init__(self) -> None:
        self._masks: dict[tuple[int | None, torch.dtype], torch.Tensor] = {}

    def runs_causal(self, sliding_window: int | None = None) -> bool:
        """Whether attention runs as SDPA's causal kernel rather than reading `mask`."""
        return self.causal and (sliding_window is None or self.num_keys <= sliding_window)

    def allowed(self, sliding_window: int | None = None) -> torch.Tensor:
        """(b, 1, q, S) bool, True where a query may attend to a key."""
        positions = self.query_positions.unsqueeze(-1)  # (b, q, 1)
        keys = torch.arange(self.num_keys, device=positions.device)  # (S,)
        allowed = keys <= positions
        if sliding_window is not None:
            allowed &= keys > positions - sliding_window
        allowed[..., 0] |= positions[..., 0] < 0  # padding rows attend to one key, not none (NaN)
        return allowed.unsqueeze(1)

    def mask(self, sliding_window: int | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """(b, 1, q, S) in `dtype`: 0 where a query may attend to a key, −inf where not — what
        SDPA makes of the boolean mask (`allowed`) in every call, made once for every layer."""
        key = (sliding_window, dtype)
        if key not in self._masks:
            allowed = self.allowed(sliding_window)
            self._masks[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                allowed.logical_not(), float("-inf"))
        return self._masks[key]


@dataclass
class AttentionMetadata:
    """How one step's packed tokens map onto sequences and cache slots.

    The step's T new tokens of B sequences are packed along one axis (no padding in the
    linear layers). Attention regroups them per sequence, in one or more groups.
    """

    groups: list[AttentionGroup]
    # (T,) row of each packed token in the concatenation of the groups' flattened (b * q) outputs
    output_index: torch.Tensor
    # (T,) cache slot each new token's K/V is written to; None when nothing is cached
    slot_mapping: torch.Tensor | None = None

    @property
    def single(self) -> AttentionGroup:
        """The one group of a forward whose K/V are its own (training, a recorded prefill),
        but for a shared-prefix pack's, which has two."""
        assert len(self.groups) == 1, "a forward with its own K/V runs one attention group"
        return self.groups[0]

    @classmethod
    def packed(cls, lengths: list[int], starts: list[int], device: torch.device,
               buckets: StepBuckets | None = None) -> AttentionMetadata:
        """A training forward's metadata, one group: B sequences packed along one axis,
        sequence b's queries being positions starts[b] .. starts[b] + lengths[b] - 1 and its
        keys positions 0 .. that end; the forward keeps its K/V itself (no slots). With
        `buckets`, the query length and the key length are rounded up to them (the keys of
        a shared prefix, then each sequence's padded queries', then padding: every column
        past a query's position is masked), so that a run of prompts of every length
        attends in a few shapes. A serving step's, with cache slots, is built by
        ModelRunner._pack."""
        batch, q_max = len(lengths), max(lengths)
        num_keys = max(s + n for s, n in zip(starts, lengths))
        if buckets is not None:
            q_max = buckets.query(q_max)
            num_keys = buckets.keys(max(starts) + q_max)
        query_index = torch.zeros(batch, q_max, dtype=torch.long)
        query_positions = torch.full((batch, q_max), -1, dtype=torch.long)
        output_index = torch.empty(sum(lengths), dtype=torch.long)
        offset = 0
        for b, (n, start) in enumerate(zip(lengths, starts)):
            query_index[b, :n] = torch.arange(offset, offset + n)
            query_positions[b, :n] = torch.arange(start, start + n)
            output_index[offset:offset + n] = torch.arange(b * q_max, b * q_max + n)
            offset += n
        group = AttentionGroup(query_index.to(device), query_positions.to(device), num_keys,
                               causal=not any(starts))
        return cls([group], output_index.to(device))

    @classmethod
    def shared_prefix(cls, prefix_len: int, suffix_lengths: list[int], device: torch.device,
                      buckets: StepBuckets | None = None) -> AttentionMetadata:
        """A forward of one prompt and the suffixes that continue it (DPO's responses, a
        GRPO group), packed as [prompt; suffix 1; …], so that every linear layer runs
        once over all their rows. Two attention groups: the prompt's, causal on itself,
        and the suffixes', each on the prompt's keys and then its own (positions
        prefix_len …) — no suffix query pads to the prompt's length. Both gather their
        keys from the forward's own packed K/V by `key_slots` (packed rows; padding
        points at row 0 and is masked, as every column past a query's position is)."""
        rows = [prefix_len, *suffix_lengths]
        offsets = [sum(rows[:i]) for i in range(len(rows))]
        q_prompt, q_suffix = prefix_len, max(suffix_lengths)
        if buckets is not None:
            q_prompt, q_suffix = buckets.query(q_prompt), buckets.query(q_suffix)
        keys_prompt = buckets.keys(q_prompt) if buckets is not None else prefix_len
        keys_suffix = buckets.keys(prefix_len + q_suffix) if buckets is not None else prefix_len + q_suffix
        groups, output_index, first_output = [], torch.empty(sum(rows), dtype=torch.long), 0
        for members, q_max, num_keys in (([0], q_prompt, keys_prompt), (range(1, len(rows)), q_suffix, keys_suffix)):
            query_index = torch.zeros(len(members), q_max, dtype=torch.long)
            query_positions = torch.full((len(members), q_max), -1, dtype=torch.long)
            key_slots = torch.zeros(len(members), num_keys, dtype=torch.long)
            for b, member in enumerate(members):
                n, offset, start = rows[member], offsets[member], 0 if member == 0 else prefix_len
                query_index[b, :n] = torch.arange(offset, offset + n)
                query_positions[b, :n] = torch.arange(start, start + n)
                key_slots[b, :prefix_len] = torch.arange(prefix_len)
                key_slots[b, start:start + n] = torch.arange(offset, offset + n)
                output_index[offset:offset + n] = torch.arange(first_output + b * q_max, first_output + b * q_max + n)
            first_output += len(members) * q_max
            groups.append(AttentionGroup(query_index.to(device), query_positions.to(device), num_keys,
                                         key_slots.to(device), causal=not groups))
        return cls(groups, output_index.to(device))

    @property
    def reads_packed_keys(self) -> bool:
        """A forward whose groups gather their keys from its own packed K/V (`shared_prefix`)."""
        return self.slot_mapping is None and self.groups[0].key_slots is not None


def gather_rows(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`rows[index]` for a long `index` of any shape, as `index_select` on the first axis:
    its backward adds the gradient back with `index_add`, where advanced indexing's
    accumulates with `index_put_` — which on a GPU sorts the indices, launching several
    kernels, on every training layer's query, key, value and output regrouping. The
    values are the same, and so are the sums (a padding row points at row 0 with a zero
    gradient)."""
    if index.dim() == 1:
        return rows.index_select(0, index)
    return rows.index_select(0, index.reshape(-1)).view(*index.shape, *rows.shape[1:])


def own_storage(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor`, copied if it is a view of a larger output: V is a slice of its layer's
    fused q|k|v GEMM (trainer/training_copy.py, Phi-3's qkv_proj), and a recording that
    kept the slice would keep all of it. The copy stays in the graph."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone()
    return tensor


def _cached_rows(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The pool's rows at `slots` as (1, KVH, P, D): a copy, strided as the pool is."""
    return pool.index_select(0, slots).transpose(0, 1).unsqueeze(0)


class CachedPrefixGrads:
    """Where the gradients on one layer's keys and values of a prompt's cached beginning
    accumulate, (1, KVH, P, D) each (None until a backward reaches them): what training
    back-propagates through that beginning recomputed (trainer.methods.cached_prefix_backward).
    It holds no rows itself: the beginning's rows live once, in the whole prompt's K/V."""

    __slots__ = ("key", "value")

    def __init__(self):
        self.key: torch.Tensor | None = None
        self.value: torch.Tensor | None = None

    def add(self, key: torch.Tensor | None = None, value: torch.Tensor | None = None) -> None:
        """Accumulates gradients on the rows, (1, KVH, P, D) each: slices of a larger
        gradient are copied, not kept as views of all of it (with one K/V head a slice is
        contiguous already)."""
        if key is not None:
            self.key = own_storage(key.contiguous()) if self.key is None else self.key + key
        if value is not None:
            self.value = own_storage(value.contiguous()) if self.value is None else self.value + value


class _AfterCachedPrefix(torch.autograd.Function):
    """(key, value) of new tokens -> the whole prompt's, the cached beginning's rows before
    them; backward hands those rows' gradients to `grads` (CachedPrefixGrads) instead of to
    autograd leaves, which the graph would keep alive beside the concatenation: a second
    copy of every cached row for as long as the recording lives."""

    @staticmethod
    def forward(ctx, key, value, cached_key, cached_value, grads):
        ctx.grads, ctx.num = grads, cached_key.shape[2]
        return torch.cat([cached_key, key], dim=2), torch.cat([cached_value, value], dim=2)

    @staticmethod
    def backward(ctx, grad_key, grad_value):
        num = ctx.num
        ctx.grads.add(grad_key[:, :, :num], grad_value[:, :, :num])
        return grad_key[:, :, num:], grad_value[:, :, num:], None, None, None


_after_cached_prefix = direct_apply(_AfterCachedPrefix)


def after_cached_prefix(key: torch.Tensor, value: torch.Tensor, cached_key: torch.Tensor,
                        cached_value: torch.Tensor, grads: CachedPrefixGrads) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole prompt's (key, value), (1, KVH, P + T, D): the cached beginning's rows
    `cached_key`, `cached_value` (no grad; P of them) before the new tokens' `key`, `value`
    (T); the gradients on the cached rows accumulate in `grads`."""
    return _after_cached_prefix(key, value, cached_key, cached_value, grads)


class RecordedStepKV(NamedTuple):
    """A recorded step's keys (or values) for attention when other sequences' decodes ride
    along in it: the recorded prompt's own, graph-connected rows, padded to the key length
    of its group (group 0), and the pool, from which the other groups gather theirs."""

    own: torch.Tensor  # (1, KVH, S, D)
    pool: torch.Tensor  # (slots, KVH, D)


class StepKV:
    """The `past_key_values` a decoder layer sees during one engine step: `update()`
    stores the step's new K/V in the pool and returns the pools, (slots, KVH, D) each,
    from which attention gathers each group's keys (engine/attention.py).

    With `recorded_rows` (a recorded prefill: one sequence's whole prompt, the step's first
    rows) the pool gets detached copies while the prompt's attention uses its live,
    graph-connected K/V, padded to its group's key length, whose prompt rows are kept in
    `recorded` per layer (once: where a pad copies them, the rows are views of the copy
    attention saves); decode later reads only the pool, so it never touches the graph. Decodes
    riding along in the step (the rows past those) read the pool (`RecordedStepKV`). With
    `cached_rows` too (the prompt after a beginning of that many tokens the prefix cache
    holds, at its group's first key slots) the beginning's K/V are read from the pool and
    go before the recorded rows (`recorded` holds the whole prompt's, the beginning's rows
    once); their gradients land in `prefix` (per layer), which training back-propagates
    through the beginning recomputed.
    """

    def __init__(self, cache: PagedKVCache, metadata: AttentionMetadata, recorded_rows: int | None = None,
                 cached_rows: int = 0):
        self.cache = cache
        self.metadata = metadata
        self.recorded_rows = recorded_rows
        self.prefix_slots = metadata.groups[0].key_slots[0, :cached_rows] if cached_rows else None
        self.recorded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.prefix: dict[int, CachedPrefixGrads] = {}
        # bytes of the cached beginning's rows within the recorded K/V, every layer's
        self.prefix_bytes = 0

    def prefix_grads(self) -> list[CachedPrefixGrads]:
        """Where the cached beginning's K/V gradients land, layer by layer (none without
        `prefix_slots`)."""
        return [self.prefix[i] for i in sorted(self.prefix)]

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key, value: (1, KVH, T, D) -> the pools; when recording, (1, KVH, S, D) each, or
        a `RecordedStepKV` each when decodes ride along."""
        slots = self.metadata.slot_mapping
        k_pool, v_pool = self.cache.keys[layer_idx], self.cache.values[layer_idx]
        k_pool.index_copy_(0, slots, key[0].transpose(0, 1).detach())
        v_pool.index_copy_(0, slots, value[0].transpose(0, 1).detach())
        rows = self.recorded_rows
        if rows is None:
            return k_pool, v_pool
        if self.prefix_slots is not None:
            grads = self.prefix[layer_idx] = CachedPrefixGrads()
            cached_key, cached_value = (_cached_rows(pool, self.prefix_slots) for pool in (k_pool, v_pool))
            key, value = after_cached_prefix(key[:, :, :rows], value[:, :, :rows], cached_key, cached_value, grads)
            self.prefix_bytes += cached_key.nbytes + cached_value.nbytes
            rows += len(self.prefix_slots)
        pad = self.metadata.groups[0].num_keys - rows
        if pad:  # to a bucketed key length (a GPU's): copies, which attention saves; the rows kept are views of them
            key, value = (torch.nn.functional.pad(t[:, :, :rows], (0, 0, 0, pad)) for t in (key, value))
            self.recorded[layer_idx] = (key[:, :, :rows], value[:, :, :rows])
        else:  # as they are (a zero pad would copy them, and attention save the copy beside them)
            key, value = own_storage(key), own_storage(value)
            if rows < key.shape[2]:  # the prompt's rows; the riding decodes' few stay in the storage
                key, value = key[:, :, :rows], value[:, :, :rows]
            self.recorded[layer_idx] = (key, value)
        if len(self.metadata.groups) == 1:
            return key, value
        return RecordedStepKV(key, k_pool), RecordedStepKV(value, v_pool)
