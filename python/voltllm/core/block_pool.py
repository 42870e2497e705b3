"""The physical KV-cache blocks: reference counts, the prefix-cache hash map and the eviction order.

A block is in exactly one of three places:
- in use: `ref_cnt > 0` (shared by every request whose prefix it holds);
- free and empty: no hash, in `_free_empty` (handed out first);
- free and cached: `ref_cnt == 0` but it still holds a full block's KV under a hash, in `_free_cached`
  in least-recently-freed order. Such a block can be revived by a prefix hit, or evicted (its hash
  dropped) when no empty block is left. Keeping cached blocks behind empty ones means a cached prefix
  is only lost when the pool is otherwise exhausted.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence


def hash_block_tokens(parent_hash: bytes | None, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: depends on the block's tokens and everything before it.

    A cryptographic hash (blake2b) so that a crafted prompt cannot collide with another user's prefix
    and read its cached KV. Token ids are hashed as 32-bit integers (16 of them and the parent hash
    fit one blake2b block), or as 64-bit ones if one does not fit: a different length, so the two
    encodings cannot collide.
    """
    n = len(token_ids)
    try:
        packed = (_PACK32.get(n) or _packer("I", n))(*token_ids)
    except struct.error:
        packed = _packer("q", n)(*token_ids)
    return hashlib.blake2b((parent_hash or _NO_PARENT) + packed, digest_size=16).digest()


_NO_PARENT = b"\0" * 16
_PACK32: dict[int, Callable[..., bytes]] = {}


def _packer(code: str, n: int) -> Callable[..., bytes]:
    # A compiled struct packs a block's ids ~2x faster than array(code, ids).tobytes().
    pack = struct.Struct(f"<{n}{code}").pack
    if code == "I":
        _PACK32[n] = pack
    return pack


class KVCacheBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """Owns every block; allocation, ref counting, hashing and LRU eviction happen only here."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free_empty: deque[KVCacheBlock] = deque(self.blocks)
        self._free_cached: OrderedDict[int, KVCacheBlock] = OrderedDict()  # block_id -> block, LRU first
        self._cached: dict[bytes, KVCacheBlock] = {}  # block hash -> block holding that content

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (empty ones plus evictable cached ones)."""
        return len(self._free_empty) + len(self._free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` free blocks (ref_cnt 1 each), evicting cached ones only when needed."""
        free_empty = self._free_empty
        if num_blocks > len(free_empty) + len(self._free_cached):
            raise ValueError(f"cannot allocate {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            if free_empty:
                block = free_empty.popleft()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def allocate_one(self) -> KVCacheBlock | None:
        """`allocate(1)` without the list, or None when no block is free (a decode at a boundary)."""
        if self._free_empty:
            block = self._free_empty.popleft()
        elif self._free_cached:
            _, block = self._free_cached.popitem(last=False)
            self._evict(block)
        else:
            return None
        block.ref_cnt = 1
        return block

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to blocks found by a prefix hit, taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free_cached[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block. Pass a request's blocks tail first, so that when
        evictions come, the ends of prefixes go before their (more shareable) beginnings."""
        for block in blocks:
            assert block.ref_cnt > 0, f"double free of {block}"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is None:
                    self._free_empty.append(block)
                else:
                    self._free_cached[block.block_id] = block

    def cache_block(self, block: KVCacheBlock, block_hash: bytes) -> bool:
        """Register a full, in-use block under its hash. Returns False when that content is already
        cached in another block (two requests computed it in the same step); the block then stays
        private and returns to the empty queue when freed."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use, because running
        requests still expect their blocks to be shareable."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._free_cached.values():
            block.block_hash = None
            self._free_empty.append(block)
        self._free_cached.clear()
        self._cached.clear()
        return True

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self._cached[block.block_hash]
        block.block_hash = None
