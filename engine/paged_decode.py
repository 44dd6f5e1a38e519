"""Paged decode attention: each decoding sequence reads its K/V straight from the block
pool through its block table, with PyTorch's FlexAttention (`model.decode_attention =
"flex"`).

The gathered path (engine/attention.py) copies every decoding sequence's keys and values
out of the pool into a padded (b, S) tensor at every layer, then runs SDPA on the copy:
on a GPU the context's K/V cross memory three times per layer, and the key bucket S is
part of every decode graph's shape. Here the pool itself is the key and value tensor,
(1, KVH, slots, D), and a `BlockMask` says what each row reads:

- `kv_indices` (b, 1, 1, blocks): the row's block table, in order;
- `kv_num_blocks` (b, 1, 1): how many of those hold its context (0 for a padded row,
  whose output is zeros);
- a mask_mod that maps a pool slot back to the row's logical position, through a
  (b, pool blocks) table that is -1 where the row's sequence holds no block (a block a
  fork shares is in several rows), and allows positions up to the query's, and within
  the model's sliding window if it has one.

The mask is built once per step and read by every layer. On a GPU FlexAttention is
compiled (its Triton kernels visit only the listed blocks), and a decode graph's shape
no longer depends on the keys: one per batch bucket (engine/decode_graphs.py). The CPU
runs FlexAttention's eager reference, which evaluates the mask over the whole pool; it
serves to prove this path equal to the gathered one (tests/test_paged_decode.py). The
layout is that of PyTorch's experimental `PagedAttention`.
"""

from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

# rows per query block of the mask: a decode row is one query, alone in its block. 128 is
# a multiple of every query tile FlexAttention's kernels pick (its decoding kernel serves
# query heads per KV head in powers of two, the main kernel the others)
_QUERY_BLOCK = 128
# the key tile FlexAttention's kernels start from; a smaller KV block gets a tile of its size
_KEY_TILE = 64
_MIN_GPU_KEY_TILE = 16
# compiled shapes FlexAttention may keep: one per batch bucket (and sliding window) is
# needed, past dynamo's default limit it would run unfused over the whole pool
_RECOMPILE_LIMIT = 64


class PagedDecode:
    """A decode group's reading of the pool for one step."""

    def __init__(self, block_table: torch.Tensor, positions: torch.Tensor, block_size: int, pool_blocks: int):
        """`block_table`: (b, blocks) each row's block table (entries past its context are
        ignored); `positions`: (b,) each row's query position, -1 for a padded row;
        `pool_blocks`: the blocks of the pool, its scratch block included."""
        self.block_table, self.positions = block_table, positions
        self.block_size, self.pool_blocks = block_size, pool_blocks
        self._masks: dict[int | None, BlockMask] = {}

    def block_mask(self, sliding_window: int | None = None) -> BlockMask:
        if sliding_window not in self._masks:
            self._masks[sliding_window] = self._build(sliding_window)
        return self._masks[sliding_window]

    def _build(self, sliding_window: int | None) -> BlockMask:
        rows, width = self.block_table.shape
        size, positions = self.block_size, self.positions
        index = torch.arange(width, device=positions.device)
        held = index <= torch.div(positions, size, rounding_mode="floor").unsqueeze(1)  # (b, blocks)
        # the table's entries past a row's context go to the scratch block's column, which stays -1
        scratch = self.pool_blocks - 1
        logical = torch.full((rows, self.pool_blocks), -1, dtype=torch.int32, device=positions.device)
        logical.scatter_(1, torch.where(held, self.block_table, scratch),
                         torch.where(held, index, -1).to(torch.int32))
        logical[:, scratch] = -1

        def mask_mod(b, h, q_idx, kv_idx):
            block = logical[b, kv_idx // size]
            position = block * size + kv_idx % size
            allowed = (block >= 0) & (position <= positions[b])
            if sliding_window is not None:
                allowed = allowed & (position > positions[b] - sliding_window)
            return allowed

        return BlockMask.from_kv_blocks(held.sum(1, dtype=torch.int32).view(rows, 1, 1),
                                        self.block_table.to(torch.int32).view(rows, 1, 1, width),
                                        BLOCK_SIZE=(_QUERY_BLOCK, size), mask_mod=mask_mod,
                                        seq_lengths=(1, self.pool_blocks * size), compute_q_blocks=False)


class BlockTooSmall(ValueError):
    """KV blocks smaller than the key tile FlexAttention's GPU kernel can multiply."""


@functools.cache
def _compiled_flex_attention():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    setattr(config, name, max(getattr(config, name), _RECOMPILE_LIMIT))
    return torch.compile(flex_attention, dynamic=False)


def paged_decode_attention(query: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
                           paged: PagedDecode, scale: float | None, sliding_window: int | None) -> torch.Tensor:
    """query: (b, H, 1, D); the pools: (slots, KVH, D). Returns (b, H, 1, D)."""
    keys, values = key_pool.permute(1, 0, 2).unsqueeze(0), value_pool.permute(1, 0, 2).unsqueeze(0)
    block_mask = paged.block_mask(sliding_window)
    enable_gqa = keys.shape[1] != query.shape[1]
    if query.device.type != "cuda":
        return flex_attention(query, keys, values, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa)
    options = {"BLOCK_N": paged.block_size} if paged.block_size < _KEY_TILE else None
    return _compiled_flex_attention()(query, keys, values, block_mask=block_mask, scale=scale,
                                      enable_gqa=enable_gqa, kernel_options=options)


def compile_paged_decode(key_pool: torch.Tensor, value_pool: torch.Tensor, heads: int, batches: list[int],
                         table_width: int, block_size: int, sliding_window: int | None) -> Exception | None:
    """Compiles the paged decode attention of every batch bucket now, on a pool of the
    serving one's shape (on a GPU: a compile is seconds, not for a request to wait on);
    returns the error that kept it from compiling, if one did."""
    if key_pool.device.type == "cuda" and block_size < _MIN_GPU_KEY_TILE:
        return BlockTooSmall(f"cache.block_size {block_size} is under the {_MIN_GPU_KEY_TILE} tokens that "
                             "FlexAttention's GPU kernel needs as its key tile (Triton's dot)")
    head_dim = key_pool.shape[2]
    pool_blocks = key_pool.shape[0] // block_size
    try:
        with torch.inference_mode():
            for batch in batches:
                query = torch.zeros(batch, heads, 1, head_dim, dtype=key_pool.dtype, device=key_pool.device)
                table = torch.zeros(batch, table_width, dtype=torch.long, device=key_pool.device)
                positions = torch.full((batch,), -1, dtype=torch.long, device=key_pool.device)
                paged = PagedDecode(table, positions, block_size, pool_blocks)
                paged_decode_attention(query, key_pool, value_pool, paged, None, sliding_window)
    except Exception as exc:  # noqa: BLE001 - any compile failure: the engine serves the gathered path
        return exc
    return None
