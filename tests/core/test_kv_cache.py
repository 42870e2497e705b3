"""BlockPool and KVCacheManager: ref counts, prefix hits, eviction order, all-or-nothing allocation."""

from __future__ import annotations

import pytest

from voltllm.core.block_pool import BlockPool, hash_block_tokens
from voltllm.core.kv_cache_manager import KVCacheManager
from voltllm.core.request import Request
from voltllm.protocol import EngineSamplingParams


def req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, EngineSamplingParams())


def test_chained_hash_depends_on_parent_and_tokens():
    a = hash_block_tokens(None, [1, 2, 3, 4])
    assert a == hash_block_tokens(None, [1, 2, 3, 4])
    assert a != hash_block_tokens(None, [1, 2, 3, 5])
    assert hash_block_tokens(a, [9, 9, 9, 9]) != hash_block_tokens(None, [9, 9, 9, 9])
    # ids that do not fit 32 bits are hashed too, and not like their low 32 bits
    big = hash_block_tokens(None, [1 + 2**32, 2, 3, 4])
    assert big == hash_block_tokens(None, [1 + 2**32, 2, 3, 4]) and big != a


def test_pool_allocate_free_refcounts():
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert pool.num_free_blocks == 1 and all(b.ref_cnt == 1 for b in blocks)
    pool.touch([blocks[0]])
    pool.free(blocks)
    assert pool.num_free_blocks == 3 and blocks[0].ref_cnt == 1
    pool.free([blocks[0]])
    assert pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.allocate(5)


def test_empty_blocks_are_reused_before_cached_ones_and_cached_in_lru_order():
    pool = BlockPool(4)
    b = pool.allocate(4)
    pool.cache_block(b[0], b"h0")
    pool.cache_block(b[1], b"h1")
    pool.free([b[1], b[0], b[2], b[3]])  # cached b1 freed before cached b0
    first_two = pool.allocate(2)
    assert {x.block_id for x in first_two} == {2, 3}  # empty blocks first
    assert pool.get_cached_block(b"h0") is b[0] and pool.get_cached_block(b"h1") is b[1]
    [evicted] = pool.allocate(1)
    assert evicted is b[1] and pool.get_cached_block(b"h1") is None  # least recently freed goes first
    assert pool.get_cached_block(b"h0") is b[0]
    assert pool.allocate_one() is b[0] and b[0].ref_cnt == 1 and pool.get_cached_block(b"h0") is None
    assert pool.allocate_one() is None and pool.num_free_blocks == 0


def test_prefix_hit_and_full_hit_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", list(range(1, 13)))  # 12 tokens = 3 full blocks
    assert kv.get_computed_blocks(a) == ([], 0)
    assert kv.allocate_slots(a, 12) is not None
    kv.free(a)
    b = req("b", list(range(1, 13)))  # identical prompt
    hits, num = kv.get_computed_blocks(b)
    assert num == 8  # not 12: the last token must be computed to sample from it
    c = req("c", [*range(1, 9), 50, 51, 52])  # shares 2 blocks, then differs
    hits_c, num_c = kv.get_computed_blocks(c)
    assert num_c == 8 and [x.block_id for x in hits_c] == [x.block_id for x in hits]
    d = req("d", [99, *range(2, 13)])  # differs in block 0: chained hashes miss everything after
    assert kv.get_computed_blocks(d)[1] == 0


def test_allocate_with_hits_shares_blocks_and_counts():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    a = req("a", list(range(1, 10)))  # 9 tokens -> 3 blocks, 2 full
    kv.allocate_slots(a, 9)
    b = req("b", [*range(1, 9), 77, 78])
    hits, num = kv.get_computed_blocks(b)
    added = kv.allocate_slots(b, b.num_tokens - num, hits)
    kv.record_prefix_query(b.num_tokens, num)
    assert [x.block_id for x in added[:2]] == kv.get_block_ids("a")[:2]
    assert all(x.ref_cnt == 2 for x in added[:2])
    assert kv.prefix_cache_queries == 10 and kv.prefix_cache_hits == 8
    assert kv.num_free_blocks == 8 - 3 - 1


def test_allocation_failure_changes_nothing_and_free_restores_pool():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(1, 11)))
    assert kv.allocate_slots(a, 10) is not None  # 3 blocks
    b = req("b", list(range(20, 30)))
    assert kv.allocate_slots(b, 10) is None
    assert kv.num_free_blocks == 1 and "b" not in kv.req_to_blocks
    kv.free(a)
    assert kv.num_free_blocks == 4 and kv.usage == 0.0


def test_reviving_a_free_cached_block_is_counted_against_free_space():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    a = req("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)  # 2 blocks, both full and cached
    kv.free(a)
    b = req("b", [*range(1, 9), 40, 41, 42, 43, 44])  # 13 tokens: 2 hits + 2 new blocks needed
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    assert kv.allocate_slots(b, b.num_tokens - num, hits) is None  # 2 revived + 2 new > 3
    assert kv.get_computed_blocks(b)[1] == 8  # the failed attempt evicted nothing


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = req("a", list(range(1, 9)))
    kv.allocate_slots(a, 8)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(req("b", list(range(1, 10))))[1] == 0


@pytest.mark.parametrize("caching", [True, False])
def test_decode_adds_and_registers_blocks_exactly_at_block_boundaries(caching):
    """Between boundaries a decode's allocation is a no-op (the fast path); at each boundary the new
    block comes, and the block before it, filled by the previous step, is registered then."""
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_prefix_caching=caching)
    r = req("a", [1, 2, 3, 4, 5])
    for token in range(100, 112):
        num_blocks_before = len(kv.get_block_ids("a"))
        num_new = r.num_tokens - r.num_computed_tokens
        added = kv.allocate_slots(r, num_new)
        total = r.num_computed_tokens + num_new
        assert len(kv.get_block_ids("a")) == -(-total // 4)
        assert len(added) == -(-total // 4) - num_blocks_before
        assert kv.num_slots["a"] == 4 * len(kv.get_block_ids("a"))  # no call until the next block
        registered = [b.block_hash is not None for b in kv.req_to_blocks["a"]]
        # every full block but one that this very step fills with a decode
        assert sum(registered) == ((total - 1) // 4 if caching else 0)
        r.num_computed_tokens = total
        r.append_output_token(token)
    assert r.num_computed_tokens == 16  # blocks 0-3 full, block 3 filled by the last step
    assert sum(b.block_hash is not None for b in kv.req_to_blocks["a"]) == (3 if caching else 0)
    kv.free(r)
    assert kv.num_free_blocks == 16
    # release registers the full block the last decode filled
    assert kv.get_computed_blocks(req("b", r.all_token_ids))[1] == (16 if caching else 0)


def test_blocks_filled_by_decodes_serve_later_prefix_hits():
    kv = KVCacheManager(num_blocks=16, block_size=4)
    a = req("a", [1, 2, 3])
    for token in range(50, 60):  # decodes fill blocks 0-2 (12 tokens), none of them a prompt block
        kv.allocate_slots(a, a.num_tokens - a.num_computed_tokens)
        a.num_computed_tokens = a.num_tokens
        a.append_output_token(token)
    kv.free(a)
    b = req("b", a.all_token_ids[:12] + [99])
    hits, num = kv.get_computed_blocks(b)
    assert num == 12 and len(hits) == 3
