"""Request-level KV-cache bookkeeping on top of the `BlockPool`.

Each request owns a list of blocks (its block table): block i holds the KV of tokens
[i * block_size, (i + 1) * block_size). Prefix caching works on full blocks only: once a block's tokens
are all scheduled, it is registered under the chained hash of its tokens, and a later request whose
prompt starts with the same full blocks reuses them instead of computing them again.
"""

from __future__ import annotations

from collections.abc import Sequence

from voltllm.core.block_pool import BlockPool, KVCacheBlock, hash_block_tokens
from voltllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request; counts prefix-cache queries and hits."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_caching=enable_prefix_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # how many of a request's blocks are registered
        # Per request, the token count up to which `allocate_slots` (without prefix hits) has nothing
        # to do: no block to add and none filled up to register. Read-only outside this class; it
        # spares the scheduler's decode loop any call in here between block boundaries.
        self.quiet_until: dict[str, int] = {}
        self.prefix_cache_queries = 0  # cumulative tokens looked up
        self.prefix_cache_hits = 0  # cumulative tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest run of cached full blocks at the start of a request's tokens, and its token count.

        Never covers the last token: a step must compute at least one token to produce the logits the
        request samples from, so a full hit stops one block short.
        """
        if not self.enable_prefix_caching:
            return [], 0
        hashes = self._block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_prefix_query(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup, once the request it was made for is actually admitted (a request that
        has to wait is looked up again next step and must not be counted twice)."""
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> Sequence[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens of `request` (after `new_computed_blocks`, the
        prefix hits found for it this step). Returns the blocks added to its table, or None — changing
        nothing — when the pool is too small right now."""
        request_id = request.request_id
        if not new_computed_blocks and (
            request.num_computed_tokens + num_new_tokens <= self.quiet_until.get(request_id, -1)
        ):
            return ()  # most decodes: inside the last block, which they do not fill
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_total = num_computed + num_new_tokens
        num_new_blocks = max(0, cdiv(num_total, self.block_size) - len(blocks) - len(new_computed_blocks))
        added: Sequence[KVCacheBlock] = ()  # a decode that only fills its last block adds none
        if num_new_blocks or new_computed_blocks:
            # Reviving a free cached block takes it out of the free pool as surely as allocating one.
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if num_new_blocks + num_revived > self.pool.num_free_blocks:
                if not blocks:
                    del self.req_to_blocks[request.request_id]
                return None
            self.pool.touch(new_computed_blocks)
            added = [*new_computed_blocks, *self.pool.allocate(num_new_blocks)]
            blocks.extend(added)
        self._cache_full_blocks(request, blocks, num_total)
        self.quiet_until[request_id] = self._quiet_limit(request_id, len(blocks))
        return added

    def free(self, request: Request) -> None:
        """Release a finished, aborted or preempted request's blocks (cached ones stay reusable)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_hashed_blocks.pop(request.request_id, None)
        self.quiet_until.pop(request.request_id, None)
        self.pool.free(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Register the blocks that this step fills completely. Their KV is written by the step that
        was just scheduled; a request that hits them in the same step reads them only after the
        attention backend has written the step's K/V (backends write before they attend)."""
        if not self.enable_prefix_caching:
            return
        num_full = num_tokens // self.block_size
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, num_full):
            self.pool.cache_block(blocks[i], hashes[i])
        self._num_hashed_blocks[request.request_id] = num_full

    def _quiet_limit(self, request_id: str, num_blocks: int) -> int:
        limit = num_blocks * self.block_size
        if self.enable_prefix_caching:
            # One token short of filling the first block not yet registered.
            limit = min(limit, (self._num_hashed_blocks.get(request_id, 0) + 1) * self.block_size - 1)
        return limit

    def _block_hashes(self, request: Request) -> list[bytes]:
        """The chained hashes of every full block of the request's known tokens (memoised on it)."""
        hashes = request.block_hashes
        bs = self.block_size
        tokens = request.all_token_ids
        while len(hashes) < len(tokens) // bs:
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs : (i + 1) * bs]))
        return hashes
