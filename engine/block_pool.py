"""KV block ids: the free list, reference counts, and the prefix cache's names of full blocks.

No tensors, so the scheduler can own it. A block is held by the sequences whose block
tables name it (the choices of one request share their prompt's full blocks) and returns
to the pool when its last holder lets go.

Automatic prefix caching (vLLM's): a full block — block_size tokens whose K/V are
computed — is named by a hash of its tokens chained onto the name of the block before it,
from a root that hashes the weights that computed them (`block_names`). A named block
nobody holds keeps its K/V and its name while it waits in the pool; a prompt that begins
with the same blocks takes them back (`take_cached_prefix`) instead of computing them. A
block is given to other tokens only when no nameless block is free, the least recently
freed first. The hash is SHA-256, vLLM's default: a client cannot make its blocks collide
with another's, as it could with Python's own hash of integers.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Sequence

import numpy as np


class OutOfBlocks(RuntimeError):
    pass


def cache_root(weights_generation: int, salt: str | None = None) -> bytes:
    """The name every chain of blocks starts from: the weights that compute their K/V (a
    new generation names every block anew), and a client's `cache_salt` (its own prefixes)."""
    seed = weights_generation.to_bytes(8, "little", signed=True) + (salt or "").encode()
    return hashlib.sha256(seed).digest()


def block_names(previous: bytes, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The names of the full blocks of `token_ids` (a partial last block has none), each
    chained onto the one before it; the first onto `previous`."""
    tokens = np.asarray(token_ids, dtype=np.int64)
    names = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        previous = hashlib.sha256(previous + tokens[start:start + block_size].tobytes()).digest()
        names.append(previous)
    return names


def names_of_first_blocks(seq, num_blocks: int, weights_generation: int, block_size: int) -> list[bytes]:
    """The names of an engine `Sequence`'s first `num_blocks` full blocks under the weights
    of `weights_generation` (those it was named before kept: a request that waits at the
    queue's head is not hashed again)."""
    names = seq.block_names if seq.kv_generation == weights_generation else []
    if len(names) < num_blocks:
        tokens = seq.token_ids_until(num_blocks * block_size)[len(names) * block_size:]
        root = names[-1] if names else cache_root(weights_generation, seq.cache_salt)
        names = names + block_names(root, tokens, block_size)
    return names


class BlockPool:
    """Free KV block ids, each block's holders, and the names of the cached ones."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        # free blocks without a name, taken first
        self._free: deque[int] = deque(range(num_blocks))
        # named blocks nobody holds, least recently freed first: given to other tokens last
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        # holders of each block (0: free)
        self._refs = [0] * num_blocks
        self._name_of: dict[int, bytes] = {}
        self._block_named: dict[bytes, int] = {}

    @property
    def num_free(self) -> int:
        """Blocks that can be allocated: free ones, named or not."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_named(self) -> int:
        """Blocks the prefix cache can hand out again, held or not."""
        return len(self._name_of)

    def allocate(self, count: int) -> list[int]:
        if count > self.num_free:
            raise OutOfBlocks(f"need {count} KV blocks, {self.num_free} free")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:  # the least recently freed named block loses its name
                block, _ = self._cached_free.popitem(last=False)
                del self._block_named[self._name_of.pop(block)]
            self._refs[block] = 1
            blocks.append(block)
        return blocks

    def share(self, block_ids: list[int]) -> None:
        """One more holder for each of `block_ids` (a forked sequence)."""
        for block in block_ids:
            assert self._refs[block] > 0, f"sharing free KV block {block}"
            self._refs[block] += 1

    def refs(self, block_id: int) -> int:
        return self._refs[block_id]

    def free(self, block_ids: list[int]) -> None:
        """One holder fewer for each of `block_ids`; a block nobody holds is free again (a
        named one, last in line to be given to other tokens, keeps its K/V for its name)."""
        for block in block_ids:
            self._refs[block] -= 1
            assert self._refs[block] >= 0, f"KV block {block} freed twice"
            if self._refs[block] == 0:
                if block in self._name_of:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)

    def cached_run(self, names: list[bytes]) -> list[int]:
        """The blocks named by the longest run of `names` from the first (nothing taken)."""
        blocks = []
        for name in names:
            block = self._block_named.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def take_cached_prefix(self, names: list[bytes]) -> list[int]:
        """The blocks named by the longest run of `names` from the first, each with one
        holder more (the caller)."""
        blocks = self.cached_run(names)
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached_free[block]
            self._refs[block] += 1
        return blocks

    def name(self, block: int, name: bytes) -> None:
        """`block` (held, full, its K/V computed) is cached as `name`, unless a block of that
        name is cached already (two sequences that computed the same tokens)."""
        if name not in self._block_named and block not in self._name_of:
            self._block_named[name] = block
            self._name_of[block] = name

    def forget_names(self) -> None:
        """The weights changed: no block's K/V stands for its name any more."""
        self._free.extend(self._cached_free)
        self._cached_free.clear()
        self._name_of.clear()
        self._block_named.clear()
